"""Per-layer / per-head line budgets of the vertical-slash pattern, loaded from a JSON or YAML file.

A budget is how many lines a query head keeps: ``v_size`` verticals (sink tokens included) and
``s_size`` slashes (local window included). In threshold mode they are caps. File format
(``.yaml``/``.yml`` or ``.json``; a value is one int for every head or a list with one int per
query head, every int >= 1)::

    num_heads: 16                       # optional: if given, every list must have this many values
    default: {v_size: 1024, s_size: 6144}   # required, both fields
    layers:                             # optional overrides, keyed by layer index (int or "int")
      0: {v_size: [512, 1024, ...]}     # a missing field falls back to `default`
      "5": {s_size: 4096}

Unknown keys, missing fields, non-integers, values < 1 and wrong list lengths are errors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

LineBudget = int | tuple[int, ...]
"""One budget for every head, or one per query head."""

_FIELDS = ("v_size", "s_size")
_TOP_KEYS = ("num_heads", "default", "layers")


@dataclass(frozen=True)
class Budgets:
    """Line budgets per layer and query head (see module docstring for the file format).

    Attributes:
        default: (v_size, s_size) used by every layer without an override.
        layers: ((layer_idx, v_size or None, s_size or None), ...) overrides, ascending by layer.
        num_heads: query heads every per-head list must cover, or None when not declared.
        source: where the budgets came from (a file path), quoted in every error.
    """

    default: tuple[LineBudget, LineBudget]
    layers: tuple[tuple[int, LineBudget | None, LineBudget | None], ...] = ()
    num_heads: int | None = None
    source: str = "<budgets>"

    @classmethod
    def from_dict(cls, data: Any, source: str = "<budgets>") -> Budgets:
        """Validate a parsed budgets document (the file format above) and build Budgets."""
        if not isinstance(data, dict):
            raise ValueError(
                f"{source}: the top level must be a mapping with keys {_TOP_KEYS}, got {type(data).__name__}"
            )
        unknown = sorted(str(k) for k in data if k not in _TOP_KEYS)
        if unknown:
            raise ValueError(f"{source}: unknown top-level key(s) {unknown}; allowed keys are {_TOP_KEYS}")
        num_heads = data.get("num_heads")
        if num_heads is not None:
            num_heads = _positive_int(num_heads, f"{source}: num_heads")
        if "default" not in data:
            raise ValueError(f"{source}: missing 'default: {{v_size: ..., s_size: ...}}'")
        v, s = _parse_entry(data["default"], f"{source}: default", num_heads)
        if v is None or s is None:
            raise ValueError(f"{source}: default must give both v_size and s_size")
        layers_data = data.get("layers") or {}
        if not isinstance(layers_data, dict):
            raise ValueError(f"{source}: layers must be a mapping from layer index to {{v_size, s_size}}")
        layers = {}
        for key, entry in layers_data.items():
            layer = _layer_index(key, source)
            if layer in layers:
                raise ValueError(f"{source}: layer {layer} is given twice; keep one entry per layer")
            layers[layer] = _parse_entry(entry, f"{source}: layers[{key!r}]", num_heads)
        return cls((v, s), tuple((k, *layers[k]) for k in sorted(layers)), num_heads, source)

    def for_layer(self, layer_idx: int, num_heads: int) -> tuple[Tensor, Tensor]:
        """(v_size, s_size) as int64 CPU tensors [num_heads] for this layer."""
        if self.num_heads is not None and num_heads != self.num_heads:
            raise ValueError(
                f"{self.source}: budgets are declared for num_heads={self.num_heads} but the model has "
                f"{num_heads} query heads; fix num_heads and the per-head lists"
            )
        v, s = self.default
        for layer, lv, ls in self.layers:
            if layer == layer_idx:
                v = v if lv is None else lv
                s = s if ls is None else ls
        return (
            _expand(v, num_heads, f"{self.source}: layer {layer_idx} v_size"),
            _expand(s, num_heads, f"{self.source}: layer {layer_idx} s_size"),
        )

    def min_values(self) -> tuple[int, int]:
        """Smallest v_size and smallest s_size anywhere in the file (to check sinks/window fit)."""
        vs = [self.default[0]] + [v for _, v, _ in self.layers if v is not None]
        ss = [self.default[1]] + [s for _, _, s in self.layers if s is not None]
        return _smallest(vs), _smallest(ss)


def load_budgets(path: str | Path) -> Budgets:
    """Read a budgets file (.json, .yaml or .yml); every problem raises ValueError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"budgets file {path} does not exist; pass the path of a .yaml/.yml/.json budgets file")
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ValueError(f"budgets file {path} must end in .json, .yaml or .yml (the suffix picks the parser)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(
            f"budgets file {path} cannot be read as UTF-8 text ({err}); write it as a UTF-8 file"
        ) from None
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: invalid JSON ({err}); fix the syntax") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"{path}: invalid YAML ({err}); fix the syntax") from None
    return Budgets.from_dict(data, source=str(path))


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where} must be an integer >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{where} must be >= 1, got {value}")
    return value


def _parse_budget(value: Any, where: str, num_heads: int | None) -> LineBudget:
    if isinstance(value, list):
        if not value:
            raise ValueError(f"{where} is an empty list; give one int per query head or a single int")
        if num_heads is not None and len(value) != num_heads:
            raise ValueError(f"{where} lists {len(value)} values but num_heads is {num_heads}; give one per head")
        return tuple(_positive_int(x, f"{where}[{i}]") for i, x in enumerate(value))
    return _positive_int(value, where)


def _parse_entry(entry: Any, where: str, num_heads: int | None) -> tuple[LineBudget | None, LineBudget | None]:
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be a mapping like {{v_size: 1024, s_size: 6144}}, got {entry!r}")
    unknown = sorted(str(k) for k in entry if k not in _FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed keys are {_FIELDS}")
    return tuple(  # type: ignore[return-value]
        None if name not in entry else _parse_budget(entry[name], f"{where}.{name}", num_heads) for name in _FIELDS
    )


def _layer_index(key: Any, source: str) -> int:
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    if isinstance(key, str) and key.isdigit():
        return int(key)
    raise ValueError(f'{source}: layer key {key!r} must be a layer index >= 0 (like 0 or "0")')


def _smallest(values: list[LineBudget]) -> int:
    return min(min(x) if isinstance(x, tuple) else x for x in values)


def _expand(value: LineBudget, num_heads: int, where: str) -> Tensor:
    if isinstance(value, tuple):
        if len(value) != num_heads:
            raise ValueError(
                f"{where} lists {len(value)} values but the model has {num_heads} query heads; "
                "give one per query head or a single int"
            )
        return torch.tensor(value, dtype=torch.int64)
    return torch.full((num_heads,), value, dtype=torch.int64)

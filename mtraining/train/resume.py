"""What a checkpoint belongs to, and what resuming from it may change.

``describe_run`` is recorded in every checkpoint's manifest: the model (its Hugging Face config and
every parameter's shape), the tokenizer (SHA-256 of its files), the world shape, the schedule
(``train.steps`` and the optim section: the learning rate of a step is a function of them; the
micro-batches per step) and the data settings. ``check_resume`` compares it with the run about to continue from it:

- another model (parameter names or shapes differ): refused;
- the same shapes with another HF config or tokenizer: refused unless ``checkpoint.allow_changed_model``;
- another schedule or optimizer setting (train.steps, the optim section, the micro-batches per step:
  train.grad_accum or data.global_batch_tokens): refused unless ``checkpoint.allow_changed_schedule``
  (the message gives the learning rate of the next step both ways);
- ``train.steps`` below the checkpoint's step: refused;
- another world shape or data settings: said, not refused (the data order then differs); settings
  that change neither the gradients nor the data (train.defer_grad_sync, parallel.ring, data.cache_dir)
  are not recorded.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..data.cache import file_digest
from .checkpoint import checkpoints, load_checkpoint, newest_verified
from .config import Config
from .data import tokenizer_path
from .optim import lr_at, set_hyperparameters

# HF config fields that say nothing about the weights or the computation
_VOLATILE = frozenset(
    {"architectures", "dtype", "torch_dtype", "transformers_version", "use_cache", "return_dict"}
    | {"output_attentions", "output_hidden_states", "id2label", "label2id", "problem_type"}
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt")
# beside the optim section, what makes an optimizer step: its learning rate is a function of
# train.steps, and its micro-batches (train.grad_accum, or data.global_batch_tokens) decide how many
# tokens it averages over; the defaults stand for a run recorded before those keys existed
_SCHEDULE_KEYS = ("train.steps", "train.grad_accum", "data.global_batch_tokens")
_SCHEDULE_DEFAULTS = {"train.grad_accum": 1, "data.global_batch_tokens": None}
_DATA_KEYS = ("train.seed",)
# data keys that change neither the tokens nor their order
_NOT_DATA = ("data.cache_dir",)


def model_identity(hf_config, state_dict: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The HF config (without fields that do not shape the computation) and every parameter's shape."""
    config = json.loads(hf_config.to_json_string(use_diff=False))
    return {
        "config": {k: v for k, v in config.items() if not k.startswith("_") and k not in _VOLATILE},
        "parameters": {name: list(t.shape) for name, t in state_dict.items()},
    }


def tokenizer_digest(path: str | Path | None) -> str | None:
    """SHA-256 over a tokenizer.json file, or over the tokenizer files of a directory; None without one."""
    if path is None:
        return None
    path = Path(path)
    files = [path] if path.is_file() else [path / n for n in _TOKENIZER_FILES if (path / n).is_file()]
    if not files:
        return None
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.name}:{file_digest(f)}".encode())
    return digest.hexdigest()


def _flat(cfg: Config, section: str, extra: tuple[str, ...]) -> dict[str, Any]:
    values = {f"{section}.{k}": v for k, v in getattr(cfg, section).model_dump(mode="json").items()}
    for key in extra:
        part, name = key.split(".")
        values[key] = getattr(getattr(cfg, part), name)
    return values


def describe_run(cfg: Config, model: dict[str, Any], data_parallel: int, context_parallel: int) -> dict[str, Any]:
    """What a checkpoint of this run belongs to (JSON values, as the manifest stores them)."""
    run = {
        "model": model,
        "tokenizer": tokenizer_digest(tokenizer_path(cfg)),
        "world": {"parallel.data": data_parallel, "parallel.context": context_parallel},
        "schedule": _flat(cfg, "optim", _SCHEDULE_KEYS),
        "data": {k: v for k, v in _flat(cfg, "data", _DATA_KEYS).items() if k not in _SCHEDULE_KEYS + _NOT_DATA},
    }
    return json.loads(json.dumps(run))


def _differences(old: dict, new: dict, limit: int = 6) -> str:
    keys = [k for k in dict.fromkeys([*old, *new]) if old.get(k) != new.get(k)]
    shown = ", ".join(f"{k} {json.dumps(old.get(k))} -> {json.dumps(new.get(k))}" for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _parameter_differences(old: dict[str, list], new: dict[str, list]) -> str:
    only_old = [n for n in old if n not in new]
    only_new = [n for n in new if n not in old]
    reshaped = [n for n in old if n in new and old[n] != new[n]]
    parts = []
    if only_old:
        parts.append(f"{len(only_old)} parameters only in the checkpoint (e.g. {only_old[0]})")
    if only_new:
        parts.append(f"{len(only_new)} only in this model (e.g. {only_new[0]})")
    if reshaped:
        n = reshaped[0]
        parts.append(f"{len(reshaped)} of other shapes (e.g. {n}: {old[n]} in the checkpoint, {new[n]} here)")
    return "; ".join(parts)


def check_model(saved: dict | None, current: dict, allow_changed: bool, where: str) -> list[str]:
    """Refuse a checkpoint of another model; a changed config is refused unless ``allow_changed``
    (then returned as a note). ``where`` names the checkpoint in messages."""
    if not saved:
        return [f"{where} records no model: its parameters are not checked before loading"]
    params = _parameter_differences(saved["parameters"], current["parameters"])
    config = _differences(saved["config"], current["config"])
    if params:
        raise ValueError(
            f"{where} belongs to another model ({config or 'same config'}; {params}); point checkpoint.dir at "
            "this model's checkpoints (a new folder for a new run), or set checkpoint.resume=false to start over "
            "(the step folders it saves then replace those of the same number)"
        )
    if not config:
        return []
    if not allow_changed:
        raise ValueError(
            f"{where} was trained with another model config ({config}); restore those settings, or set "
            "checkpoint.allow_changed_model=true to continue from its weights with the new ones"
        )
    return [f"continuing from {where} with a changed model config: {config}"]


def check_resume(saved: dict, current: dict, step: int, cfg: Config, where: str) -> list[str]:
    """Refuse a resume that would silently change the run (module docstring); returns notes to print."""
    ck = cfg.checkpoint
    notes = []
    if saved:
        notes += check_model(saved["model"], current["model"], ck.allow_changed_model, where)
        if saved["tokenizer"] and current["tokenizer"] and saved["tokenizer"] != current["tokenizer"]:
            if not ck.allow_changed_model:
                raise ValueError(
                    f"{where} was trained with another tokenizer (its files differ from "
                    f"{tokenizer_path(cfg)}); use that tokenizer, or set "
                    "checkpoint.allow_changed_model=true to continue with this one"
                )
            notes.append("continuing with a changed tokenizer")
    if cfg.train.steps < step:
        raise ValueError(
            f"{where} is at step {step}, past train.steps={cfg.train.steps}: raise train.steps to more than {step} "
            "to train on, or set checkpoint.resume=false to start over"
        )
    if not saved:
        return [f"{where} records no run (an older format): its model and schedule are not checked"]
    old, new = {**_SCHEDULE_DEFAULTS, **saved["schedule"]}, current["schedule"]
    if changed := _differences(old, new):
        lr_old, lr_new = (
            lr_at(step, s["optim.lr"], s["optim.warmup_steps"], s["train.steps"], s["optim.min_lr_ratio"])
            for s in (old, new)
        )
        if lr_old != lr_new:
            changed += f": the learning rate of step {step + 1} becomes {lr_new:.3g} instead of {lr_old:.3g}"
        if not ck.allow_changed_schedule:
            raise ValueError(
                f"resuming {where} with another schedule ({changed}); restore those settings, or set "
                "checkpoint.allow_changed_schedule=true to continue with the new ones"
            )
        notes.append(f"continuing with a changed schedule: {changed}")
    if changed := _differences(saved["world"], current["world"]):
        notes.append(f"world shape changed since {where}: {changed}")
    if changed := _differences(saved["data"], current["data"]):
        notes.append(f"data settings changed since {where}: {changed}; the data order differs from the first run's")
    return notes


def resume(
    cfg: Config, run: dict, model: nn.Module, optimizer: torch.optim.Optimizer, report: Callable[[str], None]
) -> tuple[int, Path | None]:
    """Collective: load the newest checkpoint of ``checkpoint.dir`` that verifies and fits this run;
    returns (step, its folder), or (0, None) to start from scratch. ``report`` gets what was skipped,
    changed or loaded."""
    ck = cfg.checkpoint
    if not ck.resume:
        if found := checkpoints(ck.dir):
            report(
                f"checkpoint.resume=false: starting from step 0 although {ck.dir} holds {len(found)} checkpoints "
                f"(newest {found[0].name}); this run's saves replace the step folders of the same number"
            )
        return 0, None
    found = newest_verified(ck.dir, report)
    if found is None:
        if checkpoints(ck.dir):
            report(f"no checkpoint in {ck.dir} verifies: starting from step 0")
        return 0, None
    path, manifest = found
    for note in check_resume(manifest["run"], run, manifest["step"], cfg, path.name):
        report(note)
    step = load_checkpoint(path, model, optimizer)
    o = cfg.optim
    set_hyperparameters(optimizer, o.weight_decay, o.betas, o.eps)  # the config's, not the checkpoint's
    report(f"resumed from {path} at step {step}")
    return step, path

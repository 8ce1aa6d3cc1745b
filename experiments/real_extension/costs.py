"""How long each stage is expected to take, printed before it runs and used to refuse starting one that would end
past --max-minutes.

Before a stage of a kind has run, the estimate counts the model's FLOPs at the stage's lengths (``Shape``: from the
converted config, or SmolLM2-135M's before the conversion) at ``Costs.flops_per_s``, plus fixed costs per process,
prompt and generated token: an estimate, not a measurement. Once a stage of the same kind has run on this machine
its measured time replaces the FLOP estimate (``Timings``, kept in ``<work>/timings.json``): a training's seconds
per step and its fixed cost, a read's seconds per length.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from bench.common import written

from .settings import Arm, Settings

SPARSE_SHARE = 0.25  # sparse attention's share of dense attention's time assumed before one is measured
DECODED_TOKENS = {"niah": 10, "ruler": 30}  # tokens generated per prompt, assumed (answers stop early)


@dataclass(frozen=True)
class Shape:
    """What a model's FLOPs depend on: layers, query heads, head size, hidden size, vocabulary, and the
    parameters of the decoder layers (the matrices every token goes through)."""

    layers: int = 30
    heads: int = 9
    head_dim: int = 64
    hidden: int = 576
    vocab: int = 49152
    layer_params: int = 106_168_320

    @classmethod
    def of(cls, model_dir: Path) -> Shape:
        """The shape of a converted model (its config.json); SmolLM2-135M's until there is one."""
        path = model_dir / "config.json"
        if not path.exists():
            return cls()
        c = json.loads(path.read_text())
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        kv = c.get("num_key_value_heads", c["num_attention_heads"])
        per_layer = (
            c["hidden_size"] * head_dim * (2 * c["num_attention_heads"] + 2 * kv)  # q, o and k, v
            + 3 * c["hidden_size"] * c["intermediate_size"]  # gate, up, down
        )
        return cls(
            c["num_hidden_layers"], c["num_attention_heads"], head_dim, c["hidden_size"], c["vocab_size"],
            per_layer * c["num_hidden_layers"],
        )  # fmt: skip

    def forward_flops(self, n: int, attention_share: float = 1.0) -> float:
        """FLOPs of one forward over ``n`` tokens: the matrices, the LM head, and causal attention times
        ``attention_share`` (the kept fraction of its work)."""
        attention = 2.0 * n * n * self.head_dim * self.heads * self.layers
        return 2.0 * n * (self.layer_params + self.hidden * self.vocab) + attention_share * attention


class Timings:
    """Measured seconds per stage kind on this machine, in ``<work>/timings.json`` (written whole)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.found: dict[str, float] = json.loads(path.read_text()) if path.exists() else {}

    def get(self, kind: str) -> float | None:
        return self.found.get(kind)

    def record(self, kind: str, seconds: float) -> None:
        self.found[kind] = round(seconds, 2)
        with written(self.path) as tmp:
            tmp.write_text(json.dumps(self.found, indent=1) + "\n")


@dataclass(frozen=True)
class Estimate:
    seconds: float
    measured: bool

    def __str__(self) -> str:
        return f"~{self.seconds:.0f}s ({'measured here' if self.measured else 'estimated'})"


class Estimator:
    """Expected seconds of each stage of ``settings`` for a model of ``shape``, measured ones first."""

    def __init__(self, settings: Settings, shape: Shape, timings: Timings) -> None:
        self.s, self.shape, self.timings = settings, shape, timings

    def _flops_s(self, flops: float) -> float:
        return flops / self.s.costs.flops_per_s

    def convert(self) -> Estimate:
        return self._measured("convert") or Estimate(self.s.costs.startup_s + 30.0, False)

    def corpus(self) -> Estimate:
        return self._measured("corpus") or Estimate(self.s.costs.startup_s + 60.0, False)

    def train_step(self, arm: Arm) -> Estimate:
        """One optimizer step at ``length``: forward, recomputed forward and backward (about 4 forwards)."""
        found = self.timings.get(f"train:{arm.name}:step")
        if found is not None:
            return Estimate(found, True)
        share = SPARSE_SHARE if arm.sparse else 1.0
        return Estimate(self._flops_s(4 * self.shape.forward_flops(self.s.length, share)) / self.s.gpus, False)

    def train_fixed(self, arm: Arm) -> Estimate:
        found = self.timings.get(f"train:{arm.name}:fixed")
        return Estimate(found, True) if found is not None else Estimate(self.s.costs.startup_s, False)

    def train(self, arm: Arm, steps_left: int) -> Estimate:
        step, fixed = self.train_step(arm), self.train_fixed(arm)
        return Estimate(fixed.seconds + steps_left * step.seconds, step.measured and fixed.measured)

    def cell(self, arm: Arm, n: int, niah_only: int | None = None) -> Estimate:
        """One length of a read: its prompts' prefills and answers and its perplexity windows."""
        kind = f"read:{'sparse' if arm.sparse else 'dense'}:{n}"
        if niah_only is None and self.timings.get(kind) is not None:
            return Estimate(self.timings.get(kind), True)
        c = self.s.costs
        prefill = self._flops_s(self.shape.forward_flops(n, SPARSE_SHARE if arm.sparse else 1.0))
        niah = niah_only if niah_only is not None else self.s.niah_prompts
        ruler = 0 if niah_only is not None else self.s.ruler_samples * len(self.s.ruler_tasks)
        windows = 0 if niah_only is not None else self.s.ppl_windows
        answers = niah * DECODED_TOKENS["niah"] + ruler * DECODED_TOKENS["ruler"]
        return Estimate((niah + ruler + windows) * (prefill + c.prompt_s) + answers * c.token_s, False)

    def read(self, arm: Arm, lengths: tuple[int, ...]) -> Estimate:
        cells = [self.cell(arm, n) for n in lengths]
        return Estimate(sum(c.seconds for c in cells), all(c.measured for c in cells))

    def base(self, native: int) -> Estimate:
        found = self._measured("base")
        return found or Estimate(self.cell(Arm("dense", False), native, self.s.base_prompts).seconds + 10, False)

    def speed(self, n: int) -> Estimate:
        """The speed stage at ``n`` tokens: the dump (a forward to the last layer asked for) and the timed calls, per
        layer the dense step and each sparse arm's step and estimate, each 1 + repeats times."""
        found = self._measured(f"speed:{n}")
        if found:
            return found
        s, shape = self.s, self.shape
        dump = self._flops_s(shape.forward_flops(n) * (max(s.speed_layers) + 1) / shape.layers)
        attention = 2.0 * n * n * shape.head_dim * shape.heads  # one layer's forward
        per_call = 3.5 * attention * (1 + SPARSE_SHARE * 2 * len(s.sparse_arms))  # forward + backward
        calls = len(s.speed_layers) * (1 + s.speed_repeats) * self._flops_s(per_call)
        return Estimate(dump + calls + s.costs.startup_s / len(s.speed_lengths), False)

    def _measured(self, kind: str) -> Estimate | None:
        found = self.timings.get(kind)
        return None if found is None else Estimate(found, True)

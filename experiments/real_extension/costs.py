"""How long each stage is expected to take, printed before it runs and used to refuse starting one that would end
past --max-minutes.

Four sources, the first found wins (``Estimate.source``):
- ``here``: a stage of the same kind measured on this machine (``Timings``, kept in ``<work>/timings.json``): a
  training's seconds per step and its fixed cost, a read's seconds per generated NIAH prompt, NIAH prompt read
  teacher-forced alone (``niah_forced``), RULER-style prompt and perplexity window at each length (the per-task
  terms);
- ``scaled``: a read's per-task term measured here at a shorter length, scaled by the model's FLOPs, or for a
  sparse read by how the dense read grew between the two lengths where both were measured here (a run's longest
  length is read last, after its shorter ones were measured on the machine; a model's dense read before its sparse
  one);
- ``calibrated``: the figures an earlier GPU run measured (``Settings.costs.calibration``: the run at this
  ``length`` where there is one, ``settings.calibration_for``; its source named there):
  a read's seconds per item at each length (the whole read's time over its items; a prompt read teacher-forced
  alone: one answer prefill), lengths beyond the table scaled by the model's FLOPs;
- ``flops``: the model's FLOPs at the stage's lengths (``Shape``: from the converted config, or SmolLM2-135M's
  before the conversion) at ``Costs.flops_per_s``, plus fixed costs per process, prompt and generated token.

A sparse read is never expected to be faster than the dense read at that length as far as it was measured (here
or calibrated): the first runs' 64K sparse read ran past its FLOP estimate by 10x. Each source has its margin
(``Estimate.margin``): a stage starts only if margin x estimate + ``SLACK_S`` fits before the deadline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from bench.common import written

from .settings import Arm, Settings, calibration_for

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


MARGINS = {"here": 1.15, "scaled": 1.3, "calibrated": 1.3, "flops": 2.0}
SLACK_S = 10.0  # seconds kept free before the deadline besides the margin: the log, the archive, the exit
TASKS = ("niah", "niah_forced", "ruler", "ppl")  # a read's parts, each timed per item


@dataclass(frozen=True)
class Estimate:
    """Expected seconds of a stage and where the figure comes from (``here``, ``calibrated`` or ``flops``)."""

    seconds: float
    source: str

    @property
    def margin(self) -> float:
        return MARGINS[self.source]

    def budget(self) -> float:
        """Seconds that must be left before the deadline for the stage to start."""
        return self.margin * self.seconds + SLACK_S

    def __str__(self) -> str:
        return f"~{self.seconds:.0f}s ({self.source})"


def least_trusted(parts: list[Estimate]) -> str:
    """The source of a sum of estimates: the least trusted of its parts'."""
    return max((p.source for p in parts), key=list(MARGINS).index, default="here")


class Estimator:
    """Expected seconds of each stage of ``settings`` for a model of ``shape``: measured here, else calibrated,
    else counted in FLOPs."""

    def __init__(self, settings: Settings, shape: Shape, timings: Timings) -> None:
        self.s, self.shape, self.timings = settings, shape, timings
        self.calibration = settings.costs.calibration

    def _flops_s(self, flops: float) -> float:
        return flops / self.s.costs.flops_per_s

    def convert(self) -> Estimate:
        if self.calibration is not None:
            return self._measured("convert") or Estimate(self.calibration.convert_s, "calibrated")
        return self._measured("convert") or Estimate(self.s.costs.startup_s + 30.0, "flops")

    def corpus(self) -> Estimate:
        return self._measured("corpus") or Estimate(self.s.costs.startup_s + 60.0, "flops")

    def train_step(self, arm: Arm, length: int) -> Estimate:
        """One optimizer step at ``length`` tokens: forward, recomputed forward and backward (about 4 forwards). An
        arm the calibration at that length lacks is expected at its dense arm's calibrated step."""
        found = self.timings.get(f"train:{arm.name}:{length}:step")
        if found is not None:
            return Estimate(found, "here")
        cal = self.calibration
        cal = cal if cal is None or cal.length == length else calibration_for(length, cal)  # an earlier phase's
        if cal is not None and cal.length == length and self.s.gpus == 1:
            return Estimate(cal.train_step_s.get(arm.name, cal.train_step_s["dense"]), "calibrated")
        share = SPARSE_SHARE if arm.sparse else 1.0
        return Estimate(self._flops_s(4 * self.shape.forward_flops(length, share)) / self.s.gpus, "flops")

    def train_fixed(self, arm: Arm) -> Estimate:
        found = self.timings.get(f"train:{arm.name}:fixed")
        if found is not None:
            return Estimate(found, "here")
        if self.calibration is not None:
            return Estimate(self.calibration.train_fixed_s, "calibrated")
        return Estimate(self.s.costs.startup_s, "flops")

    def train(self, arm: Arm, length: int, steps_left: int) -> Estimate:
        """A training phase at ``length`` tokens with ``steps_left`` steps to run."""
        step, fixed = self.train_step(arm, length), self.train_fixed(arm)
        return Estimate(fixed.seconds + steps_left * step.seconds, least_trusted([step, fixed]))

    def train_start(self, arm: Arm, length: int, steps: int) -> Estimate:
        """The least a training phase of ``steps`` must run to keep any work: its fixed cost and steps up to its
        first checkpoint."""
        step, fixed = self.train_step(arm, length), self.train_fixed(arm)
        first = min(self.s.checkpoint_every, steps)
        return Estimate(fixed.seconds + first * step.seconds, least_trusted([step, fixed]))

    def items(self, niah_only: int | None = None) -> dict[str, int]:
        """A read's items at one length per task: generated NIAH prompts, NIAH prompts teacher-forced alone,
        RULER-style prompts, perplexity windows."""
        if niah_only is not None:
            return {"niah": niah_only, "niah_forced": 0, "ruler": 0, "ppl": 0}
        s = self.s
        return {
            "niah": s.niah_prompts,
            "niah_forced": s.forced_prompts - s.niah_prompts,
            "ruler": s.ruler_samples * len(s.ruler_tasks),
            "ppl": s.ppl_windows,
        }

    def cell(self, arm: Arm, n: int, niah_only: int | None = None) -> Estimate:
        """One length of a read: per task, its items times the seconds of one item."""
        parts = [self.per_item(arm, n, task) for task in TASKS]
        counts = self.items(niah_only)
        used = [p for p, task in zip(parts, TASKS) if counts[task]]
        return Estimate(sum(counts[t] * p.seconds for p, t in zip(parts, TASKS)), least_trusted(used))

    def per_item(self, arm: Arm, n: int, task: str) -> Estimate:
        """Seconds of one item of ``task`` at ``n`` tokens read with ``arm``; a sparse read's at least the dense
        read's where that was measured (here or calibrated). A calibration measured at ``n`` itself comes before an
        estimate scaled from a shorter length here (an upper bound, which overprices a long read by half)."""
        kind = "sparse" if arm.sparse else "dense"
        here = self.timings.get(f"read:{kind}:{n}:{task}")
        floor = self.timings.get(f"read:dense:{n}:{task}") if arm.sparse else None
        if here is not None:
            return Estimate(max(here, floor or 0.0), "here")
        calibrated = self._calibrated_item(kind, n, task)
        if arm.sparse:  # never below the calibrated dense read, nor taken from FLOPs where only that was measured
            dense = self._calibrated_item("dense", n, task)
            calibrated = dense if calibrated is None else max(calibrated, dense or 0.0)
        scaled = self._scaled_item(kind, n, task)
        if scaled is not None and not self._calibrated_at(kind, n, task):
            return Estimate(max(scaled, floor or 0.0), "scaled")
        if calibrated is not None:
            return Estimate(max(calibrated, floor or 0.0), "calibrated")
        c = self.s.costs
        prefill = self._flops_s(self.shape.forward_flops(n, SPARSE_SHARE if arm.sparse else 1.0))
        tokens = DECODED_TOKENS.get(task, 0)
        return Estimate(max(prefill + c.prompt_s + tokens * c.token_s, floor or 0.0), "flops")

    def _scaled_item(self, kind: str, n: int, task: str) -> float | None:
        """Seconds per item of ``task`` in a ``kind`` read at ``n`` from the longest shorter length measured on this
        machine, scaled by how the dense read grew from there to ``n`` where both were measured here (a sparse
        read), else by the FLOPs of a forward at ``n`` over one there (an upper bound: an item's fixed costs do not
        grow, and a sparse read's attention grows slower); None if none was measured."""
        measured = self._measured_items(kind, task)
        shorter = [m for m in measured if m < n]
        if not shorter:
            return None
        m = max(shorter)
        dense = self._measured_items("dense", task) if kind == "sparse" else {}
        if m in dense and n in dense:
            return measured[m] * dense[n] / dense[m]
        return measured[m] * self.shape.forward_flops(n) / self.shape.forward_flops(m)

    def _measured_items(self, kind: str, task: str) -> dict[int, float]:
        """Seconds per item of ``task`` in ``kind`` reads measured on this machine, by length."""
        found = {}
        for key, seconds in self.timings.found.items():
            stage, *rest = key.split(":")  # read:<kind>:<length>:<task>
            if stage == "read" and rest[0] == kind and rest[2] == task:
                found[int(rest[1])] = seconds
        return found

    def _calibrated_at(self, kind: str, n: int, task: str) -> bool:
        """Whether the calibration measured ``task`` in a ``kind`` read at ``n`` tokens itself."""
        cal = self.calibration
        if cal is None:
            return False
        tables = cal.prefill_s if task == "niah_forced" else cal.read_s
        return n in tables.get(kind, {})

    def _calibrated_item(self, kind: str, n: int, task: str) -> float | None:
        """Seconds per item of ``task`` in a ``kind`` read at ``n`` by the calibration (a NIAH prompt read
        teacher-forced alone: one prefill; any other: the whole read over its items): the table's length at or
        below ``n`` (scaled by the FLOPs of a forward at ``n`` over one there), else its shortest; None without a
        table."""
        cal = self.calibration
        if cal is None:
            return None
        if task == "niah_forced":
            table, items = cal.prefill_s.get(kind, {}), 1
        else:
            table = cal.read_s.get(kind, {}) | {
                m: max(v, cal.read_s.get(kind, {}).get(m, 0.0)) for m, v in cal.read_at_least.get(kind, {}).items()
            }
            items = sum(cal.read_items)
        if not table:
            return None
        below = [m for m in table if m <= n]
        m = max(below) if below else min(table)
        scale = self.shape.forward_flops(n) / self.shape.forward_flops(m) if m < n else 1.0
        return scale * table[m] / items

    def read(self, arm: Arm, lengths: tuple[int, ...]) -> Estimate:
        cells = [self.cell(arm, n) for n in lengths]
        return Estimate(sum(c.seconds for c in cells), least_trusted(cells))

    def base(self, native: int) -> Estimate:
        found = self._measured("base")
        if found is not None:
            return found
        cal = self.calibration
        if cal is not None:
            return Estimate(cal.base_s * self.s.base_prompts / cal.base_prompts, "calibrated")
        return Estimate(self.cell(Arm("dense", False), native, self.s.base_prompts).seconds + 10, "flops")

    def speed(self, n: int) -> Estimate:
        """The speed stage at ``n`` tokens of one document: the dump (a forward to the last layer asked for) and the
        timed calls, per layer the dense step and each sparse arm's step and estimate, each 1 + repeats times."""
        found = self._measured(f"speed:{n}")
        if found:
            return found
        s, shape = self.s, self.shape

        def steps(arms: int) -> float:  # dense and each sparse arm, in dense steps
            return 1 + SPARSE_SHARE * 2 * arms

        arms = len(s.timed_arms) * len(s.timed_backends)  # each arm timed on each backend
        layers = s.timed_layers(shape.layers)
        cal = self.calibration
        if cal is not None and n in cal.speed_s:  # measured with one sparse arm over cal.speed_layers layers
            return Estimate(cal.speed_s[n] * steps(arms) / steps(1) * len(layers) / cal.speed_layers, "calibrated")
        dump = self._flops_s(shape.forward_flops(n) * (max(layers) + 1) / shape.layers)
        attention = 2.0 * n * n * shape.head_dim * shape.heads  # one layer's forward
        per_call = 3.5 * attention * steps(arms)  # forward + backward
        calls = len(layers) * (1 + s.speed_repeats) * self._flops_s(per_call)
        return Estimate(dump + calls + s.costs.startup_s / len(s.speed_lengths), "flops")

    def _measured(self, kind: str) -> Estimate | None:
        found = self.timings.get(kind)
        return None if found is None else Estimate(found, "here")

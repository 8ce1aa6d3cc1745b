"""What the real-model extension experiment runs: the arms, the RoPE scaling, the schedule, the evaluation's sizes,
the speed stage's lengths, and the time each stage is expected to take.

``Arm`` is one attention configuration (``dense``, the paper's ``adaptive`` setting, fixed lines-only budgets such
as ``v1024s2048``, lines + per-block columns such as ``v1024s2048c64``); ``arm(name)`` reads one from its name.
``Settings`` holds one experiment's choices; ``PRESETS`` the defaults for the GPU (SmolLM2-135M 8K -> 64K on one
H200) and for the CPU toy the tests run. ``Costs`` estimates each stage from FLOP counts and replaces an estimate by
a measurement once a stage of the same kind has run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from mtraining.eval.tasks import TASKS


def rope_scaling(length: int, native: int, theta: float | None = None) -> dict:
    """The model's RoPE for training and reading at ``length`` tokens, pretrained at ``native``: YaRN with factor
    length / native over the native length (the paper scales Qwen2.5-3B so: factor 16 over 32,768), or with
    ``theta`` no scaling and the RoPE base raised to it (an adjusted base frequency, as ProLong and Code Llama
    extend). The one place this choice is made; the trainer merges it into the base's ``rope_parameters`` (with
    YaRN its rope_theta is kept)."""
    if length <= native:
        raise ValueError(
            f"the extension length {length} must exceed the base's native length {native} (its config's "
            "max_position_embeddings): pass a larger --length"
        )
    if theta is not None:
        return {"rope_type": "default", "rope_theta": theta}
    return {"rope_type": "yarn", "factor": length / native, "original_max_position_embeddings": native}


BACKENDS = ("auto", "torch", "triton", "fa4")
"""The backends ``sparse_attention`` takes (``--speed-backends``)."""


@dataclass(frozen=True)
class Arm:
    """One attention configuration, trained and read.

    ``threshold``: keep per head the fewest lines holding that fraction of the estimated attention mass, with
    ``v_size``/``s_size`` as caps; without it they are fixed budgets. ``columns``: key columns chosen per query
    block on top of the lines (``attention.block_columns``). At a length under twice a budget the budget is
    lowered to half the length: a prompt fills its length only up to its answer, and a pattern that keeps more
    than half the lines is about dense anyway."""

    name: str
    sparse: bool
    threshold: float | None = None
    v_size: int = 0
    s_size: int = 0
    columns: int = 0

    def pattern(self, length: int, settings: Settings) -> dict:
        """The ``attention`` fields (PatternConfig's) of this arm at ``length`` tokens; {} for dense."""
        if not self.sparse:
            return {}
        fields = dict(
            v_size=min(self.v_size, length // 2),
            s_size=min(self.s_size, length // 2),
            last_q=min(settings.last_q, length),
            local_window=settings.local_window,
            sink_tokens=settings.sink_tokens,
        )
        if self.threshold is not None:
            fields["threshold"] = self.threshold
        if self.columns:
            fields["block_columns"] = self.columns
        return fields


ADAPTIVE = Arm("adaptive", True, threshold=0.9, v_size=4096, s_size=4096)  # the paper's: 90% mass, caps 4096
_BUDGET = re.compile(r"(?:t(\d+))?v(\d+)s(\d+)(?:c(\d+))?")


def arm(name: str) -> Arm:
    """The arm named ``name``: ``dense``, ``adaptive``, or ``[tP]vVsS[cC]`` (threshold P percent as caps, else fixed
    V verticals and S slashes per head, plus C columns per query block), e.g. ``v1024s2048``, ``t90v4096s4096``,
    ``v1024s2048c64``. ValueError naming the forms otherwise."""
    if name == "dense":
        return Arm("dense", False)
    if name == "adaptive":
        return ADAPTIVE
    found = _BUDGET.fullmatch(name)
    if found is None:
        raise ValueError(
            f"unknown arm {name!r}: use dense, adaptive, or a budget like v1024s2048 (fixed lines), t90v4096s4096 "
            "(90% of the mass, capped) or v1024s2048c64 (plus 64 columns per query block)"
        )
    t, v, s, c = found.groups()
    threshold = int(t) / 100 if t else None
    if threshold is not None and not 0 < threshold <= 1:
        raise ValueError(f"arm {name!r}: the threshold is a percentage in 1..100, got {t}")
    return Arm(name, True, threshold=threshold, v_size=int(v), s_size=int(s), columns=int(c or 0))


@dataclass(frozen=True)
class Settings:
    """One experiment's choices (``PRESETS`` holds the defaults; the command line replaces fields).

    Training: ``steps`` at ``length`` tokens per step (batch 1 per rank group), after the ``earlier`` phases
    ((length, steps) each, shorter first, every phase from the one before's model with the RoPE scaled to its
    length: a staged extension as ProLong's; with ``rope_final`` every phase's RoPE is scaled for ``length``, so
    the last phase trains on the rotations the earlier ones adapted to; with ``rope_theta`` every phase's RoPE base
    is that, unscaled), ``lr`` after ``warmup`` steps
    (constant then, as the paper's), AdamW betas (0.9, 0.95) without weight decay, ``code_weight`` of the samples
    from code and the rest from prose, document masking, a checkpoint every ``checkpoint_every`` steps, ``gpus``
    ranks of one striped ring. Evaluation at ``length`` / 8, / 4, / 2 and ``length``: ``niah_prompts`` per length
    (spread over ``depths``) generated and teacher-forced, and up to ``niah_forced_prompts`` (None: none more)
    teacher-forced alone (a prefill each, no decoding), ``ruler_samples`` per RULER-style task and length,
    ``ppl_windows`` held-out documents per length; sparse arms' models are also read with their own attention
    (``sparse_reads``), earlier phases' models dense up to their own length (``read_earlier``); the base is checked
    on ``base_prompts`` NIAH prompts at its native length and must reach ``base_gate`` percent (the upper end of its
    95% interval; 0: no check). Speed: Q/K/V of the ``timed_layers`` dumped at ``speed_lengths`` from each of
    ``speed_docs`` held-out documents (one at a time: documents differ in density as layers do), timed
    ``speed_repeats`` times per call, for every sparse arm and the ``speed_arms`` timed only (not trained: the speed
    of candidates on the same Q/K)."""

    length: int = 65536
    eval_fractions: tuple[int, ...] = (8, 4, 2, 1)  # the evaluation's lengths: length / each
    seeds: tuple[int, ...] = (0, 1, 2)
    arms: tuple[Arm, ...] = (Arm("dense", False), ADAPTIVE)
    default_arm: str = "adaptive"
    steps: int = 30
    earlier: tuple[tuple[int, int], ...] = ()
    rope_final: bool = False
    rope_theta: float | None = None
    read_earlier: bool = False
    lr: float = 1e-4
    warmup: int = 3
    code_weight: float = 0.7
    checkpoint_every: int = 10
    gpus: int = 1
    device: str = "cuda"
    dtype: str = "bfloat16"
    backend: str = "auto"
    block_size: int = 128
    last_q: int = 64
    local_window: int = 128
    sink_tokens: int = 4
    eval_seed: int = 0
    niah_prompts: int = 20
    niah_forced_prompts: int | None = None  # NIAH prompts per length read teacher-forced (None: niah_prompts)
    sparse_reads: bool = True
    depths: tuple[int, ...] = (0, 25, 50, 75, 100)
    ruler_samples: int = 2
    ruler_tasks: tuple[str, ...] = TASKS
    ppl_windows: int = 8
    first_bucket: int = 1024
    base_prompts: int = 20
    base_gate: float = 50.0
    heldout_fraction: float = 0.15
    speed_lengths: tuple[int, ...] = (65536, 131072, 524288)
    speed_layers: tuple[int, ...] | None = None  # None: every third layer from the first (``timed_layers``)
    speed_repeats: int = 5
    speed_docs: int = 3
    speed_arms: tuple[Arm, ...] = ()
    speed_backends: tuple[str, ...] = ()  # the backends the speed stage times each arm on (``timed_backends``)
    workers: int | None = None  # corpus and prompt-building processes (default: the spare cores)
    costs: Costs = field(default_factory=lambda: Costs())

    @property
    def lengths(self) -> tuple[int, ...]:
        """The evaluation's lengths: L/8, L/4, L/2, L (the toy: L/2, L)."""
        return tuple(self.length // d for d in self.eval_fractions)

    def timed_layers(self, layers: int) -> tuple[int, ...]:
        """The layers the speed stage times in a model of ``layers`` layers: ``speed_layers``, else every third from
        the first. Layers differ in density: on the 128K model the layers 3, 15 and 27 kept 0.165 of the pairs
        under v1024s2048, the whole model 0.24, so a few layers' speedup is not the model's."""
        return self.speed_layers or tuple(range(0, layers, 3))

    def rope_length(self, phase_length: int) -> int:
        """The length the RoPE is scaled for in a phase at ``phase_length`` tokens: its own, or with ``rope_final``
        the last phase's."""
        return self.length if self.rope_final else phase_length

    @property
    def schedule(self) -> tuple[tuple[int, int], ...]:
        """Every training phase as (length, steps): the ``earlier`` ones, then ``steps`` at ``length``."""
        return (*self.earlier, (self.length, self.steps))

    @property
    def timed_arms(self) -> tuple[Arm, ...]:
        """The arms the speed stage times: the sparse arms trained, then ``speed_arms``."""
        return self.sparse_arms + self.speed_arms

    @property
    def timed_backends(self) -> tuple[str, ...]:
        """The backends the speed stage times each sparse arm on, on the same Q/K: ``speed_backends``, else the run's
        ``backend`` alone. The first one's figures are the records' ``attention_speedup``."""
        return self.speed_backends or (self.backend,)

    @property
    def forced_prompts(self) -> int:
        """NIAH prompts per length read teacher-forced: ``niah_forced_prompts``, else ``niah_prompts``."""
        return self.niah_prompts if self.niah_forced_prompts is None else self.niah_forced_prompts

    @property
    def sparse_arms(self) -> tuple[Arm, ...]:
        return tuple(a for a in self.arms if a.sparse)

    def check(self, paired: bool = True) -> None:
        """ValueError naming the option for settings that cannot run (``paired``: the arms include dense; a part of
        a split by arm need not, its run's dense arm is in another part)."""
        names = [a.name for a in self.arms]
        if (paired and "dense" not in names) or len(set(names)) != len(names):
            raise ValueError(f"--arms needs dense (every change is paired against it) and no repeats, got {names}")
        if self.default_arm not in names:
            raise ValueError(f"--default {self.default_arm!r} is not among --arms {names}")
        unit = max(self.eval_fractions) * self.block_size * self.gpus
        if self.length % unit:
            raise ValueError(
                f"--length {self.length} must be a multiple of {unit} (the shortest evaluation length's divisor x "
                "block size x GPUs) so that every evaluation length splits into whole blocks on every rank"
            )
        lengths = [n for n, _ in self.schedule]
        whole = self.block_size * self.gpus  # a training's length splits into whole blocks on every rank
        if lengths != sorted(set(lengths)) or any(n % whole or steps < 1 for n, steps in self.earlier):
            raise ValueError(
                f"--schedule {' '.join(f'{n}:{k}' for n, k in self.schedule)}: each phase LENGTH:STEPS longer than "
                f"the one before, ending at --length, with at least one step and a length that is a multiple of "
                f"{whole} (block size x GPUs)"
            )
        if self.rope_theta is not None and (self.rope_theta <= 0 or self.rope_final):
            raise ValueError(
                f"--rope-theta {self.rope_theta:g} sets one positive RoPE base for every phase, in place of YaRN: "
                "leave out --rope-final (YaRN's scaling for the last phase)"
            )
        timed = [a.name for a in self.speed_arms]
        if any(not a.sparse for a in self.speed_arms) or len(set(timed)) != len(timed) or set(timed) & set(names):
            raise ValueError(f"--speed-arms takes sparse arms not among --arms {names}, no repeats, got {timed}")
        backends = list(self.speed_backends)
        if len(set(backends)) != len(backends) or set(backends) - set(BACKENDS):
            raise ValueError(f"--speed-backends takes some of {', '.join(BACKENDS)}, no repeats, got {backends}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise ValueError(f"--seeds takes distinct non-negative integers, got {list(self.seeds)}")
        for name in ("steps", "niah_prompts", "ruler_samples", "ppl_windows", "speed_repeats", "speed_docs", "gpus"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.forced_prompts < self.niah_prompts:
            raise ValueError(
                f"--niah-forced-prompts {self.forced_prompts} must be at least --niah-prompts {self.niah_prompts}: "
                "the first --niah-prompts of them are also generated"
            )
        if self.speed_repeats < 5 and self.device == "cuda":
            raise ValueError(
                f"--speed-repeats must be at least 5 on a GPU (a median of 5 or more), got {self.speed_repeats}"
            )
        unknown = sorted(set(self.ruler_tasks) - set(TASKS))
        if unknown:
            raise ValueError(f"--ruler-tasks: unknown {unknown}; use some of {', '.join(TASKS)}")


@dataclass(frozen=True)
class Calibration:
    """Stage times measured on a GPU by an earlier run of this experiment, the estimates' floor before a stage of
    the same kind has run on the machine at hand. ``read_s``: seconds of one read of one model at each length
    (``dense`` / ``sparse`` attention), slowest over the runs, for ``read_items`` (NIAH prompts, RULER-style
    prompts, perplexity windows) per length; ``read_at_least``: reads cut before they ended, seconds they ran.
    ``train_step_s`` / ``train_fixed_s``: per arm, at ``length`` tokens; ``base_s``: the base check of
    ``base_prompts`` NIAH prompts; ``prefill_s``: seconds of one answer prefill (the reads' ``phases``: the prompt
    and its reference scored), slowest over the runs, what a prompt read teacher-forced alone costs; ``speed_s``:
    seconds of the speed stage at each length with one sparse arm over ``speed_layers`` layers of one document
    (default repeats).
    ``source``: where the figures are."""

    source: str
    device: str
    length: int
    read_items: tuple[int, int, int]
    read_s: dict[str, dict[int, float]]
    read_at_least: dict[str, dict[int, float]]
    train_step_s: dict[str, float]
    train_fixed_s: float
    convert_s: float
    base_s: float
    base_prompts: int
    prefill_s: dict[str, dict[int, float]] = field(default_factory=dict)
    speed_s: dict[int, float] = field(default_factory=dict)
    speed_layers: int = 3


# The 3-seed runs: bench/results/real_extension_runs/h200x2_95b3127 (stage_times.json of each GPU), seeds 0 and 2
# on one H200 and seed 1 on another, commit 95b3127 (decoding without cuDNN). Reads at 10 NIAH prompts, 7
# RULER-style tasks x 1 and 4 perplexity windows per length, slowest over the runs; the prefills per prompt from the
# same reads' phases (prefill_s / prefills; a process's first sparse read at 8K also compiles the kernels). A
# training's fixed seconds are the dense arm's (40 s); the first sparse training of a process also compiles the
# kernels (about 50 s more). The speed stage: GPU 1's, the adaptive arm alone.
H200_95b3127 = Calibration(
    source="bench/results/real_extension_runs/h200x2_95b3127 (H200, 95b3127)",
    device="NVIDIA H200",
    length=65536,
    read_items=(10, 7, 4),
    read_s={
        "dense": {8192: 30.0, 16384: 21.5, 32768: 24.8, 65536: 99.0},
        "sparse": {8192: 30.2, 16384: 24.6, 32768: 28.1, 65536: 113.2},
    },
    read_at_least={},
    train_step_s={"dense": 1.64, "adaptive": 1.05},
    train_fixed_s=40.0,
    convert_s=46.1,
    base_s=41.7,
    base_prompts=20,
    prefill_s={
        "dense": {8192: 0.170, 16384: 0.115, 32768: 0.208, 65536: 3.671},
        "sparse": {8192: 0.751, 16384: 0.267, 32768: 0.337, 65536: 5.207},
    },
    speed_s={65536: 2.4, 131072: 4.8, 524288: 93.6},
)

# The 128K run: bench/results/real_extension_runs/h200x2_4aa96df (each part's eval/*.json and train/*.json), two
# H200s, commit 4aa96df, after the evaluation's host-work fixes. Dense reads only (it read nothing sparse), slowest
# over the six reads per length; prefills per prompt from their phases, slowest; a training's fixed seconds the
# mean of wall - steps x step over the six (31-57 s). The base check (at the base's native 8K, whatever --length)
# and the speed stage at 512K are 95b3127's.
H200_4aa96df = replace(
    H200_95b3127,
    source="bench/results/real_extension_runs/h200x2_4aa96df (H200, 4aa96df); base check and 512K speed: h200x2_95b3127; "
    "v1024s2048's step: h200x4_daeba4b",
    length=131072,
    read_s={"dense": {16384: 37.3, 32768: 35.1, 65536: 44.1, 131072: 63.5}},
    train_step_s={"dense": 5.59, "v1024s6144": 3.40, "v1024s2048": 2.43},
    train_fixed_s=42.9,
    convert_s=34.2,
    prefill_s={"dense": {16384: 0.158, 32768: 0.235, 65536: 0.513, 131072: 1.565}},
    speed_s={65536: 2.7, 131072: 6.7, 524288: 93.6},
)
CALIBRATIONS = {c.length: c for c in (H200_95b3127, H200_4aa96df)}


def calibration_for(length: int, default: Calibration | None) -> Calibration | None:
    """The calibration measured at ``length`` where there is one, else ``default`` (its tables scaled by FLOPs)."""
    return CALIBRATIONS.get(length, default) if default is not None else None


@dataclass(frozen=True)
class Costs:
    """Expected seconds of each stage: FLOPs of the model at the stage's lengths over ``flops_per_s``, plus the fixed
    costs of a process (``startup_s``: imports, loading, kernel compilation) and of each generated token
    (``token_s``). Estimates, not measurements (a GPU's rate: about half of an H200's dense bf16 peak). Where
    ``calibration`` holds a stage's measured time it is used instead, and the driver replaces both by what
    finished stages of the same kind measured on the machine at hand (``Timings``)."""

    flops_per_s: float = 3e14
    startup_s: float = 40.0
    token_s: float = 0.012
    prompt_s: float = 0.05  # per prompt: tokenising it and the host work around its prefill
    calibration: Calibration | None = None


PRESETS: dict[str, Settings] = {
    "gpu": Settings(costs=Costs(calibration=H200_95b3127)),
    "toy": Settings(
        length=1024,
        eval_fractions=(2, 1),
        seeds=(0,),
        arms=(Arm("dense", False), arm("t90v32s64")),
        default_arm="t90v32s64",
        steps=2,
        lr=1e-3,
        warmup=1,
        checkpoint_every=1,
        device="cpu",
        dtype="float32",
        backend="torch",
        block_size=32,
        last_q=32,
        local_window=32,
        niah_prompts=1,
        depths=(50,),
        ruler_samples=1,
        ruler_tasks=("niah_multikey", "vt"),
        ppl_windows=1,
        first_bucket=128,
        base_prompts=1,
        base_gate=0.0,
        heldout_fraction=0.5,
        speed_lengths=(1024,),
        speed_repeats=2,
        speed_docs=2,
        workers=2,
        costs=Costs(flops_per_s=2e9, startup_s=15.0, token_s=0.01, prompt_s=0.05),
    ),
}

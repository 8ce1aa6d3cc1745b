"""``--parallel-gpus N``: the seeds of one machine spread over its GPUs, one independent process per GPU.

The parent runs the stages every part needs once (``Experiment.shared``: the conversion and the corpus), then
starts one child per part (``split``), each this same command with its own ``--seeds``, ``CUDA_VISIBLE_DEVICES``,
``--work <work>/gpu<g>`` (the model and the corpus linked from the parent's), ``--out <out>/gpu<g>``, ``--tar
<tar>_gpu<g>.tgz`` and the minutes left. Parts are balanced by their expected seconds: whole seeds go to the least
loaded GPU, then the base's read and the speed stage; the base check runs once, on GPU 0. The children's result
folders pool like any machines' (``--report-from <out>`` finds them).

Each child runs with ``OMP_NUM_THREADS=1`` unless it is set (torchrun's default when a host runs several processes):
the children's prompt builders keep the host's cores busy, and torch's CPU ops on tensors past its parallel grain
(32K elements, a 64K prompt's positions) then wait for threads that never get a core.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from ..common.stages import say
from ..common.training import ROOT
from .pipeline import DENSE, Experiment

# Options each child gets its own value of (the parent's are dropped from its command line).
OWN = (
    "--parallel-gpus", "--seeds", "--work", "--out", "--tar", "--max-minutes", "--workers", "--plan",
    "--base-read", "--no-base-read", "--speed", "--no-speed", "--base-check", "--no-base-check",
)  # fmt: skip
EXIT_ORDER = (1, 2, 4, 3, 0)  # the parent's exit status: the first of these that any child gave


@dataclass(frozen=True)
class Part:
    """What one GPU runs: its seeds (each seed trains every arm and reads every model), and whether it checks the
    base, reads the base at every length, and runs the speed stage."""

    gpu: int
    seeds: tuple[int, ...]
    base_check: bool = False
    base_read: bool = False
    speed: bool = False

    def what(self) -> str:
        extra = [name for name, on in (("base check", self.base_check), ("base read", self.base_read), ("speed", self.speed)) if on]  # fmt: skip
        return f"seeds {list(self.seeds)}" + "".join(f" + {e}" for e in extra)


def split(
    seeds: tuple[int, ...],
    gpus: int,
    seed_s: float,
    base_check_s: float,
    base_read_s: float | None,
    speed_s: float | None,
) -> list[Part]:
    """The parts of ``gpus`` GPUs: each seed (``seed_s`` seconds) on the least loaded GPU, the base check on the
    first GPU holding a seed, then the base read and the speed stage (None: not run) each on the least loaded GPU
    (the speed stage times that GPU's first seed's model). GPUs left without a seed are left out. ValueError for
    gpus < 1."""
    if gpus < 1:
        raise ValueError(f"--parallel-gpus must be at least 1, got {gpus}")
    load = [0.0] * gpus
    owned: dict[int, list[int]] = {g: [] for g in range(gpus)}
    for seed in seeds:
        g = min(range(gpus), key=lambda i: (load[i], i))
        owned[g].append(seed)
        load[g] += seed_s
    holding = [g for g in range(gpus) if owned[g]]
    load[holding[0]] += base_check_s
    extra: dict[str, int | None] = {}
    for name, seconds in (("base_read", base_read_s), ("speed", speed_s)):
        extra[name] = None if seconds is None else min(holding, key=lambda i: (load[i], i))
        if extra[name] is not None:
            load[extra[name]] += seconds
    return [Part(g, tuple(owned[g]), g == holding[0], extra["base_read"] == g, extra["speed"] == g) for g in holding]


def child_argv(argv: list[str], part: Part, work: Path, out: Path, tar: Path | None, minutes: float | None, workers: int | None) -> list[str]:  # fmt: skip
    """This command line for ``part``: the options of ``OWN`` replaced by the part's own."""
    own = ["--seeds", *map(str, part.seeds)]
    own += ["--work", str(part_dir(work, part)), "--out", str(part_dir(out, part))]
    own += [] if tar is None else ["--tar", str(part_tar(tar, part))]
    own += [] if minutes is None else ["--max-minutes", f"{minutes:.3f}"]
    own += [] if workers is None else ["--workers", str(workers)]
    own += ["--base-check" if part.base_check else "--no-base-check"]
    own += ["--base-read" if part.base_read else "--no-base-read", "--speed" if part.speed else "--no-speed"]
    return without(argv, OWN) + own


def without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` less ``options`` and their values (``--seeds 0 1``, ``--work=W``)."""
    kept: list[str] = []
    dropping = False
    for token in argv:
        if token.startswith("--"):
            dropping = token.split("=", 1)[0] in options
        if not dropping:
            kept.append(token)
    return kept


def part_dir(folder: Path, part: Part) -> Path:
    return folder / f"gpu{part.gpu}"


def part_tar(tar: Path, part: Part) -> Path:
    """``results.tgz`` -> ``results_gpu1.tgz``."""
    return tar.with_name(f"{tar.name.split('.')[0]}_gpu{part.gpu}{''.join(tar.suffixes)}")


def link_shared(work: Path, part: Part) -> None:
    """The part's work folder with the parent's converted model and corpus linked in (read only there)."""
    own = part_dir(work, part)
    own.mkdir(parents=True, exist_ok=True)
    for name in ("model", "corpus"):
        if not (own / name).is_symlink() and not (own / name).exists():  # linked by an earlier call
            (own / name).symlink_to(work / name, target_is_directory=True)


def launch(parts: list[Part], argv: list[str], work: Path, out: Path, tar: Path | None, minutes: float | None, workers: int | None) -> int:  # fmt: skip
    """Run every part as its own process on its own GPU and wait for all; the parent's exit status (``EXIT_ORDER``)."""
    procs = []
    for part in parts:
        link_shared(work, part)
        cmd = [sys.executable, "-m", "experiments.real_extension", *child_argv(argv, part, work, out, tar, minutes, workers)]  # fmt: skip
        say(f"GPU {part.gpu}: {part.what()}")
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(part.gpu))
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several processes per host (module docstring)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env))
    codes = [p.wait() for p in procs]
    for part, code in zip(parts, codes):
        say(f"GPU {part.gpu} exited {code}")
    return next((c for c in EXIT_ORDER if c in codes), max(codes))


def plan_parts(exp: Experiment, gpus: int) -> list[Part]:
    """``split`` of ``exp``'s seeds over ``gpus`` GPUs, balanced by the stages' expected seconds."""
    s = exp.s
    one = Experiment(replace(s, seeds=s.seeds[:1]), exp.sources, exp.work, exp.out, False, False, False)
    seed_s = sum(st.expected().seconds for st in one.stages()[len(one.shared()) :] if not st.background)
    base_read_s = exp.estimate.read(DENSE, s.lengths).seconds if exp.base_read else None
    speed_s = sum(exp.estimate.speed(n).seconds for n in s.speed_lengths) if exp.speed_stage else None
    return split(s.seeds, gpus, seed_s, exp.estimate.base(exp.native()).seconds, base_read_s, speed_s)


def part_experiment(exp: Experiment, part: Part) -> Experiment:
    """The experiment one part's child runs (its seeds, stages and folders)."""
    return Experiment(
        replace(exp.s, seeds=part.seeds),
        exp.sources,
        part_dir(exp.work, part),
        part_dir(exp.out, part),
        part.base_read,
        part.speed,
        part.base_check,
    )

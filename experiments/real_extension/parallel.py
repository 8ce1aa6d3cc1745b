"""``--parallel-gpus N``: the seeds of one machine spread over its GPUs, one independent process per part.

The parent runs the stages every part needs once (``Experiment.shared``: the conversion and the corpus), then
starts the parts (``split``): each this same command with its own ``--seeds`` (and ``--arms`` where it holds only
some of a seed's arms), ``CUDA_VISIBLE_DEVICES``, ``--work <work>/<part>`` (the model and the corpus linked from
the parent's), ``--out <out>/<part>``, ``--tar <tar>_<part>.tgz`` and the minutes left. A GPU's parts run one after
another, the GPUs side by side. Parts are balanced by their expected seconds: whole seeds go round the GPUs, and
the seeds left over (3 seeds on 2 GPUs) are split by arm, each arm's training and reads on the least loaded GPU;
then the base's read and the speed stage. The base check runs once, on GPU 0. The split is kept in
``<work>/parts.json`` from the first launch on, so a later call finds every training where an earlier one left it
(a later call that changes --base-read, --speed or --base-check places only the stages newly asked for).
The parts' result folders pool like any machines' (``--report-from <out>`` finds them).

``--variants NAME=OPTIONS ...``: recipes screened side by side instead (``variant_parts``): one part per variant,
every seed and arm, with the variant's options added to its command line, round the GPUs in the order given; its
work and result folders are named after it, and each is reported on its own (its settings differ).

Each child runs with ``OMP_NUM_THREADS=1`` unless it is set (torchrun's default when a host runs several processes):
the children's prompt builders keep the host's cores busy, and torch's CPU ops on tensors past its parallel grain
(32K elements, a 64K prompt's positions) then wait for threads that never get a core.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..common.stages import say
from ..common.training import ROOT
from .pipeline import DENSE, Experiment
from .settings import Settings

# Options each child gets its own value of (the parent's are dropped from its command line).
OWN = (
    "--parallel-gpus", "--seeds", "--work", "--out", "--tar", "--max-minutes", "--workers", "--plan",
    "--base-read", "--no-base-read", "--speed", "--no-speed", "--base-check", "--no-base-check", "--variants",
)  # fmt: skip
SUBSET = ("--arms", "--default", "--part")  # also replaced for a part that holds only some arms
EXIT_ORDER = (1, 2, 4, 3, 0)  # the parent's exit status: the first of these that any child gave
NOT_STARTED = 3  # a part after one that stopped: call again


@dataclass(frozen=True)
class Part:
    """What one process runs on one GPU: its seeds (each seed trains ``arms``, every arm if None, and reads their
    models), and whether it checks the base, reads the base at every length, and runs the speed stage. ``order``
    is its place among its GPU's parts."""

    gpu: int
    seeds: tuple[int, ...]
    base_check: bool = False
    base_read: bool = False
    speed: bool = False
    arms: tuple[str, ...] | None = None
    order: int = 0
    variant: str = ""
    options: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """Its work and result folders' name: ``gpu1``, then ``gpu1_1`` for the GPU's next part; a variant's name."""
        return self.variant or f"gpu{self.gpu}" + (f"_{self.order}" if self.order else "")

    def what(self) -> str:
        extra = [name for name, on in (("base check", self.base_check), ("base read", self.base_read), ("speed", self.speed)) if on]  # fmt: skip
        arms = "" if self.arms is None else f" ({', '.join(self.arms)})"
        variant = f"variant {self.variant} ({' '.join(self.options)}): " if self.variant else ""
        return f"{variant}seeds {list(self.seeds)}{arms}" + "".join(f" + {e}" for e in extra)


def split(
    seeds: tuple[int, ...],
    arm_s: dict[str, float],
    gpus: int,
    base_check_s: float | None,
    base_read_s: float | None,
    speed_s: float | None,
    speed_arms: tuple[str, ...] = (),
) -> list[Part]:
    """The parts of ``gpus`` GPUs (``assign``, then ``group``), with the base check (None: not run) on GPU 0's first
    part, then the base read and the speed stage each on the least loaded GPU's part that can run it: a GPU's first
    part for the base read, a part holding ``speed_arms`` (the arms the speed stage times) for the speed stage.
    ``arm_s``: each arm's seconds in one seed (its training and its model's reads), in --arms order. GPUs left
    without work are left out. ValueError for gpus < 1."""
    if gpus < 1:
        raise ValueError(f"--parallel-gpus must be at least 1, got {gpus}")
    owned, load = assign(seeds, arm_s, gpus, speed_arms if speed_s is not None else ())
    return place(group(owned, tuple(arm_s)), load, base_check_s, base_read_s, speed_s, speed_arms)


def place(
    parts: list[Part],
    load: list[float],
    base_check_s: float | None,
    base_read_s: float | None,
    speed_s: float | None,
    speed_arms: tuple[str, ...],
) -> list[Part]:
    """``parts`` with the base check on GPU 0's first part, and the base read and the speed stage each on the least
    loaded GPU's part that can run it (``split``); None: that stage is not placed (not run, or already on a part).
    ``load``: each GPU's seconds."""
    parts = list(parts)
    if not parts:
        return parts
    if base_check_s is not None:
        parts[0] = replace(parts[0], base_check=True)
        load[parts[0].gpu] += base_check_s
    can = {
        "base_read": lambda p: p.order == 0,
        "speed": lambda p: p.arms is None or set(speed_arms) <= set(p.arms),
    }
    for name, seconds in (("base_read", base_read_s), ("speed", speed_s)):
        able = [i for i, p in enumerate(parts) if can[name](p)]
        if seconds is None or not able:
            continue
        i = min(able, key=lambda i: (load[parts[i].gpu], parts[i].gpu, parts[i].order))
        parts[i] = replace(parts[i], **{name: True})
        load[parts[i].gpu] += seconds
    return parts


def assign(
    seeds: tuple[int, ...], arm_s: dict[str, float], gpus: int, together: tuple[str, ...]
) -> tuple[dict[int, dict[int, list[str]]], list[float]]:
    """Each GPU's seeds and their arms, and its expected seconds. Whole seeds go round the GPUs; each seed left over
    is split by arm, longest first, each on the least loaded GPU. ``together``: arms kept on one GPU in the first
    seed left over when no GPU holds a whole seed (the speed stage's, which times them on one model each)."""
    names = tuple(arm_s)
    load = [0.0] * gpus
    whole_n = len(seeds) - len(seeds) % gpus
    owned: dict[int, dict[int, list[str]]] = {g: {} for g in range(gpus)}
    for i, seed in enumerate(seeds[:whole_n]):
        owned[i % gpus][seed] = list(names)
        load[i % gpus] += sum(arm_s.values())
    for seed in seeds[whole_n:]:
        kept = together if whole_n == 0 and seed == seeds[0] else ()
        units = ([kept] if kept else []) + [(a,) for a in names if a not in kept]
        for unit in sorted(units, key=lambda u: -sum(arm_s[a] for a in u)):
            g = min(range(gpus), key=lambda i: (load[i], i))
            owned[g].setdefault(seed, []).extend(unit)
            load[g] += sum(arm_s[a] for a in unit)
    return owned, load


def group(owned: dict[int, dict[int, list[str]]], names: tuple[str, ...]) -> list[Part]:
    """One part per GPU and set of arms: the seeds holding every arm first (``arms`` None), then those holding some
    (their arms in --arms order), run in that order."""
    parts: list[Part] = []
    for g, seeds in owned.items():
        groups: dict[tuple[str, ...] | None, list[int]] = {}
        for seed, arms in seeds.items():
            key = None if set(arms) == set(names) else tuple(a for a in names if a in arms)
            groups.setdefault(key, []).append(seed)
        for order, (arms, held) in enumerate(sorted(groups.items(), key=lambda kv: kv[0] is not None)):
            parts.append(Part(g, tuple(held), arms=arms, order=order))
    return parts


def child_argv(argv: list[str], part: Part, work: Path, out: Path, tar: Path | None, minutes: float | None, workers: int | None, default_arm: str | None = None) -> list[str]:  # fmt: skip
    """This command line for ``part``: the options of ``OWN`` replaced by the part's own (and ``--arms`` and
    ``--default`` for a part holding some arms: the default stays where it is among them, else their first
    sparse one)."""
    own = ["--seeds", *map(str, part.seeds)]
    own += ["--work", str(work / part.name), "--out", str(out / part.name)]
    own += [] if tar is None else ["--tar", str(part_tar(tar, part))]
    own += [] if minutes is None else ["--max-minutes", f"{minutes:.3f}"]
    own += [] if workers is None else ["--workers", str(workers)]
    own += ["--base-check" if part.base_check else "--no-base-check"]
    own += ["--base-read" if part.base_read else "--no-base-read", "--speed" if part.speed else "--no-speed"]
    own += list(part.options)
    if part.arms is None:
        return without(argv, OWN) + own
    subset = ["--part", "--arms", *part.arms, "--default", subset_default(default_arm, part.arms)]
    return without(argv, OWN + SUBSET) + own + subset


def subset_default(default_arm: str | None, arms: tuple[str, ...]) -> str:
    """The default of a part holding ``arms``: the experiment's where it holds it, else its first sparse arm (a
    part's settings must name one of its own arms; the report is told the experiment's with ``--default``)."""
    if default_arm in arms:
        return default_arm
    return next((a for a in arms if a != DENSE.name), arms[0])


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


def part_tar(tar: Path, part: Part) -> Path:
    """``results.tgz`` -> ``results_gpu1.tgz``."""
    return tar.with_name(f"{tar.name.split('.')[0]}_{part.name}{''.join(tar.suffixes)}")


def link_shared(work: Path, part: Part) -> None:
    """The part's work folder with the parent's converted model and corpus linked in (read only there)."""
    own = work / part.name
    own.mkdir(parents=True, exist_ok=True)
    for name in ("model", "corpus"):
        if not (own / name).is_symlink() and not (own / name).exists():  # linked by an earlier call
            (own / name).symlink_to(work / name, target_is_directory=True)


def launch(parts: list[Part], argv: list[str], work: Path, out: Path, tar: Path | None, minutes: float | None, workers: int | None, default_arm: str | None = None) -> int:  # fmt: skip
    """Run each GPU's parts one after another, the GPUs side by side, and wait for all; the parent's exit status
    (``EXIT_ORDER``). A part that does not finish (exit status not 0) ends its GPU's list; the parts after it count
    as not started (3: call again). Each part gets the minutes left when it starts."""
    deadline = None if minutes is None else time.monotonic() + 60 * minutes
    codes: dict[Part, int] = {}

    def run_gpu(gpu: int) -> None:
        for part in [p for p in parts if p.gpu == gpu]:
            link_shared(work, part)
            left = None if deadline is None else (deadline - time.monotonic()) / 60
            cmd = [sys.executable, "-m", "experiments.real_extension", *child_argv(argv, part, work, out, tar, left, workers, default_arm)]  # fmt: skip
            say(f"GPU {part.gpu}: {part.what()}")
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(part.gpu))
            env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default (module docstring)
            try:
                codes[part] = subprocess.Popen(cmd, cwd=ROOT, env=env).wait()
            except OSError as err:  # the child could not start: an error, not a part left for the next call
                say(f"GPU {part.gpu} ({part.name}) did not start: {err}")
                codes[part] = 1
            say(f"GPU {part.gpu} ({part.name}) exited {codes[part]}")
            if codes[part] != 0:
                return

    threads = [threading.Thread(target=run_gpu, args=(g,)) for g in sorted({p.gpu for p in parts})]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    found = [codes.get(p, NOT_STARTED) for p in parts]
    return next((c for c in EXIT_ORDER if c in found), max(found))


def variant_parts(exp: Experiment, variants: dict[str, tuple[str, ...]], gpus: int) -> list[Part]:
    """``--variants``: one part per variant, each every seed and arm with its own options, round the GPUs in the
    order given; the base check and the base read on the first (the base is every variant's), the speed stage on
    each (its own models)."""
    return [
        Part(i % gpus, exp.s.seeds, base_check=i == 0 and exp.base_check_stage, base_read=i == 0 and exp.base_read,
             speed=exp.speed_stage, order=i // gpus, variant=name, options=options)
        for i, (name, options) in enumerate(variants.items())
    ]  # fmt: skip


def plan_parts(exp: Experiment, gpus: int) -> list[Part]:
    """The split kept in ``<work>/parts.json`` when it was made for ``gpus`` GPUs and these seeds and arms, else
    ``split`` of ``exp``'s seeds over ``gpus`` GPUs, balanced by the stages' expected seconds."""
    s = exp.s
    kept = exp.work / "parts.json"
    mine = split_key(exp, gpus)
    found = json.loads(kept.read_text()) if kept.exists() else None
    if found is not None and found["key"] == mine | stages_key(exp):
        return kept_parts(found)
    arm_s = arm_seconds(exp)
    seconds = {
        "base_check": exp.estimate.base(exp.native()).seconds if exp.base_check_stage else None,
        "base_read": exp.estimate.read(DENSE, s.lengths).seconds if exp.base_read else None,
        "speed": sum(exp.estimate.speed(n).seconds for n in s.speed_lengths) if exp.speed_stage else None,
    }
    speed_arms = tuple(a.name for a in s.sparse_arms)
    if found is not None and {k: found["key"].get(k) for k in mine} == mine:
        return replace_stages(kept_parts(found), arm_s, gpus, seconds, speed_arms)
    return split(s.seeds, arm_s, gpus, seconds["base_check"], seconds["base_read"], seconds["speed"], speed_arms)


def kept_parts(found: dict) -> list[Part]:
    """The parts of a split read from ``parts.json``."""
    return [
        Part(
            **p
            | {
                "seeds": tuple(p["seeds"]),
                "arms": p["arms"] and tuple(p["arms"]),
                "options": tuple(p.get("options", ())),
            }
        )
        for p in found["parts"]
    ]


def replace_stages(
    parts: list[Part], arm_s: dict[str, float], gpus: int, seconds: dict[str, float | None], speed_arms: tuple[str, ...]
) -> list[Part]:
    """A kept split for a call that asks for other stages than it was made with (``stages_key``): the trainings
    and every stage still asked for stay where they are (a stage placed elsewhere would run again there, and its
    results would lie in two parts), stages no longer asked for are dropped, and only those newly asked for are
    placed (``place``). ``seconds``: each stage's expected seconds, None where it is not asked for."""
    parts = [replace(p, **{name: getattr(p, name) and seconds[name] is not None for name in seconds}) for p in parts]
    load = [0.0] * gpus
    for p in parts:
        load[p.gpu] += sum(arm_s[a] for a in (p.arms or arm_s)) * len(p.seeds)
        load[p.gpu] += sum(seconds[name] or 0.0 for name in seconds if getattr(p, name))
    new = {name: None if any(getattr(p, name) for p in parts) else found for name, found in seconds.items()}
    return place(parts, load, new["base_check"], new["base_read"], new["speed"], speed_arms)


def arm_seconds(exp: Experiment) -> dict[str, float]:
    """Each arm's expected seconds in one seed (its trainings and its model's reads), in --arms order."""
    s = exp.s
    arm_s = {}
    for a in s.arms:
        one = Experiment(replace(s, seeds=s.seeds[:1], arms=(a,), default_arm=a.name), exp.sources, exp.work, exp.out, False, False, False)  # fmt: skip
        arm_s[a.name] = sum(st.expected().seconds for st in one.stages()[len(one.shared()) :] if not st.background)
    return arm_s


def split_key(exp: Experiment, gpus: int) -> dict:
    """What a kept split's trainings were placed for: a split for other GPUs, seeds or arms is made anew."""
    return {"gpus": gpus, "seeds": list(exp.s.seeds), "arms": [a.name for a in exp.s.arms]}


def stages_key(exp: Experiment) -> dict:
    """The other stages a kept split placed: when these change, the trainings and the stages still asked for stay
    where they were and only those newly asked for are placed (``replace_stages``)."""
    return {"base_read": exp.base_read, "speed": exp.speed_stage, "base_check": exp.base_check_stage}


def keep_parts(exp: Experiment, gpus: int, parts: list[Part]) -> None:
    """Write the split to ``<work>/parts.json`` unless it holds this one (the next call's ``plan_parts`` reads it)."""
    path = exp.work / "parts.json"
    found = {"key": split_key(exp, gpus) | stages_key(exp), "parts": [asdict(p) for p in parts]}
    if not path.exists() or json.loads(path.read_text()) != json.loads(json.dumps(found)):
        path.write_text(json.dumps(found, indent=1) + "\n")


def part_experiment(exp: Experiment, part: Part, settings: Settings | None = None) -> Experiment:
    """The experiment one part's child runs (its seeds, arms, stages and folders; ``settings``: a variant's)."""
    s = settings or exp.s
    arms = s.arms if part.arms is None else tuple(a for a in s.arms if a.name in part.arms)
    default = subset_default(s.default_arm, tuple(a.name for a in arms))
    return Experiment(
        replace(s, seeds=part.seeds, arms=arms, default_arm=default),
        exp.sources,
        exp.work / part.name,
        exp.out / part.name,
        part.base_read,
        part.speed,
        part.base_check,
    )

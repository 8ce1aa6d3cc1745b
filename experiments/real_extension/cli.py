"""``python -m experiments.real_extension``: fast and accurate at once on a real model (issue 31, items 4-6).

A pretrained GGUF model (SmolLM2-135M-Instruct, 8K native) is extended to --length (64K) with YaRN, once per arm
(dense; the paper's adaptive sparse setting; fixed budgets ...) on the same real long documents (site-packages
code and Python's documentation, document masking), for each seed; every trained model is read dense (sparse arms
also sparse) with NIAH and RULER-style prompts in held-out filler and perplexity by position on held-out documents;
the adaptive model's own Q/K time each sparse arm against dense attention at 64K, 128K and 512K. Exit status: 0
done, 3 call again (--max-minutes reached, or the GGUF not here yet; the same command continues), 4 the base does
not retrieve, 2 a bad command. ``--parallel-gpus N`` spreads the seeds over N GPUs of the machine, one process each
(``parallel``); ``--variants`` screens training recipes side by side the same way. ``--plan`` prints the stages
with their expected times and the session sized call by call (``session``); ``--report-from`` reports runs (each a result folder, or machines' folders joined by commas, split
by seed; each arm paired with its own run's dense arm; partial reads included, the missing cells listed) into
real_extension.json, .md and .png in bench/results/; with ``--report-recipes`` the dense models of runs of different
training recipes side by side, unpaired (``recipes``).

    python -m experiments.real_extension --plan --parallel-gpus 2 --max-minutes 9 --gguf smollm2.gguf \\
        --code-python python3 --prose docs.tar.xz
    python -m experiments.real_extension --gguf smollm2.gguf --code-python python3 --prose docs.tar.xz \\
        --seeds 0 1 --work runs/rx --out runs/rx/out --tar $OUT/results.tgz --max-minutes 9
    python -m experiments.real_extension --report-from results/a/out,results/b/out results/c/out
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import asdict, replace
from pathlib import Path

from bench.common import RESULTS_DIR

from ..common.background import Background
from ..common.stages import LOG, Clock, OutOfTime, Refused, say, write_json
from ..common.training import ROOT
from . import parallel, recipes, report, session
from .pipeline import BaseDoesNotRetrieve, Experiment, GGUFNotHere, Sources, record_call
from .settings import PRESETS, Settings, arm, calibration_for

# Settings a work folder keeps from its first call: its trainings and cached reads depend on them.
FIXED = (*report.SAME, "checkpoint_every", "device", "backend")
# The settings a --variants recipe may change: each variant trains its own models on the shared corpus and base.
RECIPE = ("steps", "earlier", "lr", "warmup", "rope_final", "rope_theta", "read_earlier")
# --variants, by name: each variant's settings and the options that make them.
Variants = dict[str, tuple[Settings, tuple[str, ...]]]
# What experiments/real_extension/gpu_call.sh passes itself (the GGUF it joins, the folders that outlive a call).
SCRIPT_SETS = ("--plan", "--gguf", "--tokenizer", "--work", "--out", "--tar")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--preset", choices=sorted(PRESETS), default="gpu", help="defaults: gpu (one H200, 64K) or toy (CPU)"
    )
    src = p.add_argument_group("inputs")
    src.add_argument("--gguf", type=Path, help="the base checkpoint (GGUF); needed until <work>/model exists")
    src.add_argument(
        "--tokenizer", type=Path, help="the base's tokenizer folder: the corpus is built first, before the GGUF is here"
    )
    src.add_argument(
        "--code-python", action="append", default=[], help="an interpreter whose site-packages are code documents"
    )
    src.add_argument("--code", type=Path, action="append", default=[], help="a folder of packages (code documents)")
    src.add_argument("--prose", type=Path, action="append", default=[], help="a prose archive (tools/prose_archive.py)")
    src.add_argument(
        "--heldout",
        action="append",
        default=None,
        help="hold out this document too (default: prose/howto with --prose)",
    )
    run = p.add_argument_group("the run")
    run.add_argument("--work", type=Path, default=None, help="stage outputs (default runs/real_extension)")
    run.add_argument("--out", type=Path, default=None, help="small results that must survive (default <work>/out)")
    run.add_argument("--tar", type=Path, default=None, help="pack --out into this .tgz after every stage")
    run.add_argument(
        "--parallel-gpus", type=int, default=1, help="spread the seeds over this many GPUs, one process each"
    )
    run.add_argument(
        "--variants",
        nargs="+",
        metavar="NAME=OPTIONS",
        help="recipes side by side, one process each round the --parallel-gpus GPUs on the same corpus and base, e.g. "
        "theta4m='--rope-theta 4e6' lr2e5='--lr 2e-5' (only the training recipe may differ: "
        + ", ".join("--" + ("schedule" if f == "earlier" else f).replace("_", "-") for f in RECIPE)
        + "); each its own work and result folder, reported on its own",
    )
    run.add_argument("--max-minutes", type=float, default=None, help="start no stage that would end later; exit 3")
    run.add_argument("--plan", action="store_true", help="print the stages and their expected times, run nothing")
    run.add_argument(
        "--base-read", action=argparse.BooleanOptionalAction, default=True, help="read the base at every length"
    )
    run.add_argument("--speed", action=argparse.BooleanOptionalAction, default=True, help="run the speed stage")
    run.add_argument("--part", action="store_true", help=argparse.SUPPRESS)  # a child holding some arms (parallel)
    run.add_argument(
        "--base-check", action=argparse.BooleanOptionalAction, default=True, help="check the base at 8K first"
    )
    exp = p.add_argument_group("the experiment (default: the preset's)")
    exp.add_argument("--length", type=int)
    exp.add_argument("--seeds", type=int, nargs="+")
    exp.add_argument("--arms", nargs="+", help="dense, adaptive, vVsS (fixed lines), tPvVsS, vVsScC (columns)")
    exp.add_argument("--default", dest="default_arm", help="the configuration the report marks as the default")
    exp.add_argument("--steps", type=int)
    exp.add_argument(
        "--schedule",
        type=phase,
        nargs="+",
        metavar="LENGTH:STEPS",
        help="train in phases, each from the one before's model with the RoPE scaled to its length "
        "(e.g. 65536:30 131072:30); the last is --length and --steps",
    )
    exp.add_argument(
        "--rope-final",
        action="store_true",
        default=None,
        help="with --schedule: scale every phase's RoPE for the last phase's length, not each phase's own",
    )
    exp.add_argument(
        "--rope-theta",
        type=float,
        help="raise the RoPE base to this in every phase, unscaled, in place of YaRN (e.g. 4e6 for SmolLM2's 1e5)",
    )
    exp.add_argument(
        "--read-earlier",
        action="store_true",
        default=None,
        help="with --schedule: also read every earlier phase's model dense, up to its phase's length",
    )
    exp.add_argument("--lr", type=float)
    exp.add_argument("--warmup", type=int)
    exp.add_argument("--gpus", type=int, help="ranks of the striped ring each training runs on")
    exp.add_argument("--niah-prompts", type=int, help="NIAH prompts per length, answered by generation")
    exp.add_argument(
        "--niah-forced-prompts",
        type=int,
        help="NIAH prompts per length scored teacher-forced, the first --niah-prompts of them also generated and the "
        "others read by a prefill alone (default: --niah-prompts)",
    )
    exp.add_argument(
        "--sparse-reads",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also read sparse arms' models with their own attention (default: yes)",
    )
    exp.add_argument("--ruler-samples", type=int, help="prompts per RULER-style task and length")
    exp.add_argument("--ruler-tasks", nargs="+")
    exp.add_argument("--ppl-windows", type=int, help="held-out documents per length for perplexity")
    exp.add_argument("--base-prompts", type=int, help="NIAH prompts of the base check")
    exp.add_argument("--base-gate", type=float, help="percent the base check must be able to reach (0: none)")
    exp.add_argument("--heldout-fraction", type=float)
    exp.add_argument("--speed-lengths", type=int, nargs="+")
    exp.add_argument("--speed-layers", type=int, nargs="+", help="layers the speed stage times (default: every third)")
    exp.add_argument("--speed-repeats", type=int)
    exp.add_argument(
        "--speed-docs", type=int, help="held-out documents the speed stage dumps Q/K/V from, each timed (default: 3)"
    )
    exp.add_argument("--speed-arms", nargs="+", help="sparse arms the speed stage times on the same Q/K, not trained")
    exp.add_argument(
        "--speed-backends",
        nargs="+",
        metavar="NAME",
        help="backends the speed stage times each sparse arm on, on the same Q/K (auto, torch, triton, fa4; default: "
        "the run's backend); the records' attention_speedup is the first's",
    )
    exp.add_argument("--workers", type=int, help="corpus and prompt-building processes (default: the spare cores)")
    rep = p.add_argument_group("report")
    rep.add_argument(
        "--report-from",
        type=Path,
        nargs="+",
        help="report these runs: each a result folder (--out), or machines' folders joined by commas",
    )
    rep.add_argument("--report-out", type=Path, default=RESULTS_DIR, help="where the pooled report goes")
    rep.add_argument("--report-name", default="real_extension", help="the report's file names (<name>.json, .md, .png)")
    rep.add_argument(
        "--report-recipes",
        action="store_true",
        help="report the runs' dense models side by side, unpaired: runs of different training recipes (recipes.py)",
    )
    return p


def phase(text: str) -> tuple[int, int]:
    """``65536:30`` -> (65536, 30): one phase of --schedule."""
    try:
        length, steps = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LENGTH:STEPS (e.g. 65536:30)") from None
    return length, steps


def settings_of(args: argparse.Namespace) -> Settings:
    """The preset with the options given; ValueError naming an option that cannot run."""
    s = PRESETS[args.preset]
    fields = ("length", "steps", "lr", "warmup", "gpus", "niah_prompts", "ruler_samples", "ppl_windows", "base_prompts")
    fields += ("niah_forced_prompts", "base_gate", "heldout_fraction", "speed_repeats", "speed_docs", "workers")
    fields += ("default_arm",)
    fields += ("sparse_reads", "rope_final", "rope_theta", "read_earlier")
    s = replace(s, **{f: getattr(args, f) for f in fields if getattr(args, f) is not None})
    for f in ("seeds", "ruler_tasks", "speed_lengths", "speed_layers", "speed_backends"):
        if getattr(args, f) is not None:
            s = replace(s, **{f: tuple(getattr(args, f))})
    if args.arms is not None:
        s = replace(s, arms=tuple(arm(name) for name in args.arms))
    if args.speed_arms is not None:
        s = replace(s, speed_arms=tuple(arm(name) for name in args.speed_arms))
    if args.schedule is not None:
        (length, steps), earlier = args.schedule[-1], tuple(args.schedule[:-1])
        for name, given, last in (("length", args.length, length), ("steps", args.steps, steps)):
            if given is not None and given != last:
                raise ValueError(f"--{name} {given} is not the last phase of --schedule ({length}:{steps})")
        s = replace(s, length=length, steps=steps, earlier=earlier)
    s = replace(s, costs=replace(s.costs, calibration=calibration_for(s.length, s.costs.calibration)))
    s.check(paired=not args.part)
    return s


def check_work(work: Path, settings: Settings) -> None:
    """Refuse a work folder made with other ``FIXED`` settings (its trainings and reads would not pair)."""
    path = work / "settings.json"
    mine = {k: v for k, v in json.loads(json.dumps(asdict(settings))).items() if k in FIXED}
    if not path.exists():
        write_json(path, mine)
        return
    theirs = json.loads(path.read_text())
    differ = sorted(k for k in FIXED if report.setting(theirs, k) != report.setting(mine, k))
    if differ:
        raise Refused(
            f"{work} was made with other {differ} ({', '.join(f'{k}={theirs.get(k)!r}' for k in differ)}): give "
            "another --work or the same settings"
        )


def print_plan(experiment: Experiment, max_minutes: float | None) -> None:
    """This process's stages with their expected seconds (or done)."""
    rows = experiment.plan()
    width = max(len(r["stage"]) for r in rows)
    total = 0.0
    for r in rows:
        if r["done"]:
            print(f"{r['stage']:<{width}}  done")
        elif r["background"]:
            print(f"{r['stage']:<{width}}  on the spare cores, beside the stages below")
        else:
            total += r["expected"].seconds
            print(f"{r['stage']:<{width}}  {r['expected']}")
    print(f"to run: ~{total / 60:.1f} minutes on one GPU")


def print_session(
    experiment: Experiment,
    gpus: int,
    max_minutes: float | None,
    argv: list[str],
    variants: Variants,
) -> None:
    """The session sized call by call (``session.simulate``) for ``gpus`` GPUs and the command of every call."""
    minutes = max_minutes or 9.0
    parts = parts_of(experiment, gpus, variants)
    lanes: dict[int, list[session.Planned]] = {}
    for p in parts:  # a GPU's parts run one after another
        e = parallel.part_experiment(experiment, p, variants[p.variant][0] if p.variant else None)
        lanes.setdefault(p.gpu, []).extend(session.Planned.of(st) for st in e.stages()[len(e.shared()) :] if not st.done() and not st.background)  # fmt: skip
    shared = [session.Planned.of(st) for st in experiment.shared() if not st.done()]
    calls = session.simulate(shared, lanes, 60 * minutes, experiment.sources.tokenizer is not None)
    for p in parts:
        print(f"GPU {p.gpu}{', then' if p.order else ''}: {p.what()}")
    own = parallel.without(argv, SCRIPT_SETS) + ([] if max_minutes else ["--max-minutes", "9"])
    command = "MTRAINING_COMMIT=<commit> bash experiments/real_extension/gpu_call.sh " + shlex.join(own)
    print("\n".join(session.describe(calls, len(lanes), 60 * minutes, command)))


def variants_of(argv: list[str], given: list[str] | None, common: Settings) -> Variants:
    """``--variants NAME=OPTIONS ...``: each variant's settings (``argv`` with its options) and options; ValueError
    naming the variant when its name is not a folder name, is repeated, or its options change more than the recipe
    (``RECIPE``)."""
    found: Variants = {}
    base = parallel.without(argv, ("--variants",))
    for item in given or []:
        name, _, text = item.partition("=")
        if not name or not all(c.isalnum() or c in "_-" for c in name) or name in found or not text.strip():
            raise ValueError(f"--variants {item!r}: NAME=OPTIONS, a distinct name of letters, digits, _ or -")
        options = tuple(shlex.split(text))
        settings = settings_of(parser().parse_args(base + list(options)))
        mine, theirs = asdict(settings), asdict(common)
        changed = sorted(k for k in mine if mine[k] != theirs[k] and k not in (*RECIPE, "costs"))  # costs: of length
        if changed:
            raise ValueError(
                f"--variants {name}: {' '.join(options)} changes {changed}; a variant may change only "
                "the training recipe (" + ", ".join(RECIPE) + "), so that every variant shares the corpus and reads"
            )
        found[name] = (settings, options)
    return found


def write_reports(args: argparse.Namespace) -> None:
    """``--report-from``: the paired report of the runs, or with ``--report-recipes`` their recipes side by side."""
    if args.report_recipes:
        path = recipes.write_recipes(args.report_from, args.report_out, args.report_name)
        print(f"wrote {path} and {path.with_suffix('.md')}")
        return
    path = report.write_report(args.report_from, args.report_out, args.report_name, default=args.default_arm)
    print(f"wrote {path}, {path.with_suffix('.md')} and {path.with_suffix('.png')}")
    lacking = json.loads(path.read_text())["missing"]
    if lacking:
        print(f"partial: {len(lacking)} missing: " + "; ".join(lacking))


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    if args.report_from:
        try:
            write_reports(args)
        except ValueError as err:
            p.error(str(err))
        return
    try:
        settings = settings_of(args)
    except ValueError as err:
        p.error(str(err))
    heldout = (
        args.heldout if args.heldout is not None else (["prose/howto"] if args.prose and args.preset == "gpu" else [])
    )
    resolved = lambda paths: tuple(p.resolve() for p in paths)  # noqa: E731 - the corpus runs from the repository
    gguf = args.gguf.resolve() if args.gguf else None
    tokenizer = args.tokenizer.resolve() if args.tokenizer else None
    if args.plan and tokenizer is None:
        tokenizer = ROOT / ".gguf" / "tok"  # the plan is of gpu_call.sh's calls, which pass it: the corpus comes first
    sources = Sources(gguf, tuple(args.code_python), resolved(args.code), resolved(args.prose), tuple(heldout), tokenizer)  # fmt: skip
    work = (args.work or ROOT / "runs" / "real_extension").resolve()  # training configs name absolute paths
    out = (args.out or work / "out").resolve()
    tar = args.tar.resolve() if args.tar else None
    experiment = Experiment(settings, sources, work, out, args.base_read, args.speed, args.base_check, tar)
    argv = sys.argv[1:] if argv is None else argv
    if args.parallel_gpus < 1:
        p.error(f"--parallel-gpus must be at least 1, got {args.parallel_gpus}")
    try:
        variants = variants_of(argv, args.variants, settings)
    except ValueError as err:
        p.error(str(err))
    if args.plan:
        if args.parallel_gpus == 1 and not variants:
            print_plan(experiment, args.max_minutes)
        try:
            print_session(experiment, args.parallel_gpus, args.max_minutes, argv, variants)
        except ValueError as err:
            print(f"no session plan: {err}")
        return
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    LOG.append(out / "real_extension.log")
    Clock.stop_after(args.max_minutes)
    say(f"real-model extension to {settings.length}, seeds {list(settings.seeds)}, arms {[a.name for a in settings.arms]}: work {work}, results {out}")  # fmt: skip
    status = 1  # an unexpected error (its traceback follows)
    record_call(out, settings, sources, None)
    try:
        check_work(work, settings)
        if args.parallel_gpus > 1 or variants:
            status = run_parallel(experiment, args.parallel_gpus, argv, variants)
        else:
            with Background(settings.workers) as background:
                experiment.background = background
                experiment.run()
            status = 0
            say("done")
    except Refused as err:
        say(f"refused: {err}")
        status = 2
    except GGUFNotHere as err:
        say(f"stopped: {err}")
        status = 3
    except OutOfTime as err:
        say(f"stopped within --max-minutes {args.max_minutes}: {err}; run the same command again to continue")
        status = 3
    except BaseDoesNotRetrieve as err:
        say(f"stopped: {err}")
        status = 4
    finally:
        record_call(out, settings, sources, status)
        experiment.pack()
    sys.exit(status)


def parts_of(experiment: Experiment, gpus: int, variants: Variants) -> list[parallel.Part]:
    """The processes of a run over ``gpus`` GPUs: one per variant (``parallel.variant_parts``), else the seeds and
    arms split (``parallel.plan_parts``)."""
    if variants:
        return parallel.variant_parts(experiment, {k: options for k, (_, options) in variants.items()}, gpus)
    return parallel.plan_parts(experiment, gpus)


def run_parallel(experiment: Experiment, gpus: int, argv: list[str], variants: Variants) -> int:
    """The shared stages here, then the parts, one process each, a GPU's one after another (``parallel.launch``);
    the children's combined exit status."""
    for st in experiment.shared():
        if not st.done():
            experiment.run_stage(st)
    parts = parts_of(experiment, gpus, variants)
    if not variants:
        parallel.keep_parts(experiment, gpus, parts)
    left = Clock.left()
    busy = len({p.gpu for p in parts})
    workers = max(1, (experiment.s.workers or (os.cpu_count() or 2) - 1) // busy)
    status = parallel.launch(
        parts, argv, experiment.work, experiment.out, experiment.tar, None if left is None else left / 60, workers,
        experiment.s.default_arm,
    )  # fmt: skip
    say("done" if status == 0 else f"the GPUs' exit status: {status}")
    return status

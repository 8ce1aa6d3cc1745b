"""Does dynamic sparse training keep accuracy? Context extension of a retrieval-capable model, dense vs sparse.

The small-scale twin of the paper's experiment (extend a pretrained model 8x with dense or with
dynamic sparse attention, then compare retrieval and perplexity), in five resumable stages:

1. corpus: a generated tokenizer and training token files (recall_corpus.py: word-level
   associative recall; text_corpus.py at the GPU scale: the eval's NIAH/RULER formats);
2. base: a Qwen2 pretrained with dense attention at length L0 through a curriculum of stages, each
   a ``mtraining train`` run starting from the previous stage's export; then checked on a few held-out
   prompts at L0: a base that clearly does not retrieve stops the run (exit status 4);
3. extend: from the base, RoPE base raised (``model.rope_theta``) and trained at 8 x L0 with the same
   seed, data order and steps, once dense and once per sparse budget (dynamic sparse attention,
   through the striped context-parallel ring when the scale has several ranks; layer 0 dense);
4. eval: every model at L0, 2 L0, 4 L0, 8 L0 on the same held-out documents, extended models with
   dense and with sparse attention (evaluation.py, through ``mtraining.eval``);
5. report: ``extension_<scale>.json`` (every figure, device, commit, command), ``.md``, three PNGs
   and the log, flat in ``--out`` (report.py).

The text task's CPU-only preparation overlaps the base's training (experiments/common/background.py): the
tokenizer and the corpus files are written in stage order on a pool of the spare cores (all but the training's
and this process's), each training stage waiting for its own file only; then the evaluations' NIAH/RULER prompts
at every length are built into ``<work>/eval/prompts.pkl``, which the first evaluation waits for. Files and prompts are
those a sequential run makes; each file is recorded in ``corpus/manifest.json`` once complete (written whole, then
renamed), so a call stopped anywhere leaves none half-made and the next call writes what is missing.

A stage whose output exists in ``--work`` is skipped, so a run that stops continues where it was
(an interrupted training resumes from its last checkpoint). ``--max-minutes`` fits a time-limited
call: at that time a training gets SIGTERM (it saves a checkpoint and stops), and no stage starts
that would end later (an evaluation is expected to take as long as the longest one of this call);
the run exits with status 3, and the same command continues it. Every stage logs its wall time.

    python -m experiments.extension --scale cpu                    # ~128 CPU-minutes (v30c128 included); writes bench/results/
    python -m experiments.extension --scale gpu-smoke --out $OUT   # the GPU path in miniature, ~2 minutes
    python -m experiments.extension --scale gpu --max-minutes 8.5 --out $OUT   # one H200, two calls (BENCHMARKS.md)
    python -m experiments.extension --scale toy --work /tmp/w --out /tmp/o   # the pipeline in miniature

A replicate (another extension pair from the same base, evaluated on the same prompts) differs in its extension data
alone: ``--extension-seed`` seeds the extension's corpus file and data order, ``--seed`` everything else. Each
replicate needs its own --work (a folder's extensions are those of one extension seed):

    python -m experiments.extension --scale gpu --base-from runs/r0 --extension-seed 1 --work runs/r1 --out runs/out_r1

``--niah-samples`` and ``--ruler-samples`` change the text task's prompt counts (more prompts, narrower intervals);
runs compared or pooled need the same counts, and an evaluation cached with other counts is refused.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

from bench.common import RESULTS_DIR, commit, provenance

from ..common.background import Background, Parts
from ..common.stages import LOG, Clock, OutOfTime, Refused, say, write_json
from ..common.training import ROOT, train
from . import evaluation, recall_corpus, report, text_corpus
from .recall_corpus import Shape
from .settings import SCALES, Budget, Scale, Stage

EVAL_S: list[float] = []  # wall time of each evaluation of this call


class BaseDoesNotRetrieve(Exception):
    """The base clearly fails the retrieval it needs at L0: extending it could show nothing."""


# ---------------------------------------------------------------------------------------------- 1: corpus
def corpus(
    scale: Scale, work: Path, seed: int, base_from: Path | None = None, extension_seed: int | None = None
) -> dict:
    """Every corpus file written (here and now) and the manifest's entries: see ``open_corpus``."""
    return open_corpus(scale, work, seed, base_from, extension_seed=extension_seed).complete()


def open_corpus(
    scale: Scale,
    work: Path,
    seed: int,
    base_from: Path | None = None,
    background: Background | None = None,
    extension_seed: int | None = None,
) -> Parts:
    """The tokenizer and one token file per training run (curriculum stage i, the extension), and for the text task
    the held-out set, written in that order in ``background`` (None: here and now); ``corpus[name]`` waits for its
    file. ``base_from``: another work folder whose base this run reuses: its tokenizer and curriculum files are
    taken (they must have been made for this curriculum), only the extension's file and the held-out set are written.
    ``extension_seed`` (default ``seed``) seeds the extension's file alone.

    ``corpus/manifest.json`` records each file once it is complete (files are written whole, then renamed), with
    ``made_for``: a call that stops midway leaves the files it finished, the next call writes the others."""
    folder = work / "corpus"
    manifest = folder / "manifest.json"
    stages = {f"stage{i}": st for i, st in enumerate(scale.curriculum)} | {"extension": scale.extension}
    extension_seed = seed if extension_seed is None else extension_seed
    made_for = corpus_spec(scale, stages, seed, extension_seed)
    found = json.loads(manifest.read_text()) if manifest.exists() else {"made_for": made_for}
    if found.get("made_for") != made_for:
        raise Refused(
            f"{folder} was generated for another curriculum, vocabulary, seed or extension seed than this run's; "
            f"delete {work} (its runs trained on that corpus) or pass another --work"
        )
    seeds = {name: extension_seed if name == "extension" else seed for name in stages}
    found.pop("made_for")
    tokenizer = Path(found.get("tokenizer", folder / "tokenizer.json"))
    makers: dict[str, Callable[[], object]] = {}
    if scale.task == "recall":
        makers["tokenizer"] = lambda: str(recall_corpus.write_tokenizer(scale.vocab, tokenizer))
        for i, (name, st) in enumerate(stages.items()):
            shape = None if st.repeat else Shape(st.pairs, st.pairs)
            samples = st.steps * st.batch
            makers[name] = partial(
                recall_corpus.train_stream,
                folder / f"{name}.npy",
                scale.vocab,
                st.seq_len,
                samples,
                shape,
                seeds[name],
                i,
            )
    else:
        base = [name for name in ("tokenizer", *stages) if name != "extension"]
        if base_from is not None and any(name not in found for name in base):
            found |= _base_corpus(base_from, made_for)
            tokenizer = Path(found["tokenizer"])
        makers["tokenizer"] = lambda: str(text_corpus.write_tokenizer(tokenizer, scale.text_vocab, seed))
        pool = background.pool if background is not None else None
        for i, (name, st) in enumerate(stages.items()):
            tokens = st.steps * st.batch * st.seq_len + st.seq_len + 1
            kinds = st.kinds or text_corpus.KINDS
            args = (tokenizer, tokens, st.seq_len, seeds[name], i, st.repeat, kinds, st.min_fill, pool)
            makers[name] = partial(text_corpus.train_stream, folder / f"{name}.npy", *args)
        makers["heldout"] = partial(
            text_corpus.heldout, folder / "heldout.jsonl", tokenizer, scale.long, scale.eval_docs, seed
        )
    return Parts(folder, made_for, found, makers, background, _corpus_log)


def _corpus_log(name: str, entry) -> None:
    counted = f"{entry['tokens']} tokens" if isinstance(entry, dict) and "tokens" in entry else "written"
    say(f"corpus: {name} {counted}")


def _base_corpus(base_from: Path, made_for: dict) -> dict:
    """The tokenizer and curriculum files of ``base_from``'s corpus, checked to be made for ``made_for``'s curriculum."""
    if made_for["task"] != "text":
        raise Refused("--base-from serves the text task (the GPU scales); the recall task's corpus is quick to make")
    path = base_from / "corpus" / "manifest.json"
    if not path.exists():
        raise Refused(f"--base-from {base_from}: no corpus there ({path} missing); give the work folder of a run")
    found = json.loads(path.read_text())
    theirs, ours = found["made_for"], made_for
    same = {k: v for k, v in theirs.items() if k != "stages"} == {k: v for k, v in ours.items() if k != "stages"}
    curriculum = [name for name in ours["stages"] if name != "extension"]
    if not same or any(theirs["stages"].get(name) != ours["stages"][name] for name in curriculum):
        raise Refused(
            f"--base-from {base_from}: its base was trained on a corpus made for another curriculum, vocabulary or "
            "seed than this run's; reuse a base only across runs that differ in the extension (its data, its "
            "--extension-seed) or its evaluation"
        )
    return {name: found[name] for name in ("tokenizer", *curriculum)}


def reuse_base(base_from: Path, work: Path) -> None:
    """Link ``base_from``'s base (its curriculum runs) into ``work`` and copy its base check, base evaluation and
    prompt cache, so that this run starts at its extensions (``corpus`` takes the same base's files)."""
    base_from = base_from.resolve()
    if not (base_from / "base").is_dir():
        raise Refused(f"--base-from {base_from}: no base there ({base_from / 'base'} missing)")
    if not (work / "base").exists():
        (work / "base").symlink_to(base_from / "base", target_is_directory=True)
    (work / "eval").mkdir(parents=True, exist_ok=True)
    for name in ("base_check.json", "base__dense.json", "prompts.pkl"):
        if (base_from / "eval" / name).exists() and not (work / "eval" / name).exists():
            shutil.copy2(base_from / "eval" / name, work / "eval" / name)


def corpus_spec(scale: Scale, stages: dict[str, Stage], seed: int, extension_seed: int) -> dict:
    """What a corpus's files depend on, kept in its manifest so a changed curriculum never reuses stale files.
    An ``extension_seed`` other than ``seed`` is in the extension's entry (which ``_base_corpus`` leaves out:
    replicates share a base); equal, it is left out, as in manifests written before there was one."""
    stages = {name: vars(st) for name, st in stages.items()}
    if extension_seed != seed:
        stages["extension"] = stages["extension"] | {"extension_seed": extension_seed}
    data = dict(task=scale.task, seed=seed, stages=stages)
    if scale.task == "recall":
        data |= dict(vocab=repr(scale.vocab))
    else:
        data |= dict(text_vocab=scale.text_vocab, long=scale.long, eval_docs=scale.eval_docs)
    return json.loads(json.dumps(data))  # as the manifest reads back (tuples as lists)


# ---------------------------------------------------------------------------------------------- 2-3: training
def train_config(
    scale: Scale, stage: Stage, run: Path, data: Mapping, name: str, source: dict, budget: Budget | None, seed: int
) -> dict:
    """A ``mtraining train`` config; ``source``: model.path (a previous export) or model.config, and rope_theta."""
    extension = stage.seq_len == scale.long
    ranks = scale.ranks if extension else scale.base_ranks
    context = ranks if extension else 1
    attention = dict(
        sparse=budget is not None,
        layout="striped",
        block_size=scale.block_size,
        backend=scale.backend,
        dense_layers=[0],
        max_density=None,  # every sparse step stays sparse: this is what the experiment measures
    )
    if budget is not None:
        attention.update(budget.pattern(stage.seq_len, scale))
    return dict(
        model=dict(**source, dtype=scale.dtype) | ({"init": scale.init} if "config" in source else {}),
        attention=attention,
        parallel=dict(data=ranks // context, context=context),
        data=dict(
            sources=[data[name]["path"]],
            tokenizer=data["tokenizer"],
            seq_len=stage.seq_len,
            batch_size=stage.batch // (ranks // context),
            shuffle=True,
            document_masking=extension and scale.document_masking,
        ),
        optim=dict(
            lr=stage.lr,
            warmup_steps=min(stage.warmup, stage.steps),
            min_lr_ratio=stage.min_lr_ratio,
            weight_decay=0.1,
            grad_clip=1.0,
        ),
        train=dict(
            steps=stage.steps,
            device=scale.device,
            seed=seed,
            activation_checkpointing=extension and scale.activation_checkpointing,
        ),
        checkpoint=dict(
            dir=str(run / "checkpoints"), every=scale.checkpoint_every, resume=True, export_dir=str(run / "export")
        ),
        log=dict(dir=str(run / "log"), every=5, tensorboard=False, progress=False),
    )


def base_model(scale: Scale, work: Path, data: Mapping, seed: int) -> tuple[Path, list[dict]]:
    """The curriculum: stage 0 from random weights, each next stage from the previous export."""
    source = dict(config=scale.model, rope_theta=scale.base_theta)
    summaries = []
    for i, stage in enumerate(scale.curriculum):
        run = work / "base" / f"stage{i}"
        summary = train(run, train_config(scale, stage, run, data, f"stage{i}", source, None, seed))
        source = dict(path=str(run / "export"))
        summaries.append(summary | stage_check(scale, run, stage, seed))
    return Path(source["path"]), summaries


def stage_check(scale: Scale, run: Path, stage: Stage, seed: int) -> dict:
    """Text scales: NIAH of a curriculum stage's export at its length (10 prompts), logged, so a base that fails
    the final check shows at which stage retrieval came or went. {} elsewhere. Cached in ``run/niah.json``."""
    if scale.task != "text" or not scale.base_check or stage.seq_len < 256:
        return {}
    path = run / "niah.json"
    if not path.exists():
        checked = evaluation.check_base(str(run / "export"), replace(scale, l0=stage.seq_len, base_check=10), seed)
        write_json(path, {"length": stage.seq_len, "accuracy": checked["accuracy"], "examples": checked["examples"]})
    found = json.loads(path.read_text())
    accuracy, example = found["accuracy"], found["examples"][0]
    say(
        f"  NIAH at {found['length']}: {accuracy['percent']:.0f}% of {accuracy['answers']} "
        f"(answer {example['answers'][0]}, generated {example['prediction'][:12]!r})"
    )
    return {"niah": {k: found[k] for k in ("length", "accuracy")}}


def check_base(scale: Scale, work: Path, base: Path, seed: int, gate: bool = True) -> dict | None:
    """The base's retrieval at L0 on ``scale.base_check`` prompts, before anything is extended from it.

    With ``gate``, raises ``BaseDoesNotRetrieve`` when even the upper end of its 95% interval is below what
    the report requires of the base (``BASE_GATE``): then every later stage would be spent on an experiment
    that cannot be informative. Without, says so and goes on. Cached in <work>/eval/base_check.json."""
    if not scale.base_check:
        return None
    path = work / "eval" / "base_check.json"
    if path.exists():
        result = json.loads(path.read_text())
    else:
        with Clock(expected=scale.eval_s / 4) as clock:
            result = evaluation.check_base(str(base), scale, seed)
        result.update(wall_s=clock.wall_s, cpu_s=clock.cpu_s)
        write_json(path, result)
    needed, found = report.BASE_GATE[result["task"]], result["accuracy"]
    (low, high), percent = found["interval"], found["percent"]
    say(f"base check: {result['task']} at {scale.l0}: {percent:.1f}% [{low:.0f}, {high:.0f}] (needs {needed:g}%)")
    for example in result.get("examples", []):
        say(f"  answers {example['answers']}, generated {example['prediction']!r}")
    if high < needed and not gate:
        say("  below what the comparison needs; extending it anyway (--extend-anyway)")
    elif high < needed:
        raise BaseDoesNotRetrieve(
            f"the base retrieves {percent:.1f}% [{low:.0f}, {high:.0f}] on {result['task']} at L0 = {scale.l0}, "
            f"clearly below the {needed:g}% the comparison needs: train the base longer or on more retrieval data "
            f"(the curriculum in settings.py), delete {work / 'base'} and run again; "
            "--extend-anyway extends it all the same"
        )
    return result


def extensions(scale: Scale, work: Path, data: Mapping, base: Path, seed: int) -> dict[str, dict]:
    """Dense and one sparse run per budget, each from the base with the raised RoPE base, identical otherwise;
    ``seed``: their data order (the extension seed)."""
    source = dict(path=str(base), rope_theta=scale.base_theta * scale.theta_factor)
    runs = {}
    for budget in (None, *scale.budgets):
        name = "dense" if budget is None else f"sparse-{budget.name}"
        run = work / "extend" / name
        runs[name] = train(run, train_config(scale, scale.extension, run, data, "extension", source, budget, seed))
    return runs


# ---------------------------------------------------------------------------------------------- 4: evaluation
def eval_plan(scale: Scale) -> list[tuple[str, str, Budget | None]]:
    """(label, model, sparse budget or None): the base dense; the dense extension dense and at every sparse
    budget (sparse inference on a dense-trained model); each sparse extension at its own budget and dense.
    ``scale.cross`` says which cross evaluations run: all, the default budget's only, or none."""
    plan = [("base/dense", "base", None), ("dense/dense", "dense", None)]
    for b in scale.budgets:
        name = f"sparse-{b.name}"
        cross = scale.cross == "all" or (scale.cross == "default" and b.name == scale.default_budget)
        plan += [(f"dense/{name}", "dense", b)] if cross else []
        plan += [(f"{name}/{name}", name, b)] + ([(f"{name}/dense", name, None)] if cross else [])
    return plan


def evaluate(
    scale: Scale, work: Path, data: Mapping, label: str, export: Path, budget: Budget | None, seed: int
) -> dict:
    """One model with dense (``budget`` None) or sparse attention; cached in eval/<label>.json."""
    path = work / "eval" / (label.replace("/", "__") + ".json")
    if path.exists():
        return checked_evaluation(path, json.loads(path.read_text()), scale)
    with Clock(expected=max(EVAL_S, default=scale.eval_s)) as clock:  # an evaluation cannot stop midway
        if scale.task == "text":
            result = evaluation.evaluate_text(str(export), scale, budget, Path(data["heldout"]["path"]), seed)
        elif scale.ranks > 1:  # gloo ranks: the sequences go through the striped ring, as in training
            from mtraining.train.launch import run_local

            docs = evaluation.recall_documents(scale, seed)
            result = run_local(evaluation.evaluate_recall, scale.ranks, str(export), scale, budget, docs, timeout=7200)[
                0
            ]
        else:
            result = evaluation.evaluate_recall(str(export), scale, budget, evaluation.recall_documents(scale, seed))
    EVAL_S.append(clock.wall_s)
    result.update(
        commit=commit(),
        label=label,
        model=export.parent.name,
        attention="dense" if budget is None else f"sparse {budget.name}",
        pattern={n: budget.pattern(n, scale) for n in scale.lengths} if budget is not None else None,
        wall_s=clock.wall_s,
        cpu_s=clock.cpu_s,
    )
    write_json(path, result)
    found = []
    for task in scale.tasks:
        cells = [report.accuracy(result["tasks"][task][str(n)]["documents"]) for n in scale.lengths]
        found.append(f"{task} " + " ".join(f"{c['percent']:.0f}" for c in cells))
    say(
        f"eval {label}: % found at {scale.lengths}: {'; '.join(found)} ({clock.wall_s:.0f}s wall, {clock.cpu_s:.0f}s cpu)"
    )
    return result


def checked_evaluation(path: Path, result: dict, scale: Scale) -> dict:
    """A cached text evaluation, refused if it scored another number of prompts than ``scale`` asks for (one made
    before --niah-samples or --ruler-samples changed): its records would not pair with this run's."""
    if scale.task != "text":
        return result
    first = str(scale.lengths[0])
    made = (
        len(result["tasks"]["niah"][first]["documents"]) // len(scale.depths),
        len(result["tasks"]["ruler"][first]["documents"]) // len(scale.ruler_tasks),
    )
    if made != (scale.niah_samples, scale.ruler_samples):
        raise Refused(
            f"{path} scored {made[0]} NIAH prompts per depth and {made[1]} RULER-style prompts per task, this run "
            f"asks for {scale.niah_samples} and {scale.ruler_samples}: delete it to evaluate again, or give the "
            "counts it was made with (--niah-samples, --ruler-samples)"
        )
    return result


# ---------------------------------------------------------------------------------------------- main
def run(
    scale: Scale,
    work: Path,
    out: Path,
    seed: int,
    extend_anyway: bool = False,
    base_from: Path | None = None,
    base_only: bool = False,
    extension_seed: int | None = None,
) -> dict:
    """Every stage (skipping those done), then the results, report and plots in ``out``. ``base_from``: the
    work folder of a run with the same curriculum whose base (and its evaluations) this run reuses.
    ``base_only``: the base, its check and its evaluation at L0 only (``base_result``). ``extension_seed``
    (default ``seed``): the extensions' corpus file and data order; ``seed`` seeds everything else."""
    extension_seed = seed if extension_seed is None else extension_seed
    prompts = work / "eval" / "prompts.pkl"  # the text task's prompts, kept for the next call of a resumed run
    try:
        with Background() if scale.task == "text" else contextlib.nullcontext() as background:
            data = open_corpus(scale, work, seed, base_from, background, extension_seed)
            if base_from is not None:
                reuse_base(base_from, work)
            evaluation.load_prompts(prompts)
            if background is not None:  # after the corpus; the first evaluation waits for them
                at = replace(scale, factor=1) if base_only else scale
                evaluation.expect_prompts(background.submit("prompts", _prompts, prompts, at, data, seed, background))
            if base_only:
                return base_result(scale, work, out, data, seed)
            base, base_runs = base_model(scale, work, data, seed)
            base_checked = check_base(scale, work, base, seed, gate=not extend_anyway)
            runs = extensions(scale, work, data, base, extension_seed)
            exports = {"base": base} | {name: work / "extend" / name / "export" for name in runs}
            evaluations = {
                label: evaluate(scale, work, data, label, exports[model], budget, seed)
                for label, model, budget in eval_plan(scale)
            }
            made = data.complete()
    finally:
        evaluation.save_prompts(prompts)  # the background's too, when no evaluation has waited for them
    summary = report.summarise(scale, evaluations, runs)
    stages = [*base_runs, *runs.values(), *evaluations.values()]
    result = dict(
        name=f"extension_{scale.name}",
        **provenance(on_gpu=scale.device == "cuda"),
        wall_s=round(sum(r["wall_s"] for r in stages), 1),
        cpu_s=round(sum(r["cpu_s"] for r in stages), 1),
        parameters=_parameters(base),
        seed=seed,
        extension_seed=extension_seed,
        tasks=list(scale.tasks),
        lengths=scale.lengths,
        scale=asdict(scale),
        corpus=made,
        training={r["run"]: r for r in base_runs} | {f"extend/{k}": v for k, v in runs.items()},
        base_check=base_checked,
        summary=summary,
        evaluations=evaluations,
    )
    paths = report.plots(scale, evaluations, summary, out)
    (out / f"extension_{scale.name}.md").write_text(report.markdown(scale, result, paths))
    write_json(out / f"extension_{scale.name}.json", result)
    return result


def _prompts(path: Path, scale: Scale, data: Parts, seed: int, background: Background) -> dict:
    """The evaluations' prompts that ``path`` lacks, built on ``background``'s pool (a background job)."""
    started = time.time()
    built = evaluation.build_prompts(path, scale, seed, background.pool, Path(data["tokenizer"]))
    say(f"prompts: {sum(map(len, built.values()))} built for the evaluations in {time.time() - started:.0f}s")
    return built


def base_result(scale: Scale, work: Path, out: Path, data: Parts, seed: int) -> dict:
    """The curriculum, the base check and the base's dense evaluation at L0 alone, against the base gates, in
    ``out/extension_<scale>_base.json``: a recipe's base judged in the time of its training."""
    base, base_runs = base_model(scale, work, data, seed)
    checked = check_base(scale, work, base, seed, gate=False)
    at_l0 = replace(scale, factor=1)
    evaluation = evaluate(at_l0, work, data, "base/dense-l0", base, None, seed)
    l0 = str(scale.l0)
    gates = {
        task: report.base_gate(task, report.accuracy(evaluation["tasks"][task][l0]["documents"]))
        for task in scale.tasks
    }
    stages = [*base_runs, evaluation]
    result = dict(
        name=f"extension_{scale.name}_base",
        **provenance(on_gpu=scale.device == "cuda"),
        wall_s=round(sum(r["wall_s"] for r in stages), 1),
        cpu_s=round(sum(r["cpu_s"] for r in stages), 1),
        parameters=_parameters(base),
        scale=asdict(scale),
        corpus=data.complete(),
        training={r["run"]: r for r in base_runs},
        base_check=checked,
        gates=gates,
        evaluation=evaluation,
    )
    write_json(out / f"extension_{scale.name}_base.json", result)
    say(
        "base at L0: "
        + "; ".join(
            f"{t} {g['accuracy']['percent']:.1f}% [{g['accuracy']['interval'][0]:.0f}, {g['accuracy']['interval'][1]:.0f}] "
            f"(needs {g['needed']:g}%: {'yes' if g['passed'] else 'NO'})"
            for t, g in gates.items()
        )
    )
    return result


def report_from(path: Path, out: Path) -> None:
    """Re-render a result JSON's report and plots (e.g. on the CPU from a GPU run's JSON), its summary recomputed."""
    result = json.loads(path.read_text())
    scale = SCALES[result["name"].removeprefix("extension_")]
    budgets = tuple(Budget(**b["budget"]) for b in result["summary"]["sweep"])
    scale = replace(scale, budgets=budgets, default_budget=result["scale"]["default_budget"])
    result["summary"] = report.summarise(scale, result["evaluations"], _extension_runs(result))
    paths = report.plots(scale, result["evaluations"], result["summary"], out)
    (out / f"{result['name']}.md").write_text(report.markdown(scale, result, paths))
    write_json(out / f"{result['name']}.json", result)


def _extension_runs(result: dict) -> dict[str, dict]:
    return {k.removeprefix("extend/"): v for k, v in result["training"].items() if k.startswith("extend/")}


def _parameters(export: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(export / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.extension",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--scale", choices=sorted(SCALES), default="cpu")
    p.add_argument("--work", type=Path, default=None, help="stage outputs (default: runs/extension_<scale>)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="flat folder for the results (default: bench/results)")
    p.add_argument(
        "--seed", type=int, default=0, help="seeds the corpus, tokenizer, trainings, held-out documents and prompts"
    )
    p.add_argument(
        "--extension-seed",
        type=int,
        default=None,
        help="seeds only the extensions' corpus file and data order, for replicates from one base (default: --seed)",
    )
    p.add_argument(
        "--budgets",
        default=None,
        help="sparse budgets to run, e.g. v10,t90 (default: the scale's); the first is the default unless the scale's default is among them",
    )
    p.add_argument("--max-minutes", type=float, default=None, help="start no stage after this many minutes")
    p.add_argument("--report-from", type=Path, default=None, help="re-render the report of this result JSON into --out")
    p.add_argument(
        "--extend-anyway",
        action="store_true",
        help="extend the base even if its check at L0 finds it clearly failing to retrieve (the check is recorded)",
    )
    p.add_argument(
        "--document-masking",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the extensions' packed documents attend only within themselves (default: the scale's)",
    )
    p.add_argument(
        "--base-only",
        action="store_true",
        help="train and check the base, evaluate it at L0 against the base gates, and stop (no extensions)",
    )
    p.add_argument(
        "--cross",
        choices=("all", "default", "none"),
        default=None,
        help="cross evaluations (the dense extension read sparse, sparse extensions read dense): all budgets, the "
        "default budget's only, or none (default: the scale's)",
    )
    p.add_argument(
        "--extension-kinds",
        default=None,
        help="text task: the extensions' document kinds, e.g. niah,vt (default: the scale's mixture)",
    )
    p.add_argument("--niah-samples", type=int, default=None, help="text task: NIAH prompts per length and depth")
    p.add_argument("--ruler-samples", type=int, default=None, help="text task: RULER-style prompts per task and length")
    p.add_argument(
        "--base-from",
        type=Path,
        default=None,
        help="reuse the base of this work folder (a run of the same curriculum): train and evaluate only the "
        "extensions (e.g. with other --extension-kinds or --budgets)",
    )
    return p


def _scale(args: argparse.Namespace, p: argparse.ArgumentParser) -> Scale:
    """The scale with the command line's changes; a bad one exits through ``p.error``."""
    scale = SCALES[args.scale]
    if args.document_masking is not None:
        scale = replace(scale, document_masking=args.document_masking)
    if args.cross is not None:
        scale = replace(scale, cross=args.cross)
    for name in ("niah_samples", "ruler_samples"):
        count = getattr(args, name)
        if count is not None:
            if scale.task != "text" or count < 1:
                p.error(f"--{name.replace('_', '-')} takes a count of 1 or more at a text scale (gpu, toy-text)")
            scale = replace(scale, **{name: count})
    if args.extension_kinds:
        kinds = tuple(k.strip() for k in args.extension_kinds.split(",") if k.strip())
        unknown = sorted(set(kinds) - set(text_corpus.KINDS + ("facts", "facts_word")))
        if scale.task != "text" or unknown:
            p.error(f"--extension-kinds takes text document kinds (niah, vt, recall, facts, facts_word), got {unknown}")
        scale = replace(scale, extension=replace(scale.extension, kinds=kinds))
    if args.budgets:
        names = [b.strip() for b in args.budgets.split(",") if b.strip()]
        try:
            chosen = tuple(scale.budget(n) for n in names)
        except ValueError as err:
            p.error(str(err))
        scale = replace(scale, budgets=chosen)
        if scale.default_budget not in names:
            scale = replace(scale, default_budget=names[0])
    return scale


def main() -> None:
    p = _parser()
    args = p.parse_args()
    if args.report_from is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        report_from(args.report_from, args.out)
        return
    scale = _scale(args, p)
    work = (args.work or ROOT / "runs" / f"extension_{scale.name}").resolve()  # configs resolve paths from their folder
    work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    LOG.append(args.out / f"extension_{scale.name}.log")
    Clock.stop_after(args.max_minutes)
    seeds = f"seed {args.seed}" + (f", extension seed {args.extension_seed}" if args.extension_seed is not None else "")
    say(f"context extension, {scale.name} scale, {seeds}: work dir {work}, outputs in {args.out}")
    try:
        result = run(
            scale, work, args.out, args.seed, args.extend_anyway, args.base_from, args.base_only, args.extension_seed
        )
    except Refused as e:
        say(f"refused: {e}")
        sys.exit(2)
    except OutOfTime as e:
        say(f"stopped within --max-minutes {args.max_minutes}: {e}; run the same command again to continue from {work}")
        sys.exit(3)
    except BaseDoesNotRetrieve as e:
        say(f"stopped: {e}")
        sys.exit(4)
    if args.base_only:
        return
    goal = result["summary"]["goal"]
    say(
        f"wrote {args.out}/extension_{scale.name}.json, .md, 3 PNGs; default budget at parity: "
        f"{goal['sparse_default_parity']['parity']}; budgets at parity: {goal['budgets_at_parity']}"
    )

"""Sparse against dense over several runs of the context-extension experiment: what one run's intervals miss.

A run's intervals (report.py) resample the evaluation's prompts with the trained models
fixed. Two runs of one recipe (same settings and seed, trained again on another machine) also differ in
the models, and that spread is what decides whether a few points between dense and sparse mean anything.
This reads result JSONs of pipeline.py and reports, per run, budget and length, sparse minus dense
(each sparse extension read with its own budget): NIAH over every depth and split by needle depth, the
RULER-style average and last-bucket perplexity; for runs of the same recipe (``--same``), each model's
change from one run to the other on the same prompts; and for replicates (``--pool``: runs whose evaluations
share their prompts, such as ``--extension-seed`` replicates from one base), sparse minus dense averaged over
the runs with an interval that resamples the runs as well as the prompts.

    python -m experiments.extension.replicates --run end=bench/results/extension_gpu_end.json \\
        --run mix=bench/results/extension_gpu_mix.json --run mix-again=bench/results/extension_gpu_sweep.json \\
        --same mix,mix-again --pool mix=mix,mix-again --out bench/results/extension_gpu_replicates.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from bench.common import provenance, written

from ..common.stages import write_json
from .report import (
    accuracy,
    bootstrap,
    by_depth,
    difference,
    long_range,
    paired_points,
    ppl_percent,
)


def _pair(a: list[dict], b: list[dict]) -> dict:
    return {**difference(a, b), "a": accuracy(a)["percent"], "b": accuracy(b)["percent"]}


def _budgets(result: dict) -> list[str]:
    """The run's sparse budgets, in its report's order (each extension read with its own budget)."""
    return [e["budget"]["name"] for e in result["summary"]["sweep"]]


def compare_run(result: dict) -> dict:
    """Per sparse budget and length: sparse minus dense on NIAH (all depths, depths below 1, depth 1), RULER, and
    last-bucket perplexity at the longest length (from the run's own report)."""
    ev, out = result["evaluations"], {}
    dense = ev["dense/dense"]["tasks"]
    for entry in result["summary"]["sweep"]:
        budget = entry["budget"]["name"]
        sparse, rows = ev[f"sparse-{budget}/sparse-{budget}"]["tasks"], {}
        for length in dense["niah"]:
            ds, ss = by_depth(dense["niah"][length]), by_depth(sparse["niah"][length])
            rows[length] = {
                "niah": _pair(sparse["niah"][length]["documents"], dense["niah"][length]["documents"]),
                "niah_depth_below_1": _pair(long_range(sparse["niah"][length]), long_range(dense["niah"][length])),
                "niah_depth_1": _pair(ss.get(1.0, []), ds.get(1.0, [])) if 1.0 in ds else None,
                "ruler": _pair(sparse["ruler"][length]["documents"], dense["ruler"][length]["documents"]),
            }
        out[budget] = {
            "lengths": rows,
            "ppl_last_bucket_vs_dense": entry["ppl_last_bucket_vs_dense"],
            "train_density": entry["train_density"],
        }
    return out


def compare_replicates(first: dict, second: dict) -> dict:
    """Each model in both runs: its accuracy in the second run minus the first, on the same prompts (checked)."""
    out = {}
    for label in first["evaluations"]:
        if label not in second["evaluations"] or label.startswith("base/"):
            continue
        a, b = first["evaluations"][label]["tasks"], second["evaluations"][label]["tasks"]
        out[label] = {
            task: {length: _pair(_same_prompts(b, a, task, length), a[task][length]["documents"]) for length in a[task]}
            for task in ("niah", "ruler")
        }
    return out


def _same_prompts(b: dict, a: dict, task: str, length: str) -> list[dict]:
    """``b``'s records of a cell, checked to be of ``a``'s prompts where both kept the expected answers."""
    theirs, ours = b[task][length]["documents"], a[task][length]["documents"]
    if any("expected" in x and "expected" in y and x["expected"] != y["expected"] for x, y in zip(theirs, ours)):
        raise ValueError(f"{task} at {length}: the runs were evaluated on other prompts (another --seed?)")
    return theirs


def pooled(results: list[dict], budget: str, seed: int = 0, read_dense: bool = False) -> dict:
    """Sparse (own ``budget``; ``read_dense``: the sparse extension read dense) minus dense averaged over replicate
    runs, per task and length: the mean of the runs' paired differences, each run's, and a 95% interval from a
    two-level bootstrap (runs drawn with replacement, then each drawn run's prompts, sparse and dense together),
    so it holds the spread between trainings as well as between prompts. With few runs the run-level draw has
    few outcomes: the interval is then a rough floor."""
    label = f"sparse-{budget}/{'dense' if read_dense else f'sparse-{budget}'}"
    rng = random.Random(seed)
    out: dict[str, dict] = {}
    for task in ("niah", "ruler"):
        out[task] = {}
        for length in results[0]["evaluations"]["dense/dense"]["tasks"][task]:
            records = [
                [r["evaluations"][m]["tasks"][task][length]["documents"] for m in (label, "dense/dense")]
                for r in results
            ]
            per_run = [difference(sparse, dense)["difference"] for sparse, dense in records]  # checks the pairing
            runs = [list(zip(sparse, dense)) for sparse, dense in records]

            def resampled(drawn: list[list[tuple[dict, dict]]]) -> float:
                return statistics.fmean(paired_points([rng.choice(p) for _ in p]) for p in drawn)

            interval = bootstrap(runs, resampled, seed=seed)
            out[task][length] = {
                "difference": statistics.fmean(per_run),
                "per_run": per_run,
                "interval": list(interval),
            }
    # last-bucket perplexity at the longest length, in percent, pooled the same way (documents for prompts)
    long = list(results[0]["evaluations"]["dense/dense"]["ppl"])[-1]
    runs = [list(zip(*(r["evaluations"][m]["ppl"][long] for m in (label, "dense/dense")))) for r in results]
    per_run = [ppl_percent(pairs) for pairs in runs]
    interval = bootstrap(
        runs, lambda drawn: statistics.fmean(ppl_percent([rng.choice(p) for _ in p]) for p in drawn), seed=seed
    )
    out["ppl_last_bucket"] = {
        long: {"difference": statistics.fmean(per_run), "per_run": per_run, "interval": list(interval)}
    }
    return out


def _cell(p: dict | None) -> str:
    if p is None:
        return ""
    lo, hi = p["interval"]
    return f"{p['difference']:+.1f} [{lo:+.0f}, {hi:+.0f}]"


def markdown(result: dict) -> str:
    lines = [
        "# Sparse minus dense over runs of the context-extension experiment",
        "",
        f"Commit {result['commit']}: `{result['command']}`. Each cell: sparse (own budget) minus dense, points, paired "
        "95% interval over that run's prompts (the trained models fixed). NIAH depth 1: the needle just before "
        "the question (10 prompts per length); depths 0-0.75: 40.",
        "",
        "| run | budget | length | NIAH | NIAH depths 0-0.75 | NIAH depth 1 (dense, sparse %) | RULER-style | ppl 32K |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run, budgets in result["runs"].items():
        for budget, entry in budgets.items():
            for i, (length, row) in enumerate(entry["lengths"].items()):
                d1 = row["niah_depth_1"]
                depth_1 = "" if d1 is None else f"{d1['b']:.0f}, {d1['a']:.0f}"
                ppl = entry["ppl_last_bucket_vs_dense"]["change_percent"] if i == len(entry["lengths"]) - 1 else None
                lines.append(
                    f"| {run} | {budget} | {length} | {_cell(row['niah'])} | {_cell(row['niah_depth_below_1'])} | "
                    f"{depth_1} | {_cell(row['ruler'])} | "
                    f"{'' if ppl is None else f'{ppl:+.2f}%'} |"
                )
    for pair, models in result["replicates"].items():
        lines += [
            "",
            f"## The same recipe twice: {pair} (second run minus first, same prompts)",
            "",
            "| model | task | " + " | ".join(next(iter(next(iter(models.values())).values()))) + " |",
            "| --- | --- |" + " --- |" * len(next(iter(next(iter(models.values())).values()))),
        ]
        for label, tasks in models.items():
            for task, per in tasks.items():
                lines.append(f"| {label} | {task} | " + " | ".join(_cell(p) for p in per.values()) + " |")
    for pool, budgets in result["pooled"].items():
        lines += [
            "",
            f"## Pooled over replicates: {pool} (mean of the runs' sparse minus dense, runs and prompts resampled)",
            "",
        ]
        for budget, tasks in budgets.items():
            tasks = dict(tasks)
            ppl = tasks.pop("ppl_last_bucket", None)  # results written before it lack it
            lengths = list(next(iter(tasks.values())))
            lines += [f"| budget | task | {' | '.join(lengths)} |", "| --- | --- |" + " --- |" * len(lengths)]
            for task, per in tasks.items():
                cells = [f"{_cell(p)} (runs: {', '.join(f'{x:+.0f}' for x in p['per_run'])})" for p in per.values()]
                lines.append(f"| {budget} | {task} | " + " | ".join(cells) + " |")
            for length, p in (ppl or {}).items():
                lo, hi = p["interval"]
                runs = ", ".join(f"{x:+.2f}" for x in p["per_run"])
                lines += [
                    "",
                    f"{budget}: last-bucket perplexity at {length}, sparse vs dense: {p['difference']:+.2f}% "
                    f"[{lo:+.2f}, {hi:+.2f}] (runs: {runs})",
                    "",
                ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", required=True, help="NAME=result JSON of pipeline.py (repeat)")
    p.add_argument("--same", action="append", default=[], help="FIRST,SECOND: two runs of the same recipe (repeat)")
    p.add_argument(
        "--pool", action="append", default=[], help="NAME=RUN,RUN,...: replicates whose prompts are shared (repeat)"
    )
    p.add_argument("--out", type=Path, required=True, help="result JSON (a .md of the same name beside it)")
    args = p.parse_args()
    runs = {}
    for spec in args.run:
        name, _, path = spec.partition("=")
        if not path:
            p.error(f"--run takes NAME=PATH, got {spec!r}")
        runs[name] = json.loads(Path(path).read_text())
    replicates = {}
    for spec in args.same:
        first, _, second = spec.partition(",")
        if first not in runs or second not in runs:
            p.error(f"--same {spec!r}: name two of the runs ({', '.join(runs)})")
        replicates[f"{first} -> {second}"] = compare_replicates(runs[first], runs[second])
    pools = {}
    for spec in args.pool:
        name, _, members = spec.partition("=")
        members = [m.strip() for m in members.split(",") if m.strip()]
        if len(members) < 2 or any(m not in runs for m in members):
            p.error(f"--pool {spec!r}: name two or more of the runs ({', '.join(runs)})")
        chosen = [runs[m] for m in members]
        budgets = [b for b in _budgets(chosen[0]) if all(b in _budgets(r) for r in chosen[1:])]
        pools[name] = {b: pooled(chosen, b) for b in budgets}
        for b in budgets:  # what the sparse training alone changed, where every run read its model dense too
            if all(f"sparse-{b}/dense" in r["evaluations"] for r in chosen):
                pools[name][f"{b} read dense"] = pooled(chosen, b, read_dense=True)
    result = dict(
        name=args.out.stem,
        **provenance(on_gpu=False),
        sources={
            name: {"path": spec.partition("=")[2], "commit": runs[name]["commit"], "device": runs[name]["device"]}
            for name, spec in zip(runs, args.run)
        },  # fmt: skip
        runs={name: compare_run(r) for name, r in runs.items()},
        replicates=replicates,
        pooled=pools,
    )
    write_json(args.out, result)
    with written(args.out.with_suffix(".md")) as tmp:
        tmp.write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()

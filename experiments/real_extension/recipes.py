"""Dense models of several training recipes side by side: the screen for a recipe whose dense model retrieves.

A screen (``--variants``) trains the dense arm once per recipe, each variant its own run folder, and reads every
model; with ``--read-earlier`` it also reads the model each earlier phase left. The recipes differ in how the
models were trained, so nothing pairs and no difference is taken: the report lists each run's recipe and training,
the figures read (means over the run's seeds) and the teacher-forced NIAH by needle depth. Earlier runs' folders may
stand beside the screen's as the recipes it is measured against (their other arms are left out).

    python -m experiments.real_extension --report-recipes --report-from <screen>/theta4m <screen>/lr2e5 ... \\
        --report-name <name>

Writes ``<name>.md`` and ``<name>.json`` (each run's recipe, training and figures read per model and length).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from . import report

SETTINGS = ("length", "steps", "earlier", "lr", "warmup", "rope_final", "rope_theta")
"""The recipe settings a run is described by (``cli.RECIPE``'s, as its run.json records them)."""


def label(run: str) -> str:
    """A run's short name: the last two parts of its first folder (``<run folder>/<variant>``)."""
    return "/".join(Path(run.split(",")[0]).parts[-2:])


def dense_only(run: dict) -> dict:
    """``run`` with only its dense models' trainings and reads (the screen compares dense models)."""
    keep = [name for name in run["eval"] if name.split("__")[0].split("_", 1)[1].startswith("dense")]
    train = {k: v for k, v in run["train"].items() if k.split("_", 1)[1] == "dense"}
    return run | {"eval": {k: run["eval"][k] for k in keep}, "train": train}


def recipe(run: dict) -> dict:
    """The run's recipe settings and its schedule in words."""
    s = run["settings"]
    return {key: report.setting(s, key) for key in SETTINGS} | {"schedule": report.schedule(s)}


def training(run: dict) -> dict:
    """Means over the run's seeds of its dense trainings' final loss, seconds per step and peak memory."""
    found = list(run["train"].values())
    return {
        field: report.mean_of([t.get(field) for t in found]) for field in ("final_loss", "step_s", "peak_mem_gb")
    } | {"seeds": run["seeds"]}


def recipes_table(runs: Sequence[dict]) -> list[str]:
    lines = ["## Recipes", "", "| run | commit | seeds | recipe | lr | final loss | s/step | peak GB |"]
    lines += ["|---|---|---|---|---:|---:|---:|---:|"]
    for run in runs:
        r, t = recipe(run), training(run)
        commits = ", ".join(sorted({str(c.get("commit")) for c in run["calls"]})) or "-"
        lines.append(
            f"| {run['label']} | {commits} | {', '.join(map(str, t['seeds']))} | {r['schedule']} | {r['lr']:g} | "
            f"{report.cell_text(t['final_loss'], 3)} | {report.cell_text(t['step_s'])} | {report.cell_text(t['peak_mem_gb'], 1)} |"
        )
    return lines + [""]


def markdown(runs: Sequence[dict]) -> str:
    lines = [
        "# Training recipes for the dense model: what it retrieves",
        "",
        "Each run's dense model (and, where read, the model its earlier phase left: `dense_at_<length>`) read dense, "
        "means over the run's seeds. The recipes differ, so nothing is paired and no interval is given: with one seed "
        "a recipe's figures carry the prompts' noise alone (10 generated and 30 teacher-forced NIAH prompts, one "
        "prompt per RULER-style task per length in the screens so far). "
        f"{report.niah_prompts(runs)}",
        "",
    ]
    lines += recipes_table(runs) + report.figures_read(runs) + report.niah_by_depth(runs)
    return "\n".join(lines)


def write_recipes(runs: Sequence[str | Path], out: Path, name: str) -> Path:
    """The recipe report of ``runs`` into ``out`` (``<name>.md``, ``<name>.json``); returns the JSON's path."""
    loaded = [dense_only(run) | {"label": label(run["run"])} for run in report.load_runs(runs, paired=False)]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(markdown(loaded) + "\n")
    result = [
        {
            "run": run["run"],
            "label": run["label"],
            "recipe": recipe(run),
            "training": training(run),
            "reads": {key: report.read_metrics(read) for key, read in run["eval"].items()},
        }
        for run in loaded
    ]
    path = out / f"{name}.json"
    path.write_text(json.dumps({"name": name, "runs": result}, indent=1) + "\n")
    return path

"""RULER-style synthetic tasks generated locally from a seed, scored per task and length."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from ..data.tokenizer import Tokenizer
from .answers import Prompting, score_samples, task_grid
from .engine import Engine
from .tasks import TASKS, generate


def parse_tasks(text: str, known: Sequence[str] = TASKS) -> list[str]:
    """'all' or a comma-separated subset of ``known``."""
    if text.strip() == "all":
        return list(known)
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in known]
    if unknown or not tasks:
        raise ValueError(f"unknown tasks {unknown}; use 'all' or some of {', '.join(known)}")
    return tasks


def run_ruler(
    engine: Engine,
    tokenizer: Tokenizer,
    tasks: Sequence[str],
    lengths: Sequence[int],
    prompting: Prompting = Prompting(),
) -> dict:
    """{"tasks", "lengths", "scores": {task: [percent per length]}, "counts", "average", "records"}."""
    haystack, max_new_tokens = prompting.haystack, prompting.max_new_tokens
    seeds = range(prompting.seed, prompting.seed + prompting.samples)
    runs = [
        (
            {"task": t, "length": n},
            {"seed": s},
            functools.partial(generate, t, n, s, tokenizer.count, haystack, max_new_tokens=max_new_tokens),
        )
        for t in tasks
        for n in lengths
        for s in seeds
    ]
    scores, records = score_samples(engine, tokenizer, runs, "ruler", prompting.show_progress, prompting.cache)
    return task_grid(tasks, lengths, scores, records)


def _cell(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def markdown_table(result: dict) -> str:
    """Task x length table of scores (percent; – where a length has no prompt of that task) with an average row."""
    lengths = result["lengths"]
    head = "| task | " + " | ".join(str(n) for n in lengths) + " |"
    rule = "|---|" + "---:|" * len(lengths)
    rows = [f"| {t} | " + " | ".join(map(_cell, result["scores"][t])) + " |" for t in result["tasks"]]
    rows.append("| **average** | " + " | ".join(map(_cell, result["average"])) + " |")
    return "\n".join([head, rule, *rows])

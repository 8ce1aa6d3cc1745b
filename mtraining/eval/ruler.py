"""RULER-style synthetic tasks generated locally from a seed, scored per task and length."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from ..data.tokenizer import Tokenizer
from .answers import Prompting, score_prompted, task_grid
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
    """``answers.task_grid``'s table: {"tasks", "lengths", "scores": {task: [percent per length]}, "counts",
    "average", the intervals and teacher-forced readings, "records"}; ``haystack`` names the filler."""
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
    scores, records = score_prompted(engine, tokenizer, runs, "ruler", prompting)
    return task_grid(tasks, lengths, scores, records) | {"haystack": haystack.name}


def _cell(value: float | None, interval: list[float] | None = None) -> str:
    if value is None:
        return "–"
    return f"{value:.1f}" if interval is None else f"{value:.1f} [{interval[0]:.1f}, {interval[1]:.1f}]"


def markdown_table(result: dict) -> str:
    """Task x length table of scores (percent, with the 95% interval over prompts where the result has them; –
    where a length has no prompt of that task) with an average row, then the teacher-forced table (percent of
    prompts whose every reference token is greedy) where the result has it."""
    lengths = result["lengths"]
    head = "| task | " + " | ".join(str(n) for n in lengths) + " |"
    rule = "|---|" + "---:|" * len(lengths)

    def rows(values: dict, intervals: dict | None) -> list[str]:
        out = []
        for t in result["tasks"]:
            bounds = intervals[t] if intervals else [None] * len(lengths)
            out.append(f"| {t} | " + " | ".join(_cell(v, iv) for v, iv in zip(values[t], bounds)) + " |")
        return out

    average = zip(result["average"], result.get("average_interval") or [None] * len(lengths))
    lines = [head, rule, *rows(result["scores"], result.get("intervals"))]
    lines.append("| **average** | " + " | ".join(_cell(v, iv) for v, iv in average) + " |")
    forced = result.get("forced")
    if forced and any(v is not None for t in result["tasks"] for v in forced[t]):
        lines += ["", "Teacher-forced (% of prompts whose every reference token is the greedy prediction):", ""]
        lines += [head, rule, *rows(forced, result.get("forced_intervals"))]
    return "\n".join(lines)

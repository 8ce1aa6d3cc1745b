"""RULER-style synthetic tasks generated locally from a seed, scored per task and length."""

from __future__ import annotations

from collections.abc import Sequence

from .answers import Prompting, score_cells
from .engine import Engine
from .loading import Tokenizer
from .tasks import TASKS, Sample, generate


def parse_tasks(text: str) -> list[str]:
    """'all' or a comma-separated subset of TASKS."""
    if text.strip() == "all":
        return list(TASKS)
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"unknown tasks {unknown}; use 'all' or some of {', '.join(TASKS)}")
    return tasks


def run_ruler(
    engine: Engine,
    tokenizer: Tokenizer,
    tasks: Sequence[str],
    lengths: Sequence[int],
    prompting: Prompting = Prompting(),
) -> dict:
    """{"tasks", "lengths", "scores": {task: [percent per length]}, "average": [...], "records"}."""
    haystack, max_new_tokens = prompting.haystack, prompting.max_new_tokens
    cells = [{"task": t, "length": n} for t in tasks for n in lengths]

    def prompt(cell: dict, s: int) -> Sample:
        return generate(cell["task"], cell["length"], s, tokenizer.count, haystack, max_new_tokens=max_new_tokens)

    scores, records = score_cells(engine, tokenizer, cells, prompt, prompting, "ruler")
    table = {t: [scores[(t, n)] for n in lengths] for t in tasks}
    average = [sum(table[t][i] for t in tasks) / len(tasks) for i in range(len(lengths))]
    return {"tasks": list(tasks), "lengths": list(lengths), "scores": table, "average": average, "records": records}


def markdown_table(result: dict) -> str:
    """Task x length table of scores (percent) with an average row."""
    lengths = result["lengths"]
    head = "| task | " + " | ".join(str(n) for n in lengths) + " |"
    rule = "|---|" + "---:|" * len(lengths)
    rows = [f"| {t} | " + " | ".join(f"{v:.1f}" for v in result["scores"][t]) + " |" for t in result["tasks"]]
    rows.append("| **average** | " + " | ".join(f"{v:.1f}" for v in result["average"]) + " |")
    return "\n".join([head, rule, *rows])

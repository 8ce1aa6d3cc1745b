"""RULER-style synthetic tasks generated locally from a seed, scored per task and length."""

from __future__ import annotations

from collections.abc import Sequence

from .documents import Haystack
from .engine import Engine
from .loading import Tokenizer
from .niah import answer
from .runtime import track
from .scoring import match_all, mean_percent
from .tasks import TASKS, generate


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
    samples: int = 1,
    seed: int = 0,
    haystack: Haystack | None = None,
    max_new_tokens: int | None = None,
    show_progress: bool = True,
) -> dict:
    """{"tasks", "lengths", "scores": {task: [percent per length]}, "average": [...], "records"}."""
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    haystack = haystack or Haystack(seed=seed)
    cells = [(t, n, s) for t in tasks for n in lengths for s in range(seed, seed + samples)]
    scores: dict[tuple[str, int], list[float]] = {}
    records = []
    for task, length, s in track(cells, len(cells), "ruler", show_progress):
        sample = generate(task, length, s, tokenizer.count, haystack, max_new_tokens=max_new_tokens)
        prediction = answer(engine, tokenizer, sample.prompt, sample.max_new_tokens)
        score = match_all(prediction, sample.answers)
        scores.setdefault((task, length), []).append(score)
        records.append({
            "task": task, "length": length, "seed": s, "prompt_tokens": sample.prompt_tokens,
            "answers": sample.answers, "prediction": prediction, "score": score,
        })
    table = {t: [mean_percent(scores[(t, n)]) for n in lengths] for t in tasks}
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

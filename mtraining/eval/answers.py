"""Greedy answers to prompts, scored per cell of an evaluation grid (NIAH, RULER-style, InfiniteBench).

Prompts come from the seeded generators (``score_cells``) or from official files on disk
(``score_samples`` with samples already made); either way each answer is scored by its sample's
metric and the records keep every prompt's prediction and expected answers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..data.tokenizer import Tokenizer
from .documents import Haystack
from .engine import Engine
from .runtime import track
from .scoring import mean_percent, score
from .tasks import Sample


def middle_cut(ids: list[int], keep: int) -> list[int]:
    """The first ``keep // 2`` and last ``keep - keep // 2`` ids (InfiniteBench's truncation: the
    instruction at the start and the question at the end survive, the middle of the context goes)."""
    if len(ids) <= keep:
        return ids
    head = keep // 2
    return ids[:head] + ids[len(ids) - (keep - head) :]


def answer(engine: Engine, tokenizer: Tokenizer, sample: Sample) -> str:
    """The model's greedy answer to ``sample`` (prefill through the configured attention); a prompt
    longer than its length allows is cut in the middle first (see ``middle_cut``)."""
    ids = middle_cut(tokenizer.encode(sample.prompt), sample.length - sample.max_new_tokens)
    return tokenizer.decode(engine.generate(ids, sample.max_new_tokens, tokenizer.stop_ids))


@dataclass(frozen=True)
class Prompting:
    """How each cell of a grid is prompted: ``samples`` prompts seeded ``seed ..``, from ``haystack``."""

    samples: int = 1
    seed: int = 0
    haystack: Haystack | None = None  # None: the built-in filler, seeded with ``seed``
    max_new_tokens: int | None = None  # None: the task's own
    show_progress: bool = True
    # Samples already built with these settings and the same tokenizer, filled as samples are built:
    # several models that share a tokenizer build each prompt once (keys: see ``score_samples``).
    cache: dict | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(f"samples must be at least 1, got {self.samples}")
        if self.haystack is None:
            object.__setattr__(self, "haystack", Haystack(seed=self.seed))


Run = tuple[dict, dict, Callable[[], Sample]]  # (cell, record fields, the sample, made when its turn comes)


def score_samples(
    engine: Engine,
    tokenizer: Tokenizer,
    runs: Sequence[Run],
    title: str,
    show_progress: bool = True,
    cache: dict | None = None,
) -> tuple[dict[tuple, list[float]], list[dict]]:
    """Answer and score each run's sample: the scores per cell (keyed by the tuple of the cell's
    values) and a record per prompt (the cell's fields, then the run's own, then the outcome).
    ``cache``: see ``Prompting.cache`` (keyed by title, the cell's and the run's values)."""
    scores: dict[tuple, list[float]] = {}
    records = []
    for cell, fields, make in track(runs, len(runs), title, show_progress):
        key = (title, *cell.values(), *fields.values())
        sample = cache.get(key) if cache is not None else None
        if sample is None:
            sample = make()
            if cache is not None:
                cache[key] = sample
        prediction = answer(engine, tokenizer, sample)
        value = score(sample.metric, prediction, sample.answers)
        scores.setdefault(tuple(cell.values()), []).append(value)
        records.append(
            {
                **cell,
                **fields,
                "prompt_tokens": min(sample.prompt_tokens, sample.length - sample.max_new_tokens),
                "answers": sample.answers,
                "prediction": prediction,
                "metric": sample.metric,
                "score": value,
            }
        )
    return scores, records


def score_cells(
    engine: Engine,
    tokenizer: Tokenizer,
    cells: Sequence[dict],
    prompt: Callable[[dict, int], Sample],
    prompting: Prompting,
    title: str,
) -> tuple[dict[tuple, float], list[dict]]:
    """Answer ``prompting.samples`` prompts per cell, built by ``prompt(cell, seed)``.

    Returns the mean percent per cell (keyed by the tuple of the cell's values) and a record per prompt
    (the cell's fields first).
    """
    seeds = range(prompting.seed, prompting.seed + prompting.samples)
    runs = [(cell, {"seed": s}, functools.partial(prompt, cell, s)) for cell in cells for s in seeds]
    scores, records = score_samples(engine, tokenizer, runs, title, prompting.show_progress, prompting.cache)
    return {key: mean_percent(values) for key, values in scores.items()}, records


def task_grid(
    tasks: Sequence[str], lengths: Sequence[int], scores: dict[tuple, list[float]], records: list[dict]
) -> dict:
    """{"tasks", "lengths", "scores": {task: [percent or None per length]}, "counts", "average", "records"}
    from per-(task, length) scores; a cell without prompts scores None, the average skips it."""
    table = {t: [mean_percent(scores[(t, n)]) if scores.get((t, n)) else None for n in lengths] for t in tasks}
    counts = {t: [len(scores.get((t, n), [])) for n in lengths] for t in tasks}
    average = []
    for i in range(len(lengths)):
        values = [table[t][i] for t in tasks if table[t][i] is not None]
        average.append(sum(values) / len(values) if values else None)
    return {
        "tasks": list(tasks),
        "lengths": list(lengths),
        "scores": table,
        "counts": counts,
        "average": average,
        "records": records,
    }

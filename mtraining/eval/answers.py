"""Greedy answers to generated prompts, scored per cell of an evaluation grid (NIAH and RULER-style)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .documents import Haystack
from .engine import Engine
from .loading import Tokenizer
from .runtime import track
from .scoring import match_all, mean_percent
from .tasks import Sample


def answer(engine: Engine, tokenizer: Tokenizer, prompt: str, max_new_tokens: int) -> str:
    """The model's greedy answer to ``prompt`` (prefill through the configured attention)."""
    ids = engine.generate(tokenizer.encode(prompt), max_new_tokens, tokenizer.stop_ids)
    return tokenizer.decode(ids)


@dataclass(frozen=True)
class Prompting:
    """How each cell of a grid is prompted: ``samples`` prompts seeded ``seed ..``, from ``haystack``."""

    samples: int = 1
    seed: int = 0
    haystack: Haystack | None = None  # None: the built-in filler, seeded with ``seed``
    max_new_tokens: int | None = None  # None: the task's own
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(f"samples must be at least 1, got {self.samples}")
        if self.haystack is None:
            object.__setattr__(self, "haystack", Haystack(seed=self.seed))


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
    runs = [(cell, s) for cell in cells for s in seeds]
    scores: dict[tuple, list[float]] = {}
    records = []
    for cell, s in track(runs, len(runs), title, prompting.show_progress):
        sample = prompt(cell, s)
        prediction = answer(engine, tokenizer, sample.prompt, sample.max_new_tokens)
        score = match_all(prediction, sample.answers)
        scores.setdefault(tuple(cell.values()), []).append(score)
        records.append(
            {
                **cell,
                "seed": s,
                "prompt_tokens": sample.prompt_tokens,
                "answers": sample.answers,
                "prediction": prediction,
                "score": score,
            }
        )
    return {key: mean_percent(values) for key, values in scores.items()}, records

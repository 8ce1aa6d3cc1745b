"""Needle in a haystack: one "secret number" at a grid of context lengths x depths, greedy answer.

Each cell holds ``samples`` prompts (seeds ``seed .. seed + samples - 1``) built by
``tasks.generate("niah_single", ...)`` from the haystack (local text or the built-in filler), with
the needle placed at ``depth`` percent of the haystack; the score of a cell is the percentage of
answers that contain the needle's number.
"""

from __future__ import annotations

from collections.abc import Sequence

from .documents import Haystack
from .engine import Engine
from .loading import Tokenizer
from .runtime import track
from .scoring import match_all, mean_percent
from .tasks import generate

TASK = "niah_single"


def answer(engine: Engine, tokenizer: Tokenizer, prompt: str, max_new_tokens: int) -> str:
    """The model's greedy answer to ``prompt`` (prefill through the configured attention)."""
    ids = engine.generate(tokenizer.encode(prompt), max_new_tokens, tokenizer.stop_ids)
    return tokenizer.decode(ids)


def run_niah(
    engine: Engine,
    tokenizer: Tokenizer,
    lengths: Sequence[int],
    depths: Sequence[float],
    samples: int = 1,
    seed: int = 0,
    haystack: Haystack | None = None,
    max_new_tokens: int | None = None,
    show_progress: bool = True,
) -> dict:
    """{"lengths", "depths", "scores": [depth][length] percent, "records": per prompt}."""
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    bad = [d for d in depths if not 0 <= d <= 100]
    if bad:
        raise ValueError(f"depths are percentages in [0, 100], got {bad}")
    haystack = haystack or Haystack(seed=seed)
    cells = [(n, d, s) for n in lengths for d in depths for s in range(seed, seed + samples)]
    scores: dict[tuple[int, float], list[float]] = {}
    records = []
    for length, depth, s in track(cells, len(cells), "needle in a haystack", show_progress):
        sample = generate(TASK, length, s, tokenizer.count, haystack, depth / 100, max_new_tokens)
        prediction = answer(engine, tokenizer, sample.prompt, sample.max_new_tokens)
        score = match_all(prediction, sample.answers)
        scores.setdefault((length, depth), []).append(score)
        records.append({
            "length": length, "depth": depth, "seed": s, "prompt_tokens": sample.prompt_tokens,
            "answers": sample.answers, "prediction": prediction, "score": score,
        })
    grid = [[mean_percent(scores[(n, d)]) for n in lengths] for d in depths]
    return {"lengths": list(lengths), "depths": list(depths), "scores": grid, "haystack": haystack.name, "records": records}

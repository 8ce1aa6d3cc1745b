"""Needle in a haystack: one "secret number" at a grid of context lengths x depths, greedy answer.

Each cell holds ``samples`` prompts (seeds ``seed .. seed + samples - 1``) built by
``tasks.generate("niah_single", ...)`` from the haystack (local text or the built-in filler), with
the needle placed at ``depth`` percent of the haystack; the score of a cell is the percentage of
answers that contain the needle's number.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..data.tokenizer import Tokenizer
from .answers import Prompting, score_cells
from .engine import Engine
from .tasks import Sample, generate

TASK = "niah_single"


def run_niah(
    engine: Engine,
    tokenizer: Tokenizer,
    lengths: Sequence[int],
    depths: Sequence[float],
    prompting: Prompting = Prompting(),
) -> dict:
    """{"lengths", "depths", "scores": [depth][length] percent, "records": per prompt}."""
    bad = [d for d in depths if not 0 <= d <= 100]
    if bad:
        raise ValueError(f"depths are percentages in [0, 100], got {bad}")
    haystack, max_new_tokens = prompting.haystack, prompting.max_new_tokens
    cells = [{"length": n, "depth": d} for n in lengths for d in depths]

    def prompt(cell: dict, s: int) -> Sample:
        return generate(TASK, cell["length"], s, tokenizer.count, haystack, cell["depth"] / 100, max_new_tokens)

    scores, records = score_cells(engine, tokenizer, cells, prompt, prompting, "needle in a haystack")
    grid = [[scores[(n, d)] for n in lengths] for d in depths]
    return {
        "lengths": list(lengths),
        "depths": list(depths),
        "scores": grid,
        "haystack": haystack.name,
        "records": records,
    }

"""Needle in a haystack: one "secret number" at a grid of context lengths x depths, greedy answer.

Each cell holds ``samples`` prompts (seeds ``seed .. seed + samples - 1``) built by
``tasks.generate("niah_single", ...)`` from the haystack (local text or the built-in filler), with
the needle placed at ``depth`` percent of the haystack; the score of a cell is the percentage of
answers that contain the needle's number. Beside it: the teacher-forced reading of the number (``forced``:
percent of prompts whose every number token is the greedy prediction), 95% intervals over the prompts of
each cell, and ``by_length``: the depths of a length pooled (the cell of ``samples x depths`` prompts that a
comparison between models reads). With ``Prompting.generated`` only the first prompts of each cell are answered by
generation and the rest read teacher-forced alone (a prefill each): the generated score counts the first, the
teacher-forced reading all.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..data.tokenizer import Tokenizer
from .answers import Prompting, score_cells, summarise
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
    """{"lengths", "depths", "scores": [depth][length] percent, "intervals", "forced", "forced_intervals",
    "forced_nll" (the same shape; ``answers.summarise``), "by_length" (per length, depths pooled: ``summarise``'s
    fields and the length), "haystack", "records": per prompt}."""
    bad = [d for d in depths if not 0 <= d <= 100]
    if bad:
        raise ValueError(f"depths are percentages in [0, 100], got {bad}")
    haystack, max_new_tokens = prompting.haystack, prompting.max_new_tokens
    cells = [{"length": n, "depth": d} for n in lengths for d in depths]

    def prompt(cell: dict, s: int) -> Sample:
        return generate(TASK, cell["length"], s, tokenizer.count, haystack, cell["depth"] / 100, max_new_tokens)

    scores, records = score_cells(engine, tokenizer, cells, prompt, prompting, "needle in a haystack")
    summary = {
        (n, d): summarise([r for r in records if r["length"] == n and r["depth"] == d]) for n in lengths for d in depths
    }

    def grid(field: str) -> list[list]:
        return [[summary[(n, d)][field] for n in lengths] for d in depths]

    return {
        "lengths": list(lengths),
        "depths": list(depths),
        "scores": [[scores[(n, d)] for n in lengths] for d in depths],
        "intervals": grid("interval"),
        "forced": grid("forced"),
        "forced_intervals": grid("forced_interval"),
        "forced_nll": grid("forced_nll"),
        "by_length": [{"length": n, **summarise([r for r in records if r["length"] == n])} for n in lengths],
        "haystack": haystack.name,
        "records": records,
    }

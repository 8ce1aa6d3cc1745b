"""Scoring of generated answers against a sample's expected answers (RULER-style string match)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

_WORD = re.compile(r"[A-Za-z0-9]+")


def _tokens(text: str) -> list[str]:
    return [t.lower() for t in _WORD.findall(text)]


def _contains(prediction_tokens: list[str], answer: str) -> bool:
    """Does the answer occur as a whole-word (sequence of word tokens) in the prediction?"""
    want = _tokens(answer)
    if not want:
        return False
    n = len(want)
    return any(prediction_tokens[i : i + n] == want for i in range(len(prediction_tokens) - n + 1))


def match_all(prediction: str, answers: Sequence[str]) -> float:
    """Fraction of ``answers`` found in ``prediction`` as whole words, case-insensitive (0..1).

    '1234567' is not found inside '12345678', so a model cannot score by emitting long digit runs.
    """
    if not answers:
        raise ValueError("a sample needs at least one expected answer to be scored")
    pred = _tokens(prediction)
    return sum(_contains(pred, a) for a in answers) / len(answers)


def match_any(prediction: str, answers: Sequence[str]) -> float:
    """1.0 if any of ``answers`` occurs in ``prediction`` as whole words, else 0.0."""
    if not answers:
        raise ValueError("a sample needs at least one expected answer to be scored")
    pred = _tokens(prediction)
    return float(any(_contains(pred, a) for a in answers))


def mean_percent(scores: Iterable[float]) -> float:
    """Mean of 0..1 scores as a percentage (NaN for no scores)."""
    values = list(scores)
    return 100.0 * sum(values) / len(values) if values else math.nan

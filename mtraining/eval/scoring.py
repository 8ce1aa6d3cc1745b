"""Scoring of generated answers against a sample's expected answers, by named metric.

``match_all`` (the suite's generated NIAH and RULER-style tasks) counts whole-word matches. The
official benchmarks' own rules are here too, so that their files score as their scripts score them:
RULER's ``substring_all`` / ``substring_any`` (its string_match_all / string_match_part), and
InfiniteBench's ``first_integer`` (passkey, number string), ``word`` (key-value retrieval) and
``first_number`` (Math.Find). ``score(metric, prediction, answers)`` dispatches by name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence

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


def _need(answers: Sequence[str]) -> None:
    if not answers:
        raise ValueError("a sample needs at least one expected answer to be scored")


def match_all(prediction: str, answers: Sequence[str]) -> float:
    """Fraction of ``answers`` found in ``prediction`` as whole words, case-insensitive (0..1).

    '1234567' is not found inside '12345678', so a model cannot score by emitting long digit runs.
    """
    _need(answers)
    pred = _tokens(prediction)
    return sum(_contains(pred, a) for a in answers) / len(answers)


def match_any(prediction: str, answers: Sequence[str]) -> float:
    """1.0 if any of ``answers`` occurs in ``prediction`` as whole words, else 0.0."""
    _need(answers)
    pred = _tokens(prediction)
    return float(any(_contains(pred, a) for a in answers))


def substring_all(prediction: str, answers: Sequence[str]) -> float:
    """RULER's string_match_all: fraction of ``answers`` that occur in ``prediction`` as substrings, ignoring case."""
    _need(answers)
    text = prediction.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


def substring_any(prediction: str, answers: Sequence[str]) -> float:
    """RULER's string_match_part (its QA tasks): 1.0 if any of ``answers`` is a substring, ignoring case."""
    _need(answers)
    text = prediction.lower()
    return float(any(a.lower() in text for a in answers))


_DIGITS = re.compile(r"[0-9]+")
_NUMBER = re.compile(r"\d+\.\d+|\d+")
_KV_SEPARATORS = str.maketrans({c: " " for c in "\n:\"'.,?!{}"})


def first_integer(prediction: str, answers: Sequence[str]) -> float:
    """InfiniteBench passkey / number string: the first run of digits in ``prediction`` equals an answer.

    '71432.' scores for 71432; '7143 2' and '871432' do not (the digits must come first, whole).
    """
    _need(answers)
    found = _DIGITS.search(prediction)
    return float(found is not None and found.group() in answers)


def word(prediction: str, answers: Sequence[str]) -> float:
    """InfiniteBench key-value retrieval: an answer is one of the prediction's words, after its
    newlines and the characters : " ' . , ? ! { } become spaces (hyphens stay: a UUID is one word)."""
    _need(answers)
    words = set(prediction.translate(_KV_SEPARATORS).split())
    return float(any(a in words for a in answers))


def first_number(prediction: str, answers: Sequence[str]) -> float:
    """InfiniteBench Math.Find: the first number in ``prediction`` (digits, optionally '.digits')
    equals an answer numerically ('50' scores for 50.0; signs are not read, as in the official scorer)."""
    _need(answers)
    found = _NUMBER.search(prediction)
    return float(found is not None and any(float(found.group()) == float(a) for a in answers))


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "match_all": match_all,
    "substring_all": substring_all,
    "substring_any": substring_any,
    "first_integer": first_integer,
    "word": word,
    "first_number": first_number,
}


def _unscorable(metric: str, answer: str) -> str | None:
    """Why no output can be scored fairly against ``answer`` under ``metric`` (None when one can)."""
    if metric in ("substring_all", "substring_any"):
        return None if answer.strip() else "it is found in every output, so any output scores 100%"
    if metric in ("match_all", "match_any"):
        return None if _tokens(answer) else "it has no letters or digits, so no output matches it"
    if metric == "first_integer":
        return (
            None if _DIGITS.fullmatch(answer) else "it is not a run of digits, so no output's first integer equals it"
        )
    if metric == "word":
        one_word = answer.translate(_KV_SEPARATORS).split() == [answer]
        return None if one_word else "it is not one word (spaces or : \" ' . , ? ! { } split it), so no output holds it"
    if metric == "first_number":
        try:
            value = float(answer)
        except ValueError:
            return "it is not a number"
        if not math.isfinite(value) or value < 0:
            return "no output's first number can equal it (numbers are read without a sign)"
    return None


def check_answers(metric: str, answers: Sequence[str]) -> None:
    """ValueError unless every answer can be matched by some output and not by every output under ``metric``
    (an empty RULER answer would score 100%, a passkey answer with letters 0%)."""
    _need(answers)
    for answer in answers:
        if why := _unscorable(metric, answer):
            raise ValueError(f"the answer {answer!r} cannot be scored with {metric}: {why}; fix or drop the record")


def score(metric: str, prediction: str, answers: Sequence[str]) -> float:
    """``prediction`` scored against ``answers`` by the metric named ``metric`` (0..1)."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; use one of {', '.join(METRICS)}")
    return METRICS[metric](prediction, answers)


def mean_percent(scores: Iterable[float]) -> float:
    """Mean of 0..1 scores as a percentage (NaN for no scores)."""
    values = list(scores)
    return 100.0 * sum(values) / len(values) if values else math.nan

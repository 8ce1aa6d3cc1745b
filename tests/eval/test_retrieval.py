"""Teacher-forced retrieval scoring (mtraining.eval.retrieval) and its Wilson intervals."""

from __future__ import annotations

import math

import pytest
import torch

from mtraining.eval.intervals import wilson_interval
from mtraining.eval.retrieval import run_retrieval


class Oracle:
    """An engine stand-in whose greedy prediction of token i + 1 is right except at ``wrong`` positions."""

    def __init__(self, wrong: set[int]) -> None:
        self.wrong = wrong

    def token_scores(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        predicted = ids[1:].clone()
        for p in self.wrong:
            predicted[p - 1] = -1  # the prediction of position p
        return torch.arange(1, len(ids), dtype=torch.float32), predicted


def test_wilson_interval_known_values():
    lo, hi = wilson_interval(45, 50)
    assert lo == pytest.approx(78.64, abs=0.01) and hi == pytest.approx(95.65, abs=0.01)
    for n in (10, 100, 500):  # exact at the ends (rounding put 100 of 100 at 99.99999999999999)
        assert wilson_interval(0, n)[0] == 0.0 and wilson_interval(n, n)[1] == 100.0
    assert all(math.isnan(x) for x in wilson_interval(0, 0))


def test_scores_per_cell_length_and_document():
    ids = list(range(20))
    docs = [(ids, [5, 10, 15], [0.0, 0.5, 0.9]), (ids[:12], [4, 8], [0.1, 0.6])]
    result = run_retrieval(Oracle(wrong={10}), docs, [0.0, 0.5, 1.0], first_bucket=4, show_progress=False)
    assert result["lengths"] == [12, 20] and result["depths"] == [0.0, 0.5, 1.0]
    # depth 0.5 at length 20 is the one wrong answer; 0.1 bins to 0.0, 0.6 to 0.5, 0.9 to 1.0
    (d0, d50, d100) = result["scores"]
    assert d0 == [100.0, 100.0] and d50 == [100.0, 0.0] and math.isnan(d100[0]) and d100[1] == 100.0
    assert result["intervals"][1][1] == pytest.approx(wilson_interval(0, 1))
    assert [(d["length"], d["hits"], d["answers"]) for d in result["documents"]] == [(20, 2, 3), (12, 2, 2)]
    assert [r["percent"] for r in result["by_length"]] == [100.0, pytest.approx(200 / 3)]
    # per-bucket losses of the oracle's nll (1, 2, ...): buckets [1, 4], [5, 8], [9, 16], [17, 19] at length 20
    first = result["documents"][0]
    assert first["buckets"] == [[1, 4], [5, 8], [9, 16], [17, 19]]
    assert first["nll"] == [10.0, 26.0, sum(range(9, 17)), 17.0 + 18 + 19]


def test_rejects_answers_outside_the_document():
    with pytest.raises(ValueError, match="answer positions"):
        run_retrieval(Oracle(set()), [([1, 2, 3], [3], [0.0])], [0.0], show_progress=False)
    with pytest.raises(ValueError, match="one depth per answer"):
        run_retrieval(Oracle(set()), [([1, 2, 3], [1, 2], [0.0])], [0.0], show_progress=False)

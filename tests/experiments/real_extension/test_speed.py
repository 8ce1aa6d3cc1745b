"""The speed stage's figures over several documents: times summed, densities averaged, each document kept."""

from __future__ import annotations

import pytest

from experiments.real_extension.speed import combine


def timed(dense: float, sparse: float, density: float) -> dict:
    """``time_arms``'s result for one layer (3) and one arm at 1024 tokens."""
    row = {"ms": sparse, "estimate_ms": 1.0, "density": density}
    return {
        "length": 1024,
        "dense_ms": dense,
        "arms": {"v": {"attention_speedup": dense / sparse, "sparse_ms": sparse, "density": density}},
        "layers": {"3": {"dense_ms": dense, "arms": {"v": row}}},
    }


def test_documents_add_their_times_and_average_their_densities():
    both = combine([timed(100.0, 20.0, 0.1), timed(100.0, 40.0, 0.3)])
    assert both["arms"]["v"]["attention_speedup"] == pytest.approx(200.0 / 60.0)  # not the mean of 5x and 2.5x
    assert both["arms"]["v"]["density"] == pytest.approx(0.2) and both["dense_ms"] == 200.0
    assert both["layers"]["3"]["arms"]["v"] == {"ms": 60.0, "estimate_ms": 2.0, "density": pytest.approx(0.2)}
    assert [d["arms"]["v"]["attention_speedup"] for d in both["documents"]] == [5.0, 2.5]

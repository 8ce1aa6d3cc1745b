"""bench/ring_prediction.py: the cost model's predictions against the ring times measured on 4 x H200."""

from __future__ import annotations

import pytest

from bench.ring_prediction import annotate
from tests.bench.ring_records import issue_records


@pytest.mark.parametrize("fwd_share", [0.25, 0.3, 0.35])
def test_model_predicts_the_measured_4xh200_times_within_20_percent(fwd_share):
    """From the flat ring's NVLink time alone (the per-step compute), the model predicts the hierarchical ring
    and both rings over emulated 25 and 5 GB/s links. The issue gives fwd+bwd only: the forward's share is
    assumed (2 x H200 records: 0.26-0.32), and the verdict does not depend on it."""
    records = annotate(issue_records(fwd_share))
    ratios = [r["predicted_over_measured"] for r in records]
    assert all(0.8 <= x <= 1.2 for x in ratios), ratios
    five = {r["schedule"]: r["predicted_ms"] for r in records if r["seq_len"] == 131072 and r.get("outer_gbps") == 5}
    assert five["flat"] / five["hierarchical"] > 1.5  # the slow link: the hierarchy pays, as measured (1.97x)

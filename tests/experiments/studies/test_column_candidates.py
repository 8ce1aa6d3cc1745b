"""experiments/studies/column_candidates.py: the sorted column scorer's windows and its agreement with the dense scorer."""

from __future__ import annotations

import torch

from experiments.studies import column_candidates as script
from mtraining.ops import PatternConfig


def test_windows_and_agreement_on_random_inputs():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 256, 4, 16, generator=gen), torch.randn(1, 256, 2, 16, generator=gen)
    stats = script.window_stats(q, k, layer=1, block_size=16, tables=4, bits=3, caps=[2, 1000])
    assert len(stats) == 4
    for s in stats:
        assert 0.5 < s["skew"] < 2  # random keys fill the buckets about evenly
        assert s["over_cap"]["2"] > 0.5 and s["over_cap"]["1000"] == 0
        assert s["window_max"] <= 240 and 0 < s["largest_bucket_share"] <= 1
    config = PatternConfig(
        v_size=16, s_size=32, last_q=16, block_size=16, local_window=16, column_tables=4, column_bits=3
    )
    kept = script.agreement(q, k, 1, 4, config, caps=[2])
    assert [h["kept_cap_none"] for h in kept] == [1.0] * 4  # uncapped: the dense scorer's columns
    assert min(h["kept_cap_2"] for h in kept) < 1  # a binding cap drops some

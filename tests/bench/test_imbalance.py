"""bench/imbalance.py: exact work per rank and ring step of a pattern under a layout, and the balance of
the striped layout."""

from __future__ import annotations

import pytest
import torch

from bench.imbalance import imbalance_report
from bench.synthetic import rope_structured_qkv
from mtraining.ops import PatternConfig, VerticalSlashPattern, estimate_pattern
from mtraining.parallel import make_layout
from tests.factories import make_documents, make_pattern

NAMES = ["contiguous", "zigzag", "striped"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("w,g_layout,g", [(2, 16, 16), (3, 32, 16), (4, 16, 16)])
def test_imbalance_counts_are_exact(name, w, g_layout, g):
    n = 2 * w * g_layout * 2
    pattern = make_pattern("random", 2, 3, n, g, w * g_layout)
    layout = make_layout(name, n, w, g_layout)
    report = imbalance_report(pattern, layout)
    brute = torch.tensor(
        [
            [float(pattern.pair_mask(layout.positions(r), layout.positions((r - t) % w)).sum()) for t in range(w)]
            for r in range(w)
        ],
        dtype=torch.float64,
    )
    assert torch.equal(report.pairs, brute)
    assert float(report.pairs.sum()) == float(pattern.kept_pairs().sum())
    text = report.format()
    assert f"layout {name}, {w} ranks" in text and "lock-step imbalance" in text


def _balance(pattern: VerticalSlashPattern, name: str, w: int) -> tuple[float, float]:
    report = imbalance_report(pattern, make_layout(name, pattern.seq_len, w, pattern.block_size))
    return report.rank_imbalance, report.lockstep_imbalance


def test_striped_balances_estimated_pattern():
    """A pattern estimated on RoPE-structured inputs (local band + anchors): striped is even, contiguous is not.

    The budget is vertical-heavy: later rows see every vertical before them, which is what loads the
    last contiguous shard (the local band alone costs about the same on every rank).
    """
    n, g, w = 4096, 32, 4
    q, k, _ = rope_structured_qkv(1, n, 4, 2, 32, dtype=torch.float32, seed=0, num_anchors=16)
    config = PatternConfig(v_size=1024, s_size=64, last_q=64, block_size=g, sink_tokens=4, local_window=32)
    pattern = estimate_pattern(q, k, config)
    assert float(pattern.density().max()) < 0.5
    striped, contiguous = _balance(pattern, "striped", w), _balance(pattern, "contiguous", w)
    assert striped[0] < 1.05 and striped[1] < 1.1, striped
    assert contiguous[0] > 1.4 and contiguous[1] > 1.4, contiguous


def test_striped_balances_local_pattern_with_sinks_and_verticals():
    n, g, w = 8192, 64, 8
    diag = torch.zeros(1, 2, n // g, dtype=torch.bool)
    diag[..., :2] = True  # local window
    vert = torch.zeros(1, 2, n, dtype=torch.bool)
    vert[..., :4] = True  # sinks
    vert[..., 100::61] = True  # salient tokens all along the sequence
    pattern = VerticalSlashPattern.from_masks(diag, vert, g)
    striped, contiguous = _balance(pattern, "striped", w), _balance(pattern, "contiguous", w)
    assert striped[0] < 1.05 and contiguous[0] > 1.3, (striped, contiguous)
    assert striped[1] < contiguous[1] - 0.3, (striped, contiguous)


def test_imbalance_errors():
    pattern = make_pattern("random", 1, 1, 128, 16, 0)
    with pytest.raises(ValueError, match="pattern is for seq_len 128 but the layout for 256"):
        imbalance_report(pattern, make_layout("striped", 256, 2, 16))
    with pytest.raises(ValueError, match="build the layout with block_size=16"):
        imbalance_report(pattern, make_layout("striped", 128, 2, 8))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("docs_kind", ["mixed", "short", "quarters"])
def test_imbalance_counts_masked_work_exactly(name, docs_kind):
    """With packed documents the report counts exactly the pairs of the oracle's mask per rank and step."""
    w, g = 4, 16
    n = 2 * w * g * 2
    gen = torch.Generator().manual_seed(len(docs_kind))
    pattern = make_pattern("random", 2, 3, n, g, gen)
    docs = make_documents(docs_kind, n, g, gen, batch=2)
    layout = make_layout(name, n, w, g)

    def brute(r: int, t: int) -> float:
        q_pos, k_pos = layout.positions(r), layout.positions((r - t) % w)
        same = docs.doc_ids(q_pos)[:, :, None] == docs.doc_ids(k_pos)[:, None, :]
        return float((pattern.pair_mask(q_pos, k_pos) & same[:, None]).sum())

    report = imbalance_report(pattern, layout, docs)
    assert torch.equal(report.pairs, torch.tensor([[brute(r, t) for t in range(w)] for r in range(w)]).double())
    assert float(report.pairs.sum()) == float(pattern.kept_pairs(docs).sum())
    assert not torch.equal(report.pairs, imbalance_report(pattern, layout).pairs)

"""Synthetic inputs: shapes, subset-independence of rows, statistics, and that structure is captured."""

from __future__ import annotations

import math

import pytest
import torch

from bench.synthetic import anchor_positions, random_qkv, rope_structured_qkv
from mtraining.ops.estimate.estimator import PatternConfig, estimate_pattern
from mtraining.ops.oracle import attention_oracle

GENERATORS = [rope_structured_qkv, random_qkv]


@pytest.mark.parametrize("gen", GENERATORS)
def test_shapes_dtypes_and_determinism(gen):
    q, k, v = gen(2, 50, 4, 2, 16)
    assert q.shape == (2, 50, 4, 16) and k.shape == v.shape == (2, 50, 2, 16)
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16
    again = gen(2, 50, 4, 2, 16)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), again))
    other = gen(2, 50, 4, 2, 16, seed=1)
    assert not torch.equal(q, other[0]) and not torch.equal(v, other[2])
    assert not torch.equal(q[0], q[1]), "batch elements must differ"
    q32 = gen(1, 8, 2, 1, 32, dtype=torch.float64)[0]
    assert q32.dtype == torch.float64 and torch.isfinite(q32).all()


@pytest.mark.parametrize("gen", GENERATORS)
def test_rows_do_not_depend_on_the_requested_subset(gen):
    """A context-parallel rank generating its shard gets exactly the rows of the full sequence."""
    full = gen(2, 300, 4, 2, 32, dtype=torch.float32)
    subsets = [
        torch.arange(1, 300, 3),  # striped-like
        torch.cat([torch.arange(0, 40), torch.arange(260, 300)]),  # zigzag-like
        torch.tensor([299, 7, 0, 150], dtype=torch.int32),  # any order, int32
        torch.arange(0),
    ]
    for pos in subsets:
        part = gen(2, 300, 4, 2, 32, dtype=torch.float32, positions=pos)
        for whole, piece in zip(full, part):
            assert piece.shape[1] == pos.numel()
            assert torch.equal(whole[:, pos.long()], piece)


def test_random_is_standard_normal():
    q, k, v = random_qkv(2, 512, 4, 2, 64, dtype=torch.float32)
    for t in (q, k, v):
        assert abs(float(t.mean())) < 0.02 and abs(float(t.std()) - 1) < 0.02
        assert abs(float((t[..., :32] * t[..., 32:]).mean())) < 0.02  # Box-Muller pairs are independent
    assert float(torch.corrcoef(torch.stack([q.flatten()[:4096], k.flatten()[:4096]]))[0, 1]) < 0.05


def test_structured_anchor_and_local_logits():
    """Without noise: logit local_logit on the diagonal; anchors add anchor_logit to their columns only."""
    seq, d = 512, 64
    logits = []
    for anchor_logit in (7.0, 0.0):
        q, k, _ = rope_structured_qkv(
            1, seq, 2, 2, d, noise=0.0, local_logit=12.0, anchor_logit=anchor_logit, dtype=torch.float64
        )
        logits.append(torch.einsum("bihd,bjhd->bhij", q, k)[0] / math.sqrt(d))
    anchors = anchor_positions(seq, 4)
    assert anchors[0] == 0 and anchors.numel() == 4 and anchors.unique().numel() == 4
    plain = torch.ones(seq, dtype=torch.bool)
    plain[anchors] = False
    diag = logits[1].diagonal(dim1=-2, dim2=-1)
    torch.testing.assert_close(diag, torch.full_like(diag, 12.0), rtol=0, atol=1e-4)
    lift = logits[0] - logits[1]  # u and w live on disjoint RoPE pairs, so only anchor columns move
    torch.testing.assert_close(lift[..., plain], torch.zeros_like(lift[..., plain]), rtol=0, atol=1e-4)
    causal = torch.arange(seq)[:, None] >= anchors[None, :]
    assert (lift[..., anchors][:, causal] - 7.0).abs().max() < 0.01  # low-frequency pairs barely rotate


def _recall(q: torch.Tensor, k: torch.Tensor, pattern) -> float:
    """Mean over heads of (true attention probability on kept pairs) / (all of it), rows in the second half."""
    seq = q.shape[1]
    pos = torch.arange(seq)
    group = q.shape[2] // k.shape[2]
    qh = q.double().transpose(1, 2)
    kh = k.double().transpose(1, 2).repeat_interleave(group, dim=1)
    scores = (qh @ kh.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    _, lse = attention_oracle(q.double(), k.double(), k.double())
    probs = torch.exp(scores.masked_fill(pos[None, :] > pos[:, None], -math.inf) - lse[..., None])
    kept = pattern.pair_mask(pos, pos)
    rows = slice(seq // 2, seq)
    return float(((probs * kept)[:, :, rows].sum((-1, -2)) / probs[:, :, rows].sum((-1, -2))).mean())


def test_structured_inputs_give_a_sparse_pattern_with_high_recall():
    seq = 1024
    # v_size leaves room beyond the keys of the last 64 rows (they score high as verticals too)
    config = PatternConfig(v_size=80, s_size=32, last_q=64, block_size=16, sink_tokens=1, local_window=16)
    q, k, _ = rope_structured_qkv(1, seq, 4, 2, 64, dtype=torch.float32)
    structured = estimate_pattern(q, k, config)
    structured_recall, structured_density = _recall(q, k, structured), float(structured.density().mean())
    assert structured_density < 0.25 and structured_recall > 0.93, (structured_density, structured_recall)
    assert structured.vertical_mask()[..., anchor_positions(seq, 4)].all(), "every anchor must be a vertical"

    q, k, _ = random_qkv(1, seq, 4, 2, 64, dtype=torch.float32)
    plain = estimate_pattern(q, k, config)
    plain_recall, plain_density = _recall(q, k, plain), float(plain.density().mean())
    # unstructured: recall is about the fraction of pairs kept, far below the structured recall
    assert plain_recall < plain_density + 0.05 and plain_recall < structured_recall - 0.3, (plain_recall, plain_density)
    assert structured_recall / structured_density > 3 * plain_recall / plain_density


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"batch": 0}, "batch must be an int >= 1"),
        ({"seq_len": 2.0}, "seq_len must be an int >= 1"),
        ({"heads_q": 3}, r"heads_q \(3\) must be a multiple of heads_kv \(2\)"),
        ({"head_dim": 15}, "head_dim must be even"),
        ({"seed": -1}, r"seed must be an int in \[0, 2\*\*32\)"),
        ({"positions": torch.tensor([0.5])}, "positions must be a 1-D int32/int64 tensor"),
        ({"positions": torch.tensor([[1]])}, "positions must be a 1-D int32/int64 tensor"),
        ({"positions": torch.tensor([3, 40])}, r"positions must lie in \[0, seq_len=40\)"),
        ({"positions": torch.tensor([-1])}, r"positions must lie in \[0, seq_len=40\)"),
    ],
)
@pytest.mark.parametrize("gen", GENERATORS)
def test_argument_errors(gen, kwargs, match):
    args = {"batch": 1, "seq_len": 40, "heads_q": 4, "heads_kv": 2, "head_dim": 16} | kwargs
    with pytest.raises(ValueError, match=match):
        gen(**args)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_anchors": 41}, r"num_anchors must be an int in \[0, seq_len=40\]"),
        ({"num_anchors": -1}, "num_anchors must be an int"),
        ({"rope_base": 1.0}, "rope_base must be > 1"),
        ({"rope_base": float("inf")}, "rope_base must be a finite number"),
        ({"noise": -0.1}, "noise must be a finite number >= 0"),
        ({"local_logit": float("nan")}, "local_logit must be a finite number"),
        ({"anchor_logit": "8"}, "anchor_logit must be a finite number"),
    ],
)
def test_structure_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rope_structured_qkv(1, 40, 4, 2, 16, **kwargs)


def test_no_anchors():
    q, k, _ = rope_structured_qkv(1, 64, 2, 1, 16, num_anchors=0, dtype=torch.float32)
    assert anchor_positions(64, 0).numel() == 0 and anchor_positions(64, 1).tolist() == [0]
    assert torch.isfinite(q).all() and torch.isfinite(k).all()

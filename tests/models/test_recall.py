"""pattern_recall against a float64 oracle: the full causal softmax of the last rows, summed where the
pattern keeps the pair. GQA, small key chunks (rows that see no key of a chunk, chunks partly causal),
patterns keeping nothing on some ranks or on all, one device and context parallel on gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mtraining.models import recall
from mtraining.ops.pattern import VerticalSlashPattern
from mtraining.parallel import make_layout

G, SCALE, LAST_Q = 16, 0.3, 24
SEQ = {1: 256, 2: 256, 3: 192, 4: 256}  # multiples of 2 * W * G (zigzag)
PATTERNS = ["lines", "sinks", "dense", "none"]


def _inputs(seed: int, n: int, hq: int = 6, hkv: int = 2, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = 3 * torch.randn(2, n, hq, 16, generator=gen, dtype=torch.float64)  # peaked rows: recall far from density
    k = torch.randn(2, n, hkv, 16, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype)


def _pattern(kind: str, n: int, heads: int, seed: int = 0) -> VerticalSlashPattern:
    """lines: random verticals and slashes; sinks: verticals 0..3 only (most ranks keep no key);
    dense: every causal pair; none: no pair."""
    if kind == "lines":
        gen = torch.Generator().manual_seed(seed)
        verticals = torch.stack([torch.randperm(n, generator=gen)[:12] for _ in range(2 * heads)]).view(2, heads, 12)
        slashes = torch.randint(0, n, (2, heads, 3), generator=gen)
        return VerticalSlashPattern.from_lines(verticals, slashes, n, G)
    diags = torch.full((2, heads, -(-n // G)), kind == "dense")
    verticals = torch.zeros(2, heads, n, dtype=torch.bool)
    verticals[..., :4] = kind == "sinks"
    return VerticalSlashPattern.from_masks(diags, verticals, G)


def _oracle(q: torch.Tensor, k: torch.Tensor, pattern: VerticalSlashPattern, last_q: int) -> float:
    """Mean over rows, heads and batch of the exact probability (float64, all causal keys) on kept pairs."""
    n, group = q.shape[1], q.shape[2] // k.shape[2]
    q_pos, k_pos = torch.arange(n - last_q, n), torch.arange(n)
    qh = q.double().transpose(1, 2)[:, :, n - last_q :]
    kh = k.double().transpose(1, 2).repeat_interleave(group, dim=1)
    scores = (qh @ kh.transpose(-1, -2) * SCALE).masked_fill(k_pos > q_pos[:, None], float("-inf"))
    kept = torch.softmax(scores, dim=-1) * pattern.pair_mask(q_pos, k_pos)
    return float(kept.sum(-1).mean())


def _recall(q, k, pattern, last_q, chunk_keys, group=None, layout=None) -> float:
    """pattern_recall with key chunks of ``chunk_keys`` keys (restored after)."""
    saved = recall._CHUNK_ELEMENTS
    recall._CHUNK_ELEMENTS = q.shape[0] * q.shape[2] * min(last_q, pattern.seq_len) * chunk_keys
    try:
        return recall.pattern_recall(q, k, pattern, last_q, SCALE, group, layout)
    finally:
        recall._CHUNK_ELEMENTS = saved


# chunks of 9 keys: off the block grid, one ending at key n - LAST_Q + 1 (the first key some row must not see)
@pytest.mark.parametrize("kind", PATTERNS)
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-5)])
@pytest.mark.parametrize("chunk_keys", [9, 1 << 20])
def test_single_device_matches_oracle(kind, dtype, tol, chunk_keys):
    n = SEQ[1]
    q, k = _inputs(1, n, dtype=dtype)
    pattern = _pattern(kind, n, q.shape[2])
    got, want = _recall(q, k, pattern, LAST_Q, chunk_keys), _oracle(q, k, pattern, LAST_Q)
    assert abs(got - want) < tol, (got, want)
    assert {"dense": abs(want - 1) < 1e-12, "none": want == 0}.get(kind, 0.01 < want < 0.99), want  # cases differ


def test_every_row_and_a_head_group_of_four():
    """last_q beyond the sequence: every row, down to row 0 (one key); 8 query heads on 2 kv heads."""
    n = 64
    q, k = _inputs(2, n, hq=8, hkv=2)
    pattern = _pattern("lines", n, 8, seed=3)
    assert abs(_recall(q, k, pattern, 2 * n, 5) - _oracle(q, k, pattern, n)) < 1e-12


def _recall_on_ranks(group, layout_name, q, k, pattern, chunk_keys) -> float:
    """Worker: pattern_recall on this rank's shards of q and k."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = make_layout(layout_name, q.shape[1], world, G)
    return _recall(layout.shard(q, rank), layout.shard(k, rank), pattern, LAST_Q, chunk_keys, group, layout)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("layout_name", ["contiguous", "zigzag", "striped"])
def test_context_parallel_matches_oracle(pool, world, layout_name):
    n = SEQ[world]
    q, k = _inputs(world, n)
    for kind in PATTERNS:
        pattern = _pattern(kind, n, q.shape[2], seed=world)
        want = _oracle(q, k, pattern, LAST_Q)
        for chunk_keys in (5, 1 << 20):
            got = pool.run(_recall_on_ranks, world, layout_name, q, k, pattern, chunk_keys)
            assert all(abs(r - want) < 1e-12 for r in got), (kind, chunk_keys, got, want)


def _document_oracle(q, k, pattern, last_q, docs) -> float:
    """Mean over every document's last ``last_q`` rows (all of a shorter one) and heads of the exact probability
    (float64, over the row's own document's causal keys) on kept pairs, by brute force."""
    n, group = q.shape[1], q.shape[2] // k.shape[2]
    k_pos = torch.arange(n)
    kept = []
    for b in range(q.shape[0]):
        row = min(b, docs.batch - 1)
        for start, length in zip(docs.starts[row].tolist(), docs.lengths(row).tolist()):
            for i in range(start + length - min(last_q, length), start + length):
                keys = k[b].double().repeat_interleave(group, dim=1)  # [N, Hq, D]
                s = torch.einsum("hd,nhd->hn", q[b, i].double(), keys) * SCALE
                s = s.masked_fill((k_pos > i) | (k_pos < start), float("-inf"))  # [Hq, N]
                mask = pattern.pair_mask(torch.tensor([i]), k_pos)[b, :, 0]
                kept.append((torch.softmax(s, -1) * mask).sum(-1))
    return float(torch.cat(kept).mean())


def _recall_with_documents(group, layout_name, q, k, pattern, docs) -> float:
    """Worker (or, with group None, one device): pattern_recall with documents on this rank's shards."""
    if group is None:
        return recall.pattern_recall(q, k, pattern, LAST_Q, SCALE, documents=docs)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = make_layout(layout_name, q.shape[1], world, G)
    q, k = layout.shard(q, rank), layout.shard(k, rank)
    return recall.pattern_recall(q, k, pattern, LAST_Q, SCALE, group, layout, documents=docs)


@pytest.mark.parametrize("layout_name", [None, "contiguous", "striped"])
def test_documents_rows_see_their_own_document(pool, layout_name):
    """With packed documents the rows are every document's last LAST_Q, each over its own document's keys
    (per-row boundaries for the batch of two); without them the figure differs."""
    from mtraining.ops import Documents

    n = SEQ[4]
    q, k = _inputs(5, n)
    pattern = _pattern("lines", n, q.shape[2], seed=5)
    docs = Documents.from_lengths([[10, 100, 7, n - 117], [60, n - 60]])
    want = _document_oracle(q, k, pattern, LAST_Q, docs)
    if layout_name is None:
        got = [_recall_with_documents(None, None, q, k, pattern, docs)]
    else:
        got = pool.run(_recall_with_documents, 4, layout_name, q, k, pattern, docs)
    assert all(abs(r - want) < 1e-12 for r in got), (got, want)
    assert abs(want - _oracle(q, k, pattern, LAST_Q)) > 1e-3

"""pattern_recall against a float64 oracle: the full causal softmax of the same randomly drawn rows
(``recall_rows``), summed where the pattern keeps the pair. GQA, small key chunks (rows that see no key of
a chunk, chunks partly causal), patterns keeping nothing on some ranks or on all, packed documents, one
device and context parallel on gloo ranks; the draw (seeded, uniform, ascending, the global RNG left
alone) and a pattern fitted to the estimation's rows that the drawn rows find out."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mtraining.models import recall
from mtraining.ops import Documents
from mtraining.ops.pattern import VerticalSlashPattern
from mtraining.parallel import make_layout

G, SCALE, LAST_Q, SEED = 16, 0.3, 24, 7
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


def _oracle(q, k, pattern: VerticalSlashPattern, rows: torch.Tensor, docs: Documents | None = None) -> float:
    """Mean over the query rows at positions ``rows``, heads and batch of the exact probability (float64,
    over the row's causal keys; with ``docs`` only those of its own document) on kept pairs."""
    n, group = q.shape[1], q.shape[2] // k.shape[2]
    k_pos = torch.arange(n)
    qh = q.double().transpose(1, 2)[:, :, rows]
    kh = k.double().transpose(1, 2).repeat_interleave(group, dim=1)
    hidden = (k_pos > rows[:, None]).expand(q.shape[0], 1, -1, -1)  # [B, 1, R, N]
    if docs is not None:  # each row's document start, by brute force
        starts = [docs.starts[min(b, docs.batch - 1)].tolist() for b in range(q.shape[0])]
        first = torch.tensor([[max(s for s in row if s <= i) for i in rows.tolist()] for row in starts])
        hidden = hidden | (k_pos < first[:, None, :, None])
    scores = (qh @ kh.transpose(-1, -2) * SCALE).masked_fill(hidden, float("-inf"))
    kept = torch.softmax(scores, dim=-1) * pattern.pair_mask(rows, k_pos)
    return float(kept.sum(-1).mean())


def _recall(q, k, pattern, chunk_keys, group=None, layout=None, docs=None, last_q=LAST_Q, seed=SEED) -> float:
    """pattern_recall with key chunks of ``chunk_keys`` keys (restored after)."""
    saved = recall._CHUNK_ELEMENTS
    recall._CHUNK_ELEMENTS = q.shape[0] * q.shape[2] * min(last_q, pattern.seq_len) * chunk_keys
    try:
        return recall.pattern_recall(q, k, pattern, last_q, SCALE, group, layout, docs, seed=seed)
    finally:
        recall._CHUNK_ELEMENTS = saved


def test_rows_are_a_seeded_uniform_draw_that_leaves_the_global_rng_alone():
    """recall_rows: ascending distinct positions, the same for the same seed, others for another seed, each
    position about equally often over many seeds (the last rows no more than the first); every row when the
    sequence is shorter than last_q. pattern_recall gives one value per seed and does not touch torch's RNG."""
    n = SEQ[1]
    rows = recall.recall_rows(n, LAST_Q, SEED)
    assert rows.dtype == torch.int64 and rows.numel() == LAST_Q and bool((rows[1:] > rows[:-1]).all())
    assert 0 <= int(rows[0]) and int(rows[-1]) < n
    assert torch.equal(rows, recall.recall_rows(n, LAST_Q, SEED))
    assert not torch.equal(rows, recall.recall_rows(n, LAST_Q, SEED + 1))
    assert torch.equal(recall.recall_rows(40, 64, SEED), torch.arange(40))
    draws = 4000
    counts = torch.bincount(torch.cat([recall.recall_rows(64, 16, s) for s in range(draws)]), minlength=64)
    expected = draws * 16 / 64  # 1000; binomial standard deviation about 27
    assert int((counts - expected).abs().max()) < 130, counts

    q, k = _inputs(1, n)
    pattern = _pattern("lines", n, q.shape[2])
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = recall.pattern_recall(q, k, pattern, LAST_Q, SCALE, seed=SEED)
    assert torch.equal(torch.get_rng_state(), state)
    assert first == recall.pattern_recall(q, k, pattern, LAST_Q, SCALE, seed=SEED)
    assert first != recall.pattern_recall(q, k, pattern, LAST_Q, SCALE, seed=SEED + 1)


# chunks of 9 keys: off the block grid, most partly causal for some drawn row
@pytest.mark.parametrize("kind", PATTERNS)
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-5)])
@pytest.mark.parametrize("chunk_keys", [9, 1 << 20])
def test_single_device_matches_oracle(kind, dtype, tol, chunk_keys):
    n = SEQ[1]
    q, k = _inputs(1, n, dtype=dtype)
    pattern = _pattern(kind, n, q.shape[2])
    rows = recall.recall_rows(n, LAST_Q, SEED)
    assert int(rows[0]) < n - LAST_Q  # drawn from the whole sequence, not the last rows
    got, want = _recall(q, k, pattern, chunk_keys), _oracle(q, k, pattern, rows)
    assert abs(got - want) < tol, (got, want)
    assert {"dense": abs(want - 1) < 1e-12, "none": want == 0}.get(kind, 0.01 < want < 0.99), want  # cases differ


def test_every_row_and_a_head_group_of_four():
    """last_q beyond the sequence: every row, down to row 0 (one key); 8 query heads on 2 kv heads."""
    n = 64
    q, k = _inputs(2, n, hq=8, hkv=2)
    pattern = _pattern("lines", n, 8, seed=3)
    assert abs(_recall(q, k, pattern, 5, last_q=2 * n) - _oracle(q, k, pattern, torch.arange(n))) < 1e-12


def test_a_pattern_fitted_to_the_estimation_rows_is_found_out():
    """The estimation scores its lines from the last LAST_Q rows. Here those rows attend to keys 100..115 and
    every other row to keys 40..55; the pattern keeps exactly the last rows' top 16 keys. On the last rows it
    keeps nearly all the attention, on the drawn rows (held out but by chance) little of it."""
    n, d = SEQ[1], 16
    gen = torch.Generator().manual_seed(11)
    q = 0.3 * torch.randn(1, n, 2, d, generator=gen, dtype=torch.float64)
    k = 0.3 * torch.randn(1, n, 1, d, generator=gen, dtype=torch.float64)
    q[:, n - LAST_Q :, :, 0] += 6  # the estimation's rows look along e0 ...
    q[:, : n - LAST_Q, :, 1] += 6  # ... every other row along e1
    k[:, 100:116, :, 0] += 6
    k[:, 40:56, :, 1] += 6
    last = torch.arange(n - LAST_Q, n)
    probs = torch.softmax(  # [1, 2, LAST_Q, n]: the last rows' exact attention
        (q[:, last].transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2) * SCALE).masked_fill(
            torch.arange(n) > last[:, None], float("-inf")
        ),
        dim=-1,
    )
    top = probs.sum(2).topk(16, dim=-1).indices  # [1, 2, 16]
    pattern = VerticalSlashPattern.from_lines(top, torch.full((1, 2, 1), -1), n, G)
    assert abs(_oracle(q, k, pattern, last) - 1) < 1e-3  # in-sample: nearly everything kept
    got = _recall(q, k, pattern, 1 << 20)
    assert abs(got - _oracle(q, k, pattern, recall.recall_rows(n, LAST_Q, SEED))) < 1e-12
    assert got < 0.5, got  # held out: what the other rows need is gone


def _recall_on_ranks(group, layout_name, q, k, pattern, chunk_keys, docs=None) -> float:
    """Worker: pattern_recall on this rank's shards of q and k."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = make_layout(layout_name, q.shape[1], world, G)
    return _recall(layout.shard(q, rank), layout.shard(k, rank), pattern, chunk_keys, group, layout, docs)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("layout_name", ["contiguous", "zigzag", "striped"])
def test_context_parallel_matches_oracle(pool, world, layout_name):
    n = SEQ[world]
    q, k = _inputs(world, n)
    rows = recall.recall_rows(n, LAST_Q, SEED)
    for kind in PATTERNS:
        pattern = _pattern(kind, n, q.shape[2], seed=world)
        want = _oracle(q, k, pattern, rows)
        for chunk_keys in (5, 1 << 20):
            got = pool.run(_recall_on_ranks, world, layout_name, q, k, pattern, chunk_keys)
            assert all(abs(r - want) < 1e-12 for r in got), (kind, chunk_keys, got, want)


@pytest.mark.parametrize("layout_name", [None, "contiguous", "striped"])
@pytest.mark.parametrize("shared", [False, True])
def test_documents_rows_see_their_own_document(pool, layout_name, shared):
    """With packed documents each drawn row attends over its own document's keys (per-row boundaries for the
    batch of two, or one row of boundaries for both); without them the figure differs."""
    n = SEQ[4]
    q, k = _inputs(5, n)
    pattern = _pattern("lines", n, q.shape[2], seed=5)
    lengths = [[10, 100, 7, n - 117]] if shared else [[10, 100, 7, n - 117], [60, n - 60]]
    docs = Documents.from_lengths(lengths)
    rows = recall.recall_rows(n, LAST_Q, SEED)
    want = _oracle(q, k, pattern, rows, docs)
    if layout_name is None:
        got = [_recall(q, k, pattern, 9, docs=docs)]
    else:
        got = pool.run(_recall_on_ranks, 4, layout_name, q, k, pattern, 9, docs)
    assert all(abs(r - want) < 1e-12 for r in got), (got, want)
    assert abs(want - _oracle(q, k, pattern, rows)) > 1e-3

"""The column scorers against the torch reference (ops/estimate/block_columns.py): the dense Triton kernel
(column_kernels.py) and the sorted scorer in torch and Triton (column_buckets.py, column_bucket_kernels.py;
Triton in the interpreter) give the same scores and the same chosen columns; the sorted scorer's cap against
a float64 brute force of its rule."""

from __future__ import annotations

import pytest
import torch

from mtraining.ops import Documents
from mtraining.ops.estimate import column_buckets
from mtraining.ops.estimate.block_columns import column_scores_reference, select_block_columns, top_columns
from mtraining.ops.estimate.column_bucket_kernels import column_scores_sorted_triton, row_tiles
from mtraining.ops.estimate.column_buckets import column_scores_sorted
from mtraining.ops.estimate.column_kernels import column_scores_triton
from mtraining.ops.estimate.hashing import hash_codes, hash_planes
from mtraining.ops.pattern.vertical_slash import VerticalSlashPattern

G, D, N = 16, 16, 120  # N % G != 0: a partial last block
B, HQ, HKV = 2, 4, 2
TABLES, BITS, SEED = 4, 3, 5  # coarse hashes: many candidates
SCALE = 0.3
DOCUMENTS = {
    None: None,
    "shared": Documents.from_lengths([30, 50, 40]),
    "per_row": Documents.from_lengths([[70, 50], [5, 100, 15]]),
    "estimate_end": Documents.from_lengths([75, 45], estimate_end=70),  # rows from 70 on rank nothing
}
STRIDED = torch.cat(
    [torch.arange(r * G, min((r + 1) * G, N)) for r in (1, 3, 5, 7)]
)  # a rank's blocks, the last partial


def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, VerticalSlashPattern]:
    """q [B, N, HQ, D], k [B, N, HKV, D] and a pattern of random diagonals (0 always) and verticals."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, HQ, D, generator=gen)
    k = torch.randn(B, N, HKV, D, generator=gen)
    nb = -(-N // G)
    diag = torch.rand(B, HQ, nb, generator=gen) < 0.3
    diag[..., 0] = True
    vert = torch.rand(B, HQ, N, generator=gen) < 0.1
    return q, k, VerticalSlashPattern.from_masks(diag, vert, G)


def all_scores(chunks, nb: int) -> torch.Tensor:
    """float32 [B, H, nb, N]: the chunks' scores at their heads and global blocks (each held once), 0 elsewhere."""
    out = torch.zeros(B, HQ, nb, N)
    held = []
    for score, heads, blocks in chunks:
        out[:, heads, blocks] = score
        held += [(h, r) for h in range(HQ)[heads] for r in blocks.tolist()]
    assert len(held) == len(set(held))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("rows", ["all", "strided"])
@pytest.mark.parametrize("docs", list(DOCUMENTS))
def test_triton_scores_and_columns_equal_the_reference(docs, rows):
    q, k, pattern = inputs(list(DOCUMENTS).index(docs) + 3 * (rows == "strided"))
    q_pos = torch.arange(N) if rows == "all" else STRIDED
    q = q[:, q_pos]
    args = (q, k, pattern, SCALE, q_pos, DOCUMENTS[docs], TABLES, BITS, SEED)
    want = all_scores(column_scores_reference(*args), pattern.num_blocks)
    got = all_scores(column_scores_triton(*args, score_bytes=3 * B * HQ * N * 4), pattern.num_blocks)  # chunks of 3
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert (want > 0).sum() > 100  # the case scores many keys
    kwargs = dict(q_pos=q_pos, documents=DOCUMENTS[docs], tables=TABLES, bits=BITS, seed=SEED)
    torch_columns = select_block_columns(q, k, pattern, 3, SCALE, scorer="dense", backend="torch", **kwargs)
    triton_columns = select_block_columns(q, k, pattern, 3, SCALE, scorer="dense", backend="triton", **kwargs)
    assert torch.equal(triton_columns, torch_columns)


@pytest.mark.slow
def test_rows_without_pattern_keys_add_nothing():
    """No diagonal and no vertical: every row's LSE over the pattern is -inf, so no score (the reference
    weighs such rows against all the keys they see instead)."""
    q, k, _ = inputs(0)
    nb = -(-N // G)
    empty = VerticalSlashPattern.from_masks(
        torch.zeros(B, HQ, nb, dtype=torch.bool), torch.zeros(B, HQ, N, dtype=torch.bool), G
    )
    got = all_scores(column_scores_triton(q, k, empty, SCALE, torch.arange(N), None, TABLES, BITS, SEED), nb)
    assert bool((got == 0).all())


def test_refusals():
    q, k, pattern = inputs(1)
    with pytest.raises(ValueError, match="backend must be"):
        select_block_columns(q, k, pattern, 3, SCALE, backend="cuda")
    with pytest.raises(ValueError, match="dtype torch.float64 is not supported"):
        next(column_scores_triton(q.double(), k.double(), pattern, SCALE, torch.arange(N), None, 4, 3, SEED))
    with pytest.raises(ValueError, match="bits must be <= 31"):
        next(column_scores_triton(q, k, pattern, SCALE, torch.arange(N), None, 1, 32, SEED))
    cols = torch.full((B, HQ, pattern.num_blocks, 1), -1)
    cols[..., 2, 0] = 0
    with pytest.raises(ValueError, match="without block columns"):
        next(column_scores_triton(q, k, pattern.with_block_columns(cols), SCALE, torch.arange(N), None, 4, 3, SEED))


SORTED = {"torch": column_scores_sorted, "triton": column_scores_sorted_triton}


@pytest.mark.parametrize("backend", list(SORTED))
@pytest.mark.parametrize("rows", ["all", "strided"])
@pytest.mark.parametrize("docs", list(DOCUMENTS))
def test_sorted_scores_equal_the_reference(docs, rows, backend, monkeypatch):
    """Every candidate's score, in chunks of heads and blocks (Triton) or of blocks and pairs (torch)."""
    q, k, pattern = inputs(10 + list(DOCUMENTS).index(docs) + 3 * (rows == "strided"))
    q_pos = torch.arange(N) if rows == "all" else STRIDED
    q = q[:, q_pos]
    args = (q, k, pattern, SCALE, q_pos, DOCUMENTS[docs], TABLES, BITS, SEED)
    want = all_scores(column_scores_reference(*args), pattern.num_blocks)
    if backend == "torch":
        monkeypatch.setattr(column_buckets, "_SCORE_ELEMENTS", 3 * B * HQ * N)  # chunks of 3 blocks
        monkeypatch.setattr(column_buckets, "_PAIRS", 500)
        got = all_scores(column_scores_sorted(*args), pattern.num_blocks)
    else:
        got = all_scores(column_scores_sorted_triton(*args, score_bytes=3 * B * N * 4), pattern.num_blocks)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert (want > 0).sum() > 100  # the case scores many keys
    assert torch.equal(top_columns(got, 3), top_columns(want, 3))


def test_sorted_columns_are_the_dense_ones():
    """``select_block_columns``: the sorted scorer (the default) picks the dense scorer's columns."""
    q, k, pattern = inputs(21)
    kwargs = dict(documents=DOCUMENTS["per_row"], tables=TABLES, bits=BITS, seed=SEED, backend="torch")
    dense = select_block_columns(q, k, pattern, 3, SCALE, scorer="dense", **kwargs)
    assert bool((dense < N).sum() > 100)
    assert torch.equal(select_block_columns(q, k, pattern, 3, SCALE, **kwargs), dense)


def test_sorted_triton_fp16():
    """fp16 inputs: the kernel's scores equal the torch scorer's on the same (upcast) values."""
    q, k, pattern = inputs(30)
    q, k = q.half(), k.half()
    args = (pattern, SCALE, STRIDED, DOCUMENTS["shared"], TABLES, BITS, SEED)
    want = all_scores(column_scores_sorted(q[:, STRIDED].float(), k.float(), *args), pattern.num_blocks)
    got = all_scores(column_scores_sorted_triton(q[:, STRIDED], k, *args), pattern.num_blocks)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert (want > 0).sum() > 100


def test_sorted_triton_large_tiles():
    """One-bit hashes: every bucket holds about half the rows, so the kernel runs 64-row tiles (as at long
    lengths), which the finer hashes of the other cases never reach."""
    q, k, pattern = inputs(31)
    args = (q, k, pattern, SCALE, torch.arange(N), DOCUMENTS["per_row"], TABLES, 1, SEED)
    want = all_scores(column_scores_reference(*args), pattern.num_blocks)
    got = all_scores(column_scores_sorted_triton(*args), pattern.num_blocks)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert (want > 0).sum() > 1000


def capped_brute_force(q, k, pattern, documents, cap: int) -> torch.Tensor:
    """float64 [B, HQ, nb, N]: the sorted scorer's scores by its rule, row by row: a row meets, per table, the
    last ``cap`` keys of its bucket in [its document's start, its block's start); a pair met in any table and
    not kept by the pattern adds exp(score - the row's LSE over the pattern) to its block's score."""
    group = HQ // HKV
    planes = hash_planes(HQ, D, TABLES, BITS, SEED).double()
    qh = q.double().transpose(1, 2)
    kh = k.double().transpose(1, 2).repeat_interleave(group, dim=1)
    q_codes, k_codes = hash_codes(qh, planes, BITS), hash_codes(kh, planes, BITS)
    pos = torch.arange(N)
    kept = pattern.pair_mask(pos, pos)
    bounds = documents.left_bounds(pos).long()
    out = torch.zeros(B, HQ, pattern.num_blocks, N, dtype=torch.float64)
    for b in range(B):
        for h in range(HQ):
            logits = qh[b, h] @ kh[b, h].T * SCALE
            for i in range(N):
                seen = (pos >= bounds[b % bounds.shape[0], i]) & (pos <= i)
                lse = logits[i][kept[b, h, i] & seen].logsumexp(0)
                met = torch.zeros(N, dtype=torch.bool)
                for t in range(TABLES):
                    window = ((k_codes[b, h, :, t] == q_codes[b, h, i, t]) & seen & (pos < i // G * G)).nonzero()
                    met[window[-cap:, 0]] = True
                met &= ~kept[b, h, i]
                out[b, h, i // G, met] += (logits[i, met] - lse).exp()
    return out


@pytest.mark.parametrize("backend", list(SORTED))
def test_a_huge_bucket_is_capped(backend):
    """Near-constant keys share one code in most tables: every row's windows hold nearly all keys before its
    block. The cap keeps the last ``cap`` of each: the sorted scores follow the capped rule, and differ from
    the reference, which scores every key before the block; with a cap above every window they equal it."""
    q, k, pattern = inputs(40)
    k = 0.01 * k + torch.randn(D, generator=torch.Generator().manual_seed(0))
    docs = DOCUMENTS["per_row"]
    args = (q, k, pattern, SCALE, torch.arange(N), docs, TABLES, BITS, SEED)
    got = all_scores(SORTED[backend](*args, cap=5), pattern.num_blocks)
    torch.testing.assert_close(got.double(), capped_brute_force(q, k, pattern, docs, 5), rtol=1e-4, atol=1e-6)
    want = all_scores(column_scores_reference(*args), pattern.num_blocks)
    assert ((want > 0) & (got == 0)).sum() > 1000  # the cap drops many of the reference's candidates
    if backend == "torch":
        torch.testing.assert_close(all_scores(column_scores_sorted(*args, cap=N), pattern.num_blocks), want)


def test_row_tiles_cover_each_row_once_within_one_code():
    codes = torch.tensor([[3, 1, 3, 3, 0, 1, 3, 3, 3, 2]], dtype=torch.int32)
    order, starts = row_tiles(codes, block_m=2, bits=2)
    assert order.tolist() == [[4, 1, 5, 9, 0, 2, 3, 6, 7, 8]]  # by (code, row)
    assert starts.tolist() == [[0, 1, 3, 4, 6, 8, 10, 10, 10]]  # tiles of <= 2 rows of one code, then R (5 + 4 slots)


def test_sorted_refusals():
    q, k, pattern = inputs(1)
    with pytest.raises(ValueError, match="scorer must be 'sorted' or 'dense'"):
        select_block_columns(q, k, pattern, 3, SCALE, scorer="hashed")
    with pytest.raises(ValueError, match="cap must be None"):
        select_block_columns(q, k, pattern, 3, SCALE, scorer="dense", cap=8)
    with pytest.raises(ValueError, match="bucket cap must be None"):
        select_block_columns(q, k, pattern, 3, SCALE, cap=0)
    cols = torch.full((B, HQ, pattern.num_blocks, 1), -1)
    cols[..., 2, 0] = 0
    for scorer in SORTED.values():
        with pytest.raises(ValueError, match="without block columns"):
            next(scorer(q, k, pattern.with_block_columns(cols), SCALE, torch.arange(N), None, 4, 3, SEED))

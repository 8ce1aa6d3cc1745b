"""The Triton column scorer (ops/estimate/column_kernels.py, in the interpreter) against the torch reference
(ops/estimate/block_columns.py): the same scores and the same chosen columns."""

from __future__ import annotations

import pytest
import torch

from mtraining.ops import Documents
from mtraining.ops.estimate.block_columns import column_scores_reference, select_block_columns
from mtraining.ops.estimate.column_kernels import column_scores_triton
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
    """float32 [B, H, nb, N]: the chunks' scores at their global blocks (each block held once), 0 elsewhere."""
    out = torch.zeros(B, HQ, nb, N)
    held = []
    for score, blocks in chunks:
        out[:, :, blocks] = score
        held += blocks.tolist()
    assert len(held) == len(set(held))
    return out


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
    torch_columns = select_block_columns(q, k, pattern, 3, SCALE, scorer="torch", **kwargs)
    assert torch.equal(select_block_columns(q, k, pattern, 3, SCALE, scorer="triton", **kwargs), torch_columns)


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
    with pytest.raises(ValueError, match="scorer must be"):
        select_block_columns(q, k, pattern, 3, SCALE, scorer="cuda")
    with pytest.raises(ValueError, match="dtype torch.float64 is not supported"):
        next(column_scores_triton(q.double(), k.double(), pattern, SCALE, torch.arange(N), None, 4, 3, SEED))
    with pytest.raises(ValueError, match="bits must be <= 31"):
        next(column_scores_triton(q, k, pattern, SCALE, torch.arange(N), None, 1, 32, SEED))
    cols = torch.full((B, HQ, pattern.num_blocks, 1), -1)
    cols[..., 2, 0] = 0
    with pytest.raises(ValueError, match="without block columns"):
        next(column_scores_triton(q, k, pattern.with_block_columns(cols), SCALE, torch.arange(N), None, 4, 3, SEED))

"""Per-block columns: key columns chosen for each block of G query rows, on top of a vertical-slash pattern.

The pattern's verticals are chosen by the last queries of each document, so a question asked mid-document
keeps its evidence only if those rows attend to it too. Here every query block ranks the keys before it by
the attention its own rows would give them beyond the pattern, and keeps the ``per_block`` best
(``VerticalSlashPattern.with_block_columns``). Ranking every row against every key is the quadratic work
sparse attention avoids, and cheaper proxies (pooled queries, key-block bounds, every 4th row) miss the
evidence, which is one row's attention to one key (DESIGN.md, experiments/extension/local_verticals.py). So only the pairs
whose query and key share a bucket of a random-hyperplane sign hash (in any of ``tables`` hashes of ``bits``
bits) are scored, each as the probability the row would give the key next to the mass the pattern keeps in
the row, exp(score - the row's LSE over the pattern), summed over the block's rows.

The choice is two steps, each defined once: the scores of every (query block, key), per chunk of query
blocks, and the top ``per_block`` of each block's scores (``top_columns``). Two scorers compute the same
scores: ``column_scores_reference`` in torch, which forms every row's scores, masks and hash compares in
chunks of query blocks (the torch path, at small sizes), and the Triton kernel of column_kernels.py, which
walks each block's keys in tiles with the rows' LSE from the sparse forward and holds only the blocks'
scores (the CUDA path; ``select_block_columns``'s ``scorer``). Both do work that grows with the square of
the length: every key before a block is scored against its rows. Under context parallelism each rank
ranks the blocks of its own rows against the gathered keys, and one all-reduce (min) assembles the global
columns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Literal

import torch
from torch import Tensor

from ..documents import Documents
from ..pattern.vertical_slash import VerticalSlashPattern, attention_mask
from .hashing import bucket_mates, hashed_heads

_CHUNK_ELEMENTS = 1 << 24  # scores held at once per chunk of query blocks


Scorer = Literal["auto", "torch", "triton"]
ColumnScorer = Callable[
    [Tensor, Tensor, VerticalSlashPattern, float, Tensor, Documents | None, int, int, int],
    Iterator[tuple[Tensor, Tensor]],
]
"""(q, k, pattern, scale, q_pos, documents, tables, bits, seed) -> per chunk of query blocks (scores, blocks)."""


@torch.no_grad()
def select_block_columns(
    q: Tensor,
    k: Tensor,
    pattern: VerticalSlashPattern,
    per_block: int,
    scale: float,
    q_pos: Tensor | None = None,
    documents: Documents | None = None,
    tables: int = 8,
    bits: int = 8,
    seed: int = 0,
    scorer: Scorer = "auto",
) -> Tensor:
    """int32 [B, H, num_blocks, per_block]: the columns of every query block that holds a row of ``q``
    (ascending, padded with seq_len; the other blocks all padding), for ``pattern.with_block_columns``.

    q [B, Sq, Hq, D] at global positions ``q_pos`` (default 0..Sq-1; whole query blocks), k [B, N, Hkv, D]
    the whole sequence's keys in position order (Hq a multiple of Hkv). A block's candidates are the keys
    before its first row that the pattern does not keep for it, within the document of some row of the block,
    sharing a hash bucket with one of its rows; a key no row of the block meets is never chosen. Rows from
    ``documents.estimate_end`` on rank nothing.
    ``scorer``: "auto" scores with the Triton kernel on CUDA and the torch reference elsewhere (see
    ``column_scores_reference`` and ``column_kernels.column_scores_triton``; "triton" runs the kernel in
    Triton's interpreter on the CPU).
    """
    b, sq, hq, _ = q.shape
    n = k.shape[1]
    columns = torch.full((b, hq, pattern.num_blocks, per_block), n, dtype=torch.int32, device=q.device)
    if per_block == 0 or sq == 0:
        return columns
    if q_pos is None:
        q_pos = torch.arange(sq, device=q.device)
    for score, held in _scorer(scorer, q)(q, k, pattern, scale, q_pos, documents, tables, bits, seed):
        columns[:, :, held] = top_columns(score, per_block)
    return columns


def top_columns(score: Tensor, per_block: int) -> Tensor:
    """int32 [..., per_block]: the ``per_block`` highest of each row of ``score`` [..., N] among those > 0,
    ascending, padded with N (a block keeps only keys some row of it meets)."""
    n = score.shape[-1]
    top = score.topk(min(per_block, n), dim=-1)
    chosen = torch.where(top.values > 0, top.indices, n).sort(-1).values.to(torch.int32)
    return torch.nn.functional.pad(chosen, (0, per_block - chosen.shape[-1]), value=n)


def _scorer(name: Scorer, q: Tensor) -> ColumnScorer:
    """The column scorer ``name`` ("auto": Triton on CUDA, else torch); the kernel module is imported on
    first use (Triton reads TRITON_INTERPRET when kernels are defined, and CPU callers never need it)."""
    if name == "auto":
        name = "triton" if q.is_cuda else "torch"
    if name == "torch":
        return column_scores_reference
    if name == "triton":
        from .column_kernels import column_scores_triton

        return column_scores_triton
    raise ValueError(f"scorer must be 'auto', 'torch' or 'triton', got {name!r}")


def column_scores_reference(
    q: Tensor,
    k: Tensor,
    pattern: VerticalSlashPattern,
    scale: float,
    q_pos: Tensor,
    documents: Documents | None,
    tables: int,
    bits: int,
    seed: int,
) -> Iterator[tuple[Tensor, Tensor]]:
    """The blocks' column scores (module docstring) in torch, per chunk of whole query blocks: (float32
    [B, H, blocks, N], int64 [blocks]: which global blocks, ascending). Arguments as ``select_block_columns``.

    A row the pattern leaves without keys weighs its candidates against all the keys it may see.
    """
    b, sq, hq, _ = q.shape
    n = k.shape[1]
    g = pattern.block_size
    k_pos = torch.arange(n, device=q.device)
    qh, kh, q_codes, k_codes = hashed_heads(q, k, tables, bits, seed)
    rows_per_chunk = max(g, _CHUNK_ELEMENTS // max(b * hq * n * tables, 1) // g * g)
    for start in range(0, sq, rows_per_chunk):
        rows = slice(start, min(start + rows_per_chunk, sq))
        pos = q_pos[rows]
        bound = None if documents is None else documents.left_bounds(pos)
        seen = attention_mask(pos, k_pos, None, bound)  # [B or 1, 1, R, N]: causal, within the document
        kept = attention_mask(pos, k_pos, pattern, bound)  # [B, H, R, N]: the pattern's pairs
        logits = torch.matmul(qh[:, :, rows], kh.transpose(-1, -2)).mul_(scale)
        pattern_lse = logits.masked_fill(~kept, float("-inf")).logsumexp(-1, keepdim=True)
        pattern_lse = torch.where(
            pattern_lse > float("-inf"), pattern_lse, logits.masked_fill(~seen, float("-inf")).logsumexp(-1, True)
        )
        mates = bucket_mates(q_codes[:, :, rows], k_codes)  # [B, H, R, N]
        before = k_pos[None, :] < (pos // g * g)[:, None]  # keys before the row's block
        candidate = mates & before & seen & ~kept
        if documents is not None and documents.estimate_end is not None:  # rows that do not estimate rank nothing
            candidate &= (pos < documents.estimate_end)[:, None]
        probs = (logits - pattern_lse).exp_().masked_fill_(~candidate, 0.0)
        held, block_of_row = torch.unique(pos // g, return_inverse=True)  # the chunk's blocks, ascending
        yield probs.new_zeros(b, hq, held.shape[0], n).index_add_(2, block_of_row, probs), held

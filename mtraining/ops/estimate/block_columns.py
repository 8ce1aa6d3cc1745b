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
blocks, and the top ``per_block`` of each block's scores (``top_columns``). Two ways find the candidates
(``select_block_columns``'s ``scorer``). "dense" scores every key before a block against its rows and masks
the pairs to the hash mates: ``column_scores_reference`` in torch (forms every row's scores, masks and hash
compares in chunks of query blocks) and the Triton kernel of column_kernels.py (walks each block's keys in
tiles, holding only the blocks' scores); their work grows with the square of the length. "sorted"
(column_buckets.py) sorts each table's keys by code, so every row's candidates in a table are one run of
that order, and scores only those: in torch (``column_scores_sorted``) and by the Triton kernel of
column_bucket_kernels.py; its work grows with the candidate pairs, and a row meets at most ``cap`` keys per
table. Under context parallelism each rank ranks the blocks of its own rows against the gathered keys, and
one all-reduce (min) assembles the global columns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Literal

import torch
from torch import Tensor

from ..documents import Documents
from ..pattern.vertical_slash import VerticalSlashPattern, attention_mask
from .hashing import bucket_mates, hashed_heads

_CHUNK_ELEMENTS = 1 << 24  # scores held at once per chunk of query blocks


Scorer = Literal["sorted", "dense"]
Backend = Literal["auto", "torch", "triton"]
ColumnScorer = Callable[
    [Tensor, Tensor, VerticalSlashPattern, float, Tensor, Documents | None, int, int, int],
    Iterator[tuple[Tensor, slice, Tensor]],
]
"""(q, k, pattern, scale, q_pos, documents, tables, bits, seed) -> per chunk of (query heads, query blocks):
(scores float32 [B, heads, blocks, N], heads, blocks int64 [blocks])."""


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
    scorer: Scorer = "sorted",
    backend: Backend = "auto",
    cap: int | None = None,
) -> Tensor:
    """int32 [B, H, num_blocks, per_block]: the columns of every query block that holds a row of ``q``
    (ascending, padded with seq_len; the other blocks all padding), for ``pattern.with_block_columns``.

    q [B, Sq, Hq, D] at global positions ``q_pos`` (default 0..Sq-1; whole query blocks), k [B, N, Hkv, D]
    the whole sequence's keys in position order (Hq a multiple of Hkv). A block's candidates are the keys
    before its first row that the pattern does not keep for it, within the document of some row of the block,
    sharing a hash bucket with one of its rows; a key no row of the block meets is never chosen. Rows from
    ``documents.estimate_end`` on rank nothing.
    ``scorer``: how candidates are found (module docstring): "sorted" (each row meets at most ``cap`` keys
    per table; None: no cap) or "dense" (``cap`` must be None). ``backend``: "auto" scores with Triton on
    CUDA and torch elsewhere ("triton" runs the kernels in Triton's interpreter on the CPU).
    """
    b, sq, hq, _ = q.shape
    n = k.shape[1]
    columns = torch.full((b, hq, pattern.num_blocks, per_block), n, dtype=torch.int32, device=q.device)
    if per_block == 0 or sq == 0:
        return columns
    if q_pos is None:
        q_pos = torch.arange(sq, device=q.device)
    for score, heads, held in _scorer(scorer, backend, cap, q)(
        q, k, pattern, scale, q_pos, documents, tables, bits, seed
    ):
        columns[:, heads, held] = top_columns(score, per_block)
    return columns


def top_columns(score: Tensor, per_block: int) -> Tensor:
    """int32 [..., per_block]: the ``per_block`` highest of each row of ``score`` [..., N] among those > 0,
    ascending, padded with N (a block keeps only keys some row of it meets)."""
    n = score.shape[-1]
    top = score.topk(min(per_block, n), dim=-1)
    chosen = torch.where(top.values > 0, top.indices, n).sort(-1).values.to(torch.int32)
    return torch.nn.functional.pad(chosen, (0, per_block - chosen.shape[-1]), value=n)


def _scorer(scorer: Scorer, backend: Backend, cap: int | None, q: Tensor) -> ColumnScorer:
    """The column scorer of ``scorer`` and ``backend`` ("auto": Triton on CUDA, else torch). The modules are
    imported on first use (Triton reads TRITON_INTERPRET when kernels are defined, and CPU callers never need
    it)."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "auto":
        backend = "triton" if q.is_cuda else "torch"
    if scorer == "dense":
        if cap is not None:
            raise ValueError(f"the dense column scorer scores every candidate: cap must be None, got {cap!r}")
        if backend == "torch":
            return column_scores_reference
        from .column_kernels import column_scores_triton

        return column_scores_triton
    if scorer == "sorted":
        if backend == "torch":
            from .column_buckets import column_scores_sorted

            return partial(column_scores_sorted, cap=cap)
        from .column_bucket_kernels import column_scores_sorted_triton

        return partial(column_scores_sorted_triton, cap=cap)
    raise ValueError(f"scorer must be 'sorted' or 'dense', got {scorer!r}")


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
) -> Iterator[tuple[Tensor, slice, Tensor]]:
    """The blocks' column scores (module docstring) in torch, per chunk of whole query blocks: (float32
    [B, H, blocks, N], every head, int64 [blocks]: which global blocks, ascending). Arguments as
    ``select_block_columns``.

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
        yield probs.new_zeros(b, hq, held.shape[0], n).index_add_(2, block_of_row, probs), slice(None), held

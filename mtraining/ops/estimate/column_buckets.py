"""Per-block column candidates found by sorting hash codes: the sorted column scorer (``column_scorer: sorted``).

A query block's candidates (block_columns.py) are the keys before it that share a bucket of one of T sign
hashes with one of its rows. Sorting each table's keys by (code, position) puts every bucket's keys
together, in position order, so the keys one row meets in one table are one run of that order: those of its
bucket from its document's start up to its block's start, found by two binary searches (``row_windows``).
A scorer reads only those runs, a gather rather than a scan, so its work grows with the candidate pairs
(about T / 2^bits of the causal pairs for balanced hashes) instead of with every pair.

A pair met in several tables counts once, in the first table whose window holds it. A bucket holding many
keys (near-constant keys share most codes) would make that work quadratic again, so a row meets at most
``cap`` keys per table: the last ``cap`` of its window, those nearest its block (keys the lines keep count
toward the cap). Where no window is longer than ``cap`` the candidates are exactly the dense scorers'; where
one is, the sorted scorers rank a subset of them.

``column_scores_sorted`` is the torch implementation (the CPU path, and the oracle of the Triton kernel in
column_bucket_kernels.py): per chunk of query blocks it lists every candidate pair, scores it and adds it
to its block's score of its key.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from ..documents import Documents
from ..pattern.vertical_slash import VerticalSlashPattern
from ..sparse import attention_forward
from .hashing import hashed_heads

_SCORE_ELEMENTS = 1 << 24  # scores held at once per chunk of query blocks
_PAIRS = 1 << 18  # candidate pairs scored at once


class KeyBuckets(NamedTuple):
    """Every table's keys sorted by (code, position): order int32 [B, H, T, N] (the key positions in that
    order), codes int32 [B, H, T, N] (each key's code, by position) and sorted int64 [B, H, T, N] (code * N +
    position in that order: ascending, what ``row_windows`` searches)."""

    order: Tensor
    codes: Tensor
    sorted: Tensor


class RowWindows(NamedTuple):
    """Each row's keys per table, all int32 [B, H, T, R]: codes (the row's code), [lo, hi) (its window: indices
    into ``KeyBuckets.order``) and first (the window's first key position; the block's start when empty),
    so key j lies in the row's window of table t iff their codes in t are equal and first <= j < block start."""

    codes: Tensor
    lo: Tensor
    hi: Tensor
    first: Tensor


def sort_keys(k_codes: Tensor) -> KeyBuckets:
    """The ``KeyBuckets`` of keys' codes int64 [B, H, N, T] (``hashing.hashed_heads``)."""
    n = k_codes.shape[2]
    codes = k_codes.transpose(-1, -2).contiguous()
    by_code, order = codes.sort(dim=-1, stable=True)  # stable: each bucket's keys stay in position order
    return KeyBuckets(order.to(torch.int32), codes.to(torch.int32), by_code * n + order)


def row_windows(
    keys: KeyBuckets,
    q_codes: Tensor,
    q_pos: Tensor,
    documents: Documents | None,
    q_bound: Tensor | None,
    block_size: int,
    cap: int | None,
) -> RowWindows:
    """The ``RowWindows`` of rows with codes int64 [B, H, R, T] at global positions ``q_pos`` [R], with
    (packed ``documents``) left bounds ``q_bound`` [B or 1, R]; at most ``cap`` keys per window (None: no cap).
    Rows from ``documents.estimate_end`` on meet no key (they rank nothing)."""
    n = keys.order.shape[-1]
    codes = q_codes.transpose(-1, -2).contiguous()  # [B, H, T, R]
    start = (q_pos.long() // block_size * block_size).expand_as(codes)
    if documents is not None and documents.estimate_end is not None:
        start = torch.where(q_pos.long() < documents.estimate_end, start, 0)  # an empty window: hi = lo
    bound = torch.zeros_like(start) if q_bound is None else q_bound.long()[:, None, None, :].expand_as(codes)
    hi = torch.searchsorted(keys.sorted, codes * n + start)  # keys of lower codes, or of this code before start
    lo = torch.minimum(torch.searchsorted(keys.sorted, codes * n + bound.contiguous()), hi)
    if cap is not None:
        lo = torch.maximum(lo, hi - cap)
    first = torch.where(lo < hi, keys.order.gather(-1, lo.clamp(max=n - 1)).long(), start)
    return RowWindows(*(t.to(torch.int32) for t in (codes, lo, hi, first)))


def check_cap(cap: int | None) -> None:
    """ValueError unless ``cap`` is None or an int >= 1."""
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ValueError(f"the bucket cap must be None (no cap) or an int >= 1 (keys per row and table), got {cap!r}")


def column_scores_sorted(
    q: Tensor,
    k: Tensor,
    pattern: VerticalSlashPattern,
    scale: float,
    q_pos: Tensor,
    documents: Documents | None,
    tables: int,
    bits: int,
    seed: int,
    cap: int | None = None,
) -> Iterator[tuple[Tensor, slice, Tensor]]:
    """The blocks' column scores (block_columns.py) from the candidates of the sorted buckets, in torch, per
    chunk of whole query blocks: (float32 [B, H, blocks, N], every head, int64 [blocks]: which global blocks,
    ascending). Arguments as ``select_block_columns``, the pattern without block columns; ``cap`` as the module
    says.

    The rows' LSE over the pattern comes from the sparse forward (torch backend); a row the pattern leaves
    without keys (never one of an estimated pattern, which keeps the local window) adds nothing, and so do
    rows from ``documents.estimate_end`` on.
    """
    if pattern.block_cols is not None:
        raise ValueError("the sorted column scorer scores on a pattern without block columns (its lines)")
    check_cap(cap)
    b, sq, hq, _ = q.shape
    n = k.shape[1]
    g = pattern.block_size
    q_bound = None if documents is None else documents.left_bounds(q_pos)
    k_pos = torch.arange(n, device=q.device)
    _, lse = attention_forward(q, k, k, pattern, q_pos, k_pos, scale, backend="torch", q_bound=q_bound)
    lse = lse.float()
    qh, kh, q_codes, k_codes = hashed_heads(q, k, tables, bits, seed)
    keys = sort_keys(k_codes)
    kept_vertical, kept_diag = pattern.vertical_mask(), pattern.diag_mask()
    rows_per_chunk = max(g, _SCORE_ELEMENTS // max(b * hq * n, 1) // g * g)
    for start in range(0, sq, rows_per_chunk):
        rows = slice(start, min(start + rows_per_chunk, sq))
        pos = q_pos[rows].long()
        bound = None if q_bound is None else q_bound[:, rows]
        win = row_windows(keys, q_codes[:, :, rows], pos, documents, bound, g, cap)
        held, block_of_row = torch.unique(pos // g, return_inverse=True)  # the chunk's blocks, ascending
        score = torch.zeros(b, hq, held.shape[0], n, dtype=torch.float32, device=q.device)
        for bi, hd, ti, ri, j in _candidate_pairs(keys, win):
            kept = kept_vertical[bi, hd, j] | kept_diag[bi, hd, pos[ri] // g - j // g]
            met = (win.codes[bi, hd, :, ri] == keys.codes[bi, hd, :, j]) & (j[:, None] >= win.first[bi, hd, :, ri])
            first_table = met.int().argmax(-1)  # the first table whose window holds the pair (ti's does)
            take = ~kept & (first_table == ti)
            bi, hd, ri, j = bi[take], hd[take], ri[take], j[take]
            row = ri + start
            logits = (qh[bi, hd, row] * kh[bi, hd, j]).sum(-1) * scale
            row_lse = lse[bi, hd, row]
            probs = torch.where(row_lse > float("-inf"), (logits - row_lse).exp(), 0.0)
            score.index_put_((bi, hd, block_of_row[ri], j), probs, accumulate=True)
        yield score, slice(None), held


def _candidate_pairs(keys: KeyBuckets, win: RowWindows) -> Iterator[tuple[Tensor, Tensor, Tensor, Tensor, Tensor]]:
    """Every (row, table, key) of the windows, at most ``_PAIRS`` at a time: int64 (batch, head, table, row,
    key position) [P] each."""
    b, h, t, r = win.lo.shape
    count = (win.hi - win.lo).flatten().long()  # lo <= hi
    ends = count.cumsum(0)
    total = int(ends[-1]) if ends.numel() else 0
    lo = win.lo.flatten().long()
    for offset in range(0, total, _PAIRS):
        pair = torch.arange(offset, min(offset + _PAIRS, total), device=lo.device)
        owner = torch.searchsorted(ends, pair, right=True)  # the (row, table) window each pair lies in
        index = lo[owner] + pair - (ends[owner] - count[owner])
        ri = owner % r
        ti = owner // r % t
        hd = owner // (r * t) % h
        bi = owner // (r * t * h)
        yield bi, hd, ti, ri, keys.order[bi, hd, ti, index].long()

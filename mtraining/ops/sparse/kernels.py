"""Triton kernels of vertical-slash sparse attention: forward, dQ, dK/dV (block part, vertical columns), row delta.

Q, K, V, O and their gradients are [B, S, H, D] (K and V with Hkv = H / GROUP heads), LSE and delta
[B, H, S] float32, positions int32 [S]. The kernels never search: each tile reads its G-block's entry
of a walk built by index.py (a ``QueryWalk`` for the forward and dQ, a ``KeyWalk`` for dK/dV),
whatever the tile size (a tile of BLOCK_M rows is one of the G // BLOCK_M tiles of its block).

- ``_fwd_kernel``, program (query tile, b * H + h): out [BLOCK_M, D] and lse [BLOCK_M] of one query
  tile by online softmax over its walk; with MERGE it folds them by LSE into the partial (out, lse)
  of earlier keys (an earlier ring step), in place.
- ``_bwd_dq_kernel``, same grid and walk: dQ = sum of dS K over the walk, P recomputed from Q, K and
  the saved LSE (FlashAttention-2 style), dS = P * (dO V^T - delta).
- ``_bwd_dkdv_block_kernel``, program (key tile, b * Hkv + hk): dK, dV [BLOCK_N, D] of the block part
  (off-diagonal blocks, then the causal-diagonal block) over the query heads of the tile's GQA group.
- ``_bwd_dkdv_vertical_kernel``, program (chunk of BLOCK_V vertical columns, b * H + h, split of the
  query tiles): dK, dV of the vertical columns, added atomically (a GQA group's query heads share
  the keys, and long columns are split over programs).
- ``_bwd_dkdv_column_kernel``, program (query block x chunk of BLOCK_V of its columns, b * H + h): dK, dV
  of a block's own columns (per-block columns), added atomically (blocks share keys).
- ``_row_delta_kernel``: delta = rowsum(dO * O), the softmax backward's row term.

A query tile walks its keys in three stages (``_query_tile_walk``, shared by the forward and dQ):
1. off-diagonal: the key blocks of the selected block diagonals, listed per query block, G // BLOCK_N
   key tiles each, read through tensor descriptors (TMA on Hopper); every pair is causal: no mask;
2. diagonal: the causal-diagonal block, G // BLOCK_N key tiles masked by position;
3. vertical: the vertical columns of this key chunk, BLOCK_V at a time, except those whose block
   diagonal is selected (stages 1 and 2 saw them: no pair counts twice), masked by position;
4. columns (COLUMNS, a constexpr: without it the kernels compile as before): the block's own columns in
   this key chunk (a ``ColumnWalk``: only those no line keeps), BLOCK_V at a time; all lie before the
   block, so only padding (and documents) need a mask.
The dK/dV block kernel walks stages 1 and 2 from the keys' side. A masked pair counts where
``_visible`` holds (written out in ``_dkdv_step``, see there). Scores are kept in base 2
(``qk_scale`` includes log2(e), ``exp2``); the LSE written out is natural-log.

Non-finite keys: a NaN or an infinity in K or V reaches only the rows that may see its key. A masked
pair's probability is 0, but 0 x NaN is NaN inside a matrix product, so a masked tile (every stage but
the unmasked off-diagonal blocks) checks its K or V and zeroes them where a key is not finite
(``_masked_tile_update``: one sum per tile; the zeroing runs only for a tile that holds one), and the
dK/dV step masks P and dS rather than the scores (a row that sees such a key has a NaN LSE or delta).
A row that sees a key whose V is not finite comes out NaN; one that sees an infinite K gets what IEEE
arithmetic gives its score (NaN, or a weight of 0 for a score of -inf).

Packed documents (DOCS, a constexpr set by ``@triton.heuristics`` when QBound is given: without it the
kernels compile as before): every row also has a left bound (QBound [B, Sq], the first position of its
document) and a pair counts only if ``k_pos >= bound``. The walks (index.py) list only the key blocks some
row's document reaches; stage 1 visits first those that need no mask (``Walk.unmasked`` of them, a prefix
of the list), then the rest with the bound tested; the diagonal block and the vertical columns (from
``Walk.vfirst``; dK/dV: the rows before ``Walk.vend``) test it too. COLUMNS is set likewise when Columns
(a ``ColumnWalk``) is given.

Arguments: a tensor travels with its strides and a walk whole, as NamedTuples (``HeadTensor``,
``RowStats``, ``KeyGrads``, ``PerHead`` here; ``QueryWalk``, ``KeyWalk``, ``ColumnWalk`` in index.py),
which Triton flattens in place; one argument (or group) per line, which ``# fmt: skip`` keeps. Triton
3.6 specialises every int inside a tuple (``do_not_specialize`` does not reach into one), so the walks'
list strides are specialised like any other stride: the widths are host-known per configuration, and
marking them divisible by 16 leaves every kernel's PTX unchanged (bench/results/ptx_compare_walk_hints.json).
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl
from torch import Tensor

from .index import ColumnWalk, KeyWalk, QueryWalk

LOG2E = 1.4426950408889634  # log2(e): the launcher folds it into qk_scale
_LOG2E = tl.constexpr(LOG2E)
INT_MAX = tl.constexpr(2147483647)  # position of a key no query sees


class HeadTensor(NamedTuple):
    """A [B, S, H, D] tensor as the kernels read it (head_dim contiguous) and the strides of its first dims."""

    ptr: Tensor
    stride_b: int
    stride_s: int
    stride_h: int

    @classmethod
    def of(cls, t: Tensor) -> HeadTensor:
        return cls(t, *t.stride()[:3])


class RowStats(NamedTuple):
    """The rows' LSE and delta [B, H, S] float32 (delta None in the forward), which share strides."""

    lse: Tensor
    delta: Tensor | None
    stride_b: int
    stride_h: int

    @classmethod
    def of(cls, lse: Tensor, delta: Tensor | None = None) -> RowStats:
        if delta is not None and delta.stride() != lse.stride():
            raise ValueError(f"lse and delta must share strides, got {lse.stride()} and {delta.stride()}")
        return cls(lse, delta, *lse.stride()[:2])


class KeyGrads(NamedTuple):
    """dK and dV [B, Sk, Hkv, D] float32, which share strides."""

    dk: Tensor
    dv: Tensor
    stride_b: int
    stride_s: int
    stride_h: int

    @classmethod
    def of(cls, dk: Tensor, dv: Tensor) -> KeyGrads:
        if dk.stride() != dv.stride():
            raise ValueError(f"dk and dv must share strides, got {dk.stride()} and {dv.stride()}")
        return cls(dk, dv, *dk.stride()[:3])


class PerHead(NamedTuple):
    """A [B, H, X, ...] tensor (per head lists, codes, masks or scores, last dim contiguous) and the strides of
    its first dims; stride_x None for a [B, H, N] tensor."""

    ptr: Tensor
    stride_b: int
    stride_h: int
    stride_x: int | None

    @classmethod
    def of(cls, t: Tensor) -> PerHead:
        strides = t.stride()
        return cls(t, strides[0], strides[1], strides[2] if t.dim() > 3 else None)


def given(name: str):
    """A heuristic that turns an optional argument into a constexpr flag: is ``name`` given (not None)?"""
    return lambda args: args[name] is not None


# ---------------------------------------------------------------------------------------------------
# Shared pieces: the pair test, the vertical columns, the rows of a query tile.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _visible(q_pos, k_pos, q_bound, DOCS: tl.constexpr):
    """[M, N]: may the query at position q_pos [M] see the key at k_pos [N] (causal; INT_MAX: never);
    DOCS: only keys of its document, k_pos >= q_bound [M]."""
    seen = k_pos[None, :] <= q_pos[:, None]
    if DOCS:
        seen = seen & (k_pos[None, :] >= q_bound[:, None])
    return seen


@triton.jit
def _finite(x):
    """x with every NaN and infinity replaced by 0 (x * 0 is 0 exactly where x is finite)."""
    return tl.where(x * 0.0 == 0.0, x, 0.0)


@triton.jit
def _uncovered(mask_row, q_block, k_block, valid):
    """Which ``valid`` vertical columns (in global blocks k_block) query block q_block sees off its
    selected block diagonals (``mask_row``: the head's DiagMask); the block stages cover the rest."""
    covered = tl.load(mask_row + (q_block - k_block), mask=valid & (k_block <= q_block), other=0)
    return valid & (covered == 0)


@triton.jit
def _vertical_tile(idx, n_vert, vcols_row, KPos, mask_row, q_block, G: tl.constexpr):
    """Entries idx [BLOCK_V] of the head's vertical columns (the first n_vert of ``vcols_row`` are those
    query block q_block may see): (local key rows, positions with INT_MAX where unused, used)."""
    valid = idx < n_vert
    cols = tl.load(vcols_row + idx, mask=valid, other=0)
    k_pos = tl.load(KPos + cols, mask=valid, other=INT_MAX)
    k_block = k_pos // G
    use = _uncovered(mask_row, q_block, k_block, valid)
    return cols, tl.where(use, k_pos, INT_MAX), use


@triton.jit
def _query_tile(Sq, H, GROUP, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Program (tile, b * H + h) of the forward and dQ kernels: (tile, b, h, its KV head hk, the
    tile's rows [M], which of them are < Sq, head-dim offsets d [D])."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Sq
    d = tl.arange(0, HEAD_DIM)
    return tile, b, h, hk, rows, row_ok, d


@triton.jit
def _row_bounds(QBound, b, rows, row_ok, stride_bb, q_pos, DOCS: tl.constexpr):
    """DOCS: the left bounds [M] of the rows (QBound [B, Sq]); else the positions (the bound is not used)."""
    if DOCS:
        return tl.load(QBound + b * stride_bb + rows, mask=row_ok, other=0)
    else:
        return q_pos


@triton.jit
def _load_do_lse_delta(DO, Stats, b, h, rows, row_ok, d):
    """(dO [M, D], base-2 LSE [M], delta [M]) of the rows ``rows`` of head h, as the backward needs
    them: rows past Sq and rows that saw no key (LSE = -inf) get LSE = +inf, so P = 0 there."""
    do = tl.load(
        DO.ptr + b * DO.stride_b + rows[:, None] * DO.stride_s + h * DO.stride_h + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    lse = tl.load(Stats.lse + b * Stats.stride_b + h * Stats.stride_h + rows, mask=row_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)
    delta = tl.load(Stats.delta + b * Stats.stride_b + h * Stats.stride_h + rows, mask=row_ok, other=0.0)
    return do, lse2, delta


# ---------------------------------------------------------------------------------------------------
# Forward and dQ: one query tile [BLOCK_M, D] walks its key tiles.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _online_softmax(acc, m_i, l_i, s, v):
    """One online-softmax step on base-2 scores s [M, N] (-inf = masked) and values v [N, D]."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _dq_step(dq, do, lse2, delta, k_t, v_t, s, seen, MASK: tl.constexpr):
    """dQ += dS K for base-2 scores s [M, N] (-inf = masked), keys and values given transposed [D, N];
    MASK: dO V^T is 0 where ``seen`` [M, N] does not hold (a non-finite V of a masked pair)."""
    p = tl.exp2(s - lse2[:, None])
    dp = tl.dot(do, v_t)
    if MASK:
        dp = tl.where(seen, dp, 0.0)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k_t.dtype), tl.trans(k_t))


@triton.jit
def _query_tile_update(acc, m_i, l_i, q, do, k_t, v, s, DQ: tl.constexpr):
    """Fold one key tile into a query tile: s [M, N] base-2 scores, k_t [D, N]. Forward: v [N, D],
    online softmax into (acc, m_i, l_i). DQ: v [D, N]; acc is dQ, (m_i, l_i) the rows' base-2 LSE
    and delta, read only."""
    if DQ:
        acc = _dq_step(acc, do, m_i, l_i, k_t, v, s, None, False)
    else:
        acc, m_i, l_i = _online_softmax(acc, m_i, l_i, s, v)
    return acc, m_i, l_i


@triton.jit
def _load_v(v_base, cols, ok, stride_vs, d, DQ: tl.constexpr):
    """Values of the local key rows cols [N]: [N, D] for the forward's P V, [D, N] for dQ's dO V^T."""
    if DQ:
        v = tl.load(v_base + cols[None, :] * stride_vs + d[:, None], mask=ok[None, :], other=0.0)
    else:
        v = tl.load(v_base + cols[:, None] * stride_vs + d[None, :], mask=ok[:, None], other=0.0)
    return v


@triton.jit
def _load_t(base, cols, ok, stride_s, d):
    """Rows ``cols`` [N] of one head's keys or values, transposed [D, N] (0 where not ``ok``)."""
    return tl.load(base + cols[None, :] * stride_s + d[:, None], mask=ok[None, :], other=0.0)


@triton.jit
def _masked_tile_update(acc, m_i, l_i, q, do, k_t, v_t, seen, qk_scale, DQ: tl.constexpr):
    """``_query_tile_update`` for a key tile whose pairs count only where ``seen`` [M, N] holds; keys and
    values given transposed [D, N].

    A masked pair's probability is 0, but 0 x NaN is NaN in a matrix product: a NaN or an infinity in K or
    V of a key the row may not see must not meet it there. A tile that holds one (rare: a sum of x * 0 is
    NaN) has them zeroed. Forward: V is checked, and NaN is added to each key's K column where V is not
    finite, so its scores are NaN and the mask keeps them only for the rows that see it (K enters only the
    scores, which the mask replaces). dQ: K is checked; dO V^T is masked like the scores (``_dq_step``). A
    row that sees such a key already has a NaN delta or LSE.
    """
    if DQ:
        if tl.sum(k_t * 0.0) != 0.0:
            k_t = _finite(k_t)
    else:
        if tl.sum(v_t * 0.0) != 0.0:
            k_t = k_t + v_t * 0.0
            v_t = _finite(v_t)
        v_t = tl.trans(v_t)
    s = tl.where(seen, tl.dot(q, k_t) * qk_scale, float("-inf"))
    if DQ:
        acc = _dq_step(acc, do, m_i, l_i, k_t, v_t, s, seen, True)
    else:
        acc, m_i, l_i = _online_softmax(acc, m_i, l_i, s, v_t)
    return acc, m_i, l_i


@triton.jit
def _query_tile_walk(
    acc, m_i, l_i,  # forward: output [M, D], running row max and sum [M]; dQ: dq [M, D], the rows' LSE and delta
    q, q_pos, q_bound, do,  # the query tile [M, D], its positions and (DOCS) left bounds [M]; dQ: dO [M, D]
    KDesc, VDesc, k_base, v_base, KPos,  # the KV head's keys and values (k_base, v_base: its row 0)
    Walk, Columns,  # the QueryWalk; the ColumnWalk (COLUMNS; its counts with the walk's count strides)
    stride_ks, stride_vs,
    qk_scale, Sk, b, h, hk,
    blk, tile_off,  # the query block of the tile, its entry of the [B, H, nQB] walk tables
    STAGE: tl.constexpr, DQ: tl.constexpr,
    G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, HEAD_DIM: tl.constexpr, DOCS: tl.constexpr,
):  # fmt: skip
    """Stage STAGE of a query tile's walk (module docstring): 1 off-diagonal blocks, 2 the diagonal
    block, 3 vertical columns, 4 the block's own columns; returns the updated (acc, m_i, l_i)."""
    d = tl.arange(0, HEAD_DIM)
    if STAGE == 1:
        # off-diagonal: step j visits tile j % (G // BLOCK_N) of the (j // (G // BLOCK_N))-th listed block
        starts = Walk.starts + b * Walk.stride_sb + h * Walk.stride_sh + blk * Walk.stride_st
        if DOCS:
            plain = tl.load(Walk.unmasked + tile_off)  # the listed blocks inside every row's document
        else:
            plain = tl.load(Walk.count + tile_off)
        for j in range(0, plain * (G // BLOCK_N)):
            col0 = tl.load(starts + j // (G // BLOCK_N)) + (j % (G // BLOCK_N)) * BLOCK_N
            k = KDesc.load([b, col0, hk, 0]).reshape(BLOCK_N, HEAD_DIM)  # [N, D]
            v = VDesc.load([b, col0, hk, 0]).reshape(BLOCK_N, HEAD_DIM)  # [N, D]
            k_t = tl.trans(k)
            if DQ:
                v = tl.trans(v)
            acc, m_i, l_i = _query_tile_update(acc, m_i, l_i, q, do, k_t, v, tl.dot(q, k_t) * qk_scale, DQ)
        if DOCS:
            # the listed blocks that start before some row's document: keys below its bound are masked
            for j in range(plain * (G // BLOCK_N), tl.load(Walk.count + tile_off) * (G // BLOCK_N)):
                col0 = tl.load(starts + j // (G // BLOCK_N)) + (j % (G // BLOCK_N)) * BLOCK_N
                k = KDesc.load([b, col0, hk, 0]).reshape(BLOCK_N, HEAD_DIM)  # [N, D]
                v = VDesc.load([b, col0, hk, 0]).reshape(BLOCK_N, HEAD_DIM)  # [N, D]
                k_pos = tl.load(KPos + col0 + tl.arange(0, BLOCK_N))
                seen = k_pos[None, :] >= q_bound[:, None]
                acc, m_i, l_i = _masked_tile_update(
                    acc, m_i, l_i, q, do, tl.trans(k), tl.trans(v), seen, qk_scale, DQ
                )  # fmt: skip
    elif STAGE == 2:
        # diagonal: G // BLOCK_N key tiles from local key row diag (-1: the diagonal is not selected)
        diag = tl.load(Walk.diag + tile_off)
        if diag >= 0:
            for sub in tl.static_range(G // BLOCK_N):
                cols = diag + sub * BLOCK_N + tl.arange(0, BLOCK_N)
                col_ok = cols < Sk
                k_pos = tl.load(KPos + cols, mask=col_ok, other=INT_MAX)
                k_t = _load_t(k_base, cols, col_ok, stride_ks, d)
                v_t = _load_t(v_base, cols, col_ok, stride_vs, d)
                seen = _visible(q_pos, k_pos, q_bound, DOCS)
                acc, m_i, l_i = _masked_tile_update(acc, m_i, l_i, q, do, k_t, v_t, seen, qk_scale, DQ)
    elif STAGE == 3:
        # vertical: BLOCK_V at a time of the n columns (ascending) the block may see
        q_block = tl.load(Walk.q_gblock + blk)
        n = tl.load(Walk.vcount + tile_off)
        vcols_row = Walk.vcols + b * Walk.stride_wb + h * Walk.stride_wh
        mask_row = Walk.diag_mask + b * Walk.stride_mb + h * Walk.stride_mh
        if DOCS:
            first = tl.load(Walk.vfirst + tile_off)  # columns before every row's document are skipped
        else:
            first = 0
        for c in range(first, n, BLOCK_V):
            cols, k_pos, use = _vertical_tile(c + tl.arange(0, BLOCK_V), n, vcols_row, KPos, mask_row, q_block, G)
            k_t = _load_t(k_base, cols, use, stride_ks, d)  # [D, V]
            v_t = _load_t(v_base, cols, use, stride_vs, d)
            seen = _visible(q_pos, k_pos, q_bound, DOCS)
            acc, m_i, l_i = _masked_tile_update(acc, m_i, l_i, q, do, k_t, v_t, seen, qk_scale, DQ)
    else:
        # the block's own columns: BLOCK_V at a time of the n listed (all before the block's first row)
        n = tl.load(Columns.count + tile_off)
        col_row = Columns.rows + b * Columns.stride_xb + h * Columns.stride_xh + blk * Columns.stride_xt
        for c in range(0, n, BLOCK_V):
            idx = c + tl.arange(0, BLOCK_V)
            use = idx < n
            cols = tl.load(col_row + idx, mask=use, other=0)
            k_pos = tl.load(KPos + cols, mask=use, other=INT_MAX)
            k_t = _load_t(k_base, cols, use, stride_ks, d)  # [D, V]
            seen = _visible(q_pos, k_pos, q_bound, DOCS)
            if DOCS:
                v_t = _load_t(v_base, cols, use, stride_vs, d)
                acc, m_i, l_i = _masked_tile_update(acc, m_i, l_i, q, do, k_t, v_t, seen, qk_scale, DQ)
            else:  # every row of the block sees every listed column: the mask only drops padding
                v = _load_v(v_base, cols, use, stride_vs, d, DQ)
                s = tl.where(seen, tl.dot(q, k_t) * qk_scale, float("-inf"))
                acc, m_i, l_i = _query_tile_update(acc, m_i, l_i, q, do, k_t, v, s, DQ)
    return acc, m_i, l_i


@triton.heuristics({"DOCS": given("QBound"), "COLUMNS": given("Columns")})
@triton.jit
def _fwd_kernel(
    Q: HeadTensor, K: HeadTensor, V: HeadTensor,  # [B, Sq, H, D], [B, Sk, Hkv, D], [B, Sk, Hkv, D]
    KDesc, VDesc,  # K and V as tensor descriptors of [1, BLOCK_N, 1, D] tiles
    Out: HeadTensor, Stats: RowStats,  # [B, Sq, H, D]; the LSE [B, H, Sq] f32 (both read too with MERGE)
    QPos, KPos,  # global positions [Sq], [Sk]
    Walk: QueryWalk, Columns: ColumnWalk,  # index.py; Columns None: no per-block columns
    QBound, stride_bb,  # the rows' left bounds [B, Sq] and their batch stride; None: no documents
    qk_scale, Sq, Sk, H, GROUP,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    HEAD_DIM: tl.constexpr, MERGE: tl.constexpr, DOCS: tl.constexpr, COLUMNS: tl.constexpr,
):  # fmt: skip
    """(out, lse) of one query tile; MERGE: Out/Lse already hold a partial result over other keys
    (an earlier ring step) and this tile's result is merged into them by LSE, in place."""
    tile, b, h, hk, rows, row_ok, d = _query_tile(Sq, H, GROUP, BLOCK_M, HEAD_DIM)
    q = tl.load(
        Q.ptr + b * Q.stride_b + rows[:, None] * Q.stride_s + h * Q.stride_h + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    q_pos = tl.load(QPos + rows, mask=row_ok, other=-1)
    q_bound = _row_bounds(QBound, b, rows, row_ok, stride_bb, q_pos, DOCS)
    k_base = K.ptr + b * K.stride_b + hk * K.stride_h
    v_base = V.ptr + b * V.stride_b + hk * V.stride_h
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    blk = tile // (G // BLOCK_M)
    tile_off = b * Walk.stride_cb + h * Walk.stride_ch + blk
    # off-diagonal blocks, the diagonal block, vertical columns (and the block's own columns)
    for stage in tl.static_range(1, 5 if COLUMNS else 4):
        acc, m_i, l_i = _query_tile_walk(
            acc, m_i, l_i, q, q_pos, q_bound, None,
            KDesc, VDesc, k_base, v_base, KPos, Walk, Columns,
            K.stride_s, V.stride_s, qk_scale, Sk, b, h, hk, blk, tile_off,
            stage, False, G, BLOCK_N, BLOCK_V, HEAD_DIM, DOCS,
        )  # fmt: skip

    # epilogue: normalise; with MERGE, fold into the earlier (out, lse) by LSE weights
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) / _LOG2E)
    out_ptr = Out.ptr + b * Out.stride_b + rows[:, None] * Out.stride_s + h * Out.stride_h + d[None, :]
    lse_ptr = Stats.lse + b * Stats.stride_b + h * Stats.stride_h + rows
    if MERGE:
        prev_lse = tl.load(lse_ptr, mask=row_ok, other=float("-inf"))
        prev_out = tl.load(out_ptr, mask=row_ok[:, None], other=0.0).to(tl.float32)
        top = tl.maximum(prev_lse, lse)
        top_safe = tl.where(top == float("-inf"), 0.0, top)
        w_prev = tl.exp(prev_lse - top_safe)
        w_new = tl.exp(lse - top_safe)
        total = w_prev + w_new
        out = (prev_out * w_prev[:, None] + out * w_new[:, None]) / tl.where(total == 0.0, 1.0, total)[:, None]
        lse = tl.where(top == float("-inf"), float("-inf"), top_safe + tl.log(tl.where(total == 0.0, 1.0, total)))
    tl.store(out_ptr, out.to(Out.ptr.dtype.element_ty), mask=row_ok[:, None])  # type: ignore[attr-defined]
    tl.store(lse_ptr, lse, mask=row_ok)


@triton.heuristics({"DOCS": given("QBound"), "COLUMNS": given("Columns")})
@triton.jit
def _bwd_dq_kernel(
    Q: HeadTensor, K: HeadTensor, V: HeadTensor,  # [B, Sq, H, D], [B, Sk, Hkv, D], [B, Sk, Hkv, D]
    KDesc, VDesc,  # K and V as tensor descriptors of [1, BLOCK_N, 1, D] tiles
    DO: HeadTensor, Stats: RowStats,  # [B, Sq, H, D]; the LSE and delta [B, H, Sq] f32
    DQ,  # [B, Sq, H, D] with Q's strides
    QPos, KPos,  # global positions [Sq], [Sk]
    Walk: QueryWalk, Columns: ColumnWalk,  # index.py; Columns None: no per-block columns
    QBound, stride_bb,  # the rows' left bounds [B, Sq] and their batch stride; None: no documents
    qk_scale, sm_scale, Sq, Sk, H, GROUP,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOCS: tl.constexpr, COLUMNS: tl.constexpr,
):  # fmt: skip
    """dQ of one query tile over the same walk as the forward."""
    tile, b, h, hk, rows, row_ok, d = _query_tile(Sq, H, GROUP, BLOCK_M, HEAD_DIM)
    q_off = b * Q.stride_b + rows[:, None] * Q.stride_s + h * Q.stride_h + d[None, :]
    q = tl.load(Q.ptr + q_off, mask=row_ok[:, None], other=0.0)
    do, lse2, delta = _load_do_lse_delta(DO, Stats, b, h, rows, row_ok, d)
    q_pos = tl.load(QPos + rows, mask=row_ok, other=-1)
    q_bound = _row_bounds(QBound, b, rows, row_ok, stride_bb, q_pos, DOCS)
    k_base = K.ptr + b * K.stride_b + hk * K.stride_h
    v_base = V.ptr + b * V.stride_b + hk * V.stride_h
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    blk = tile // (G // BLOCK_M)
    tile_off = b * Walk.stride_cb + h * Walk.stride_ch + blk
    # off-diagonal blocks, the diagonal block, vertical columns (and the block's own columns)
    for stage in tl.static_range(1, 5 if COLUMNS else 4):
        dq, lse2, delta = _query_tile_walk(
            dq, lse2, delta, q, q_pos, q_bound, do,
            KDesc, VDesc, k_base, v_base, KPos, Walk, Columns,
            K.stride_s, V.stride_s, qk_scale, Sk, b, h, hk, blk, tile_off,
            stage, True, G, BLOCK_N, BLOCK_V, HEAD_DIM, DOCS,
        )  # fmt: skip
    tl.store(DQ + q_off, dq * sm_scale, mask=row_ok[:, None])


# ---------------------------------------------------------------------------------------------------
# dK/dV: one key tile [BLOCK_N or BLOCK_V, D] walks its query tiles.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _dkdv_step(
    dk, dv, k, v, k_pos,  # the key tile: dK, dV [N, D] f32, keys and values [N, D], positions [N]
    Q, DO, Stats, QPos, DQ, row0, b, h,  # the query tile: rows row0 .. row0 + BLOCK_M - 1 of head h
    QBound, stride_bb,  # DOCS: the rows' left bounds [B, Sq]
    qk_scale, sm_scale, Sq,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, MASK: tl.constexpr, DQ_MODE: tl.constexpr, DOCS: tl.constexpr,
):  # fmt: skip
    """Accumulate dK/dV of one key tile against one query tile of head h.

    Rows past Sq load lse = +inf, so they add nothing (and their dQ is exactly 0); MASK applies
    the test of ``_visible`` (with DOCS the rows' document bounds too) to P and dS themselves, not to the
    scores: a row that sees a non-finite key has a NaN LSE or delta, and its pairs the mask drops must
    still add exactly 0. DQ_MODE 1 also adds this tile's dQ = dS K into the float32 DQ (Q's strides)
    atomically, from K with its non-finite entries zeroed (the caller's); 0 leaves dQ to its own kernel. Scores are formed query-major (S = Q K^T, dP = dO V^T,
    K and V as the shared-memory operand) and transposed for dV += P^T dO and dK += dS^T Q
    (BENCHMARKS.md, kernel variants: the key-major S^T = K Q^T is slower).

    The row loads of ``_load_do_lse_delta`` and the test of ``_visible`` are written out here: as
    calls they change the dK/dV kernels' SASS (ptxas schedules around the debug scopes of inlined
    calls, DEVELOPERS.md), which would have to be timed on a GPU first.
    """
    d = tl.arange(0, HEAD_DIM)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < Sq
    q_off = b * Q.stride_b + rows[:, None] * Q.stride_s + h * Q.stride_h + d[None, :]
    q = tl.load(Q.ptr + q_off, mask=row_ok[:, None], other=0.0)  # [M, D]
    do = tl.load(
        DO.ptr + b * DO.stride_b + rows[:, None] * DO.stride_s + h * DO.stride_h + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    lse = tl.load(Stats.lse + b * Stats.stride_b + h * Stats.stride_h + rows, mask=row_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)
    delta = tl.load(Stats.delta + b * Stats.stride_b + h * Stats.stride_h + rows, mask=row_ok, other=0.0)
    p = tl.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None])  # [M, N]
    if MASK:
        q_pos = tl.load(QPos + rows, mask=row_ok, other=-1)
        seen = k_pos[None, :] <= q_pos[:, None]
        if DOCS:
            q_bound = tl.load(QBound + b * stride_bb + rows, mask=row_ok, other=0)
            seen = seen & (k_pos[None, :] >= q_bound[:, None])
        p = tl.where(seen, p, 0.0)
    dv += tl.dot(tl.trans(p.to(do.dtype)), do)
    ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])  # [M, N]
    if MASK:
        ds = tl.where(seen, ds, 0.0)
    ds = ds.to(q.dtype)
    dk += tl.dot(tl.trans(ds), q)
    if DQ_MODE == 1:
        dq = tl.dot(ds, k) * sm_scale
        tl.atomic_add(DQ + q_off, dq, mask=row_ok[:, None], sem="relaxed")
    return dk, dv


@triton.heuristics({"DOCS": given("QBound")})
@triton.jit
def _bwd_dkdv_block_kernel(
    Q: HeadTensor, K: HeadTensor, V: HeadTensor,  # [B, Sq, H, D], [B, Sk, Hkv, D], [B, Sk, Hkv, D]
    DO: HeadTensor, Stats: RowStats,  # [B, Sq, H, D]; the LSE and delta [B, H, Sq] f32
    Grads: KeyGrads, DQ,  # dK, dV [B, Sk, Hkv, D] f32; DQ (DQ_MODE 1) [B, Sq, H, D] f32 with Q's strides
    QPos, KPos,  # global positions [Sq], [Sk]
    Walk: KeyWalk,  # index.py
    QBound, stride_bb,  # the rows' left bounds [B, Sq] and their batch stride; None: no documents
    qk_scale, sm_scale, Sq, Sk, H, GROUP,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DQ_MODE: tl.constexpr, DOCS: tl.constexpr,
):  # fmt: skip
    """dK/dV (float32) of one key tile's block part, over the query heads of its GQA group."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    hkv_count = H // GROUP
    b = bh // hkv_count
    hk = bh % hkv_count
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < Sk
    d = tl.arange(0, HEAD_DIM)
    # the key tile [BLOCK_N, D], its values and positions
    k = tl.load(
        K.ptr + b * K.stride_b + cols[:, None] * K.stride_s + hk * K.stride_h + d[None, :],
        mask=col_ok[:, None],
        other=0.0,
    )
    v = tl.load(
        V.ptr + b * V.stride_b + cols[:, None] * V.stride_s + hk * V.stride_h + d[None, :],
        mask=col_ok[:, None],
        other=0.0,
    )
    k_pos = tl.load(KPos + cols, mask=col_ok, other=INT_MAX)
    if DQ_MODE == 1:  # dQ = dS K: the zero dS of a masked pair must not meet a non-finite key
        k = _finite(k)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    blk = tile // (G // BLOCK_N)
    for g in range(0, GROUP):  # the query heads that share this KV head
        h = hk * GROUP + g
        tile_off = b * Walk.stride_cb + h * Walk.stride_ch + blk
        starts = Walk.starts + b * Walk.stride_sb + h * Walk.stride_sh + blk * Walk.stride_st
        # off-diagonal: step j visits query tile j % (G // BLOCK_M) of the (j // (G // BLOCK_M))-th listed
        # block (rows past Sq of a last, partial block add nothing)
        if DOCS:
            plain = tl.load(Walk.unmasked + tile_off)  # the listed blocks whose rows' documents hold every key
        else:
            plain = tl.load(Walk.count + tile_off)
        for j in range(0, plain * (G // BLOCK_M)):
            row0 = tl.load(starts + j // (G // BLOCK_M)) + (j % (G // BLOCK_M)) * BLOCK_M
            dk, dv = _dkdv_step(
                dk, dv, k, v, k_pos, Q, DO, Stats, QPos, DQ, row0, b, h, QBound, stride_bb, qk_scale, sm_scale, Sq,
                BLOCK_M, HEAD_DIM, False, DQ_MODE, DOCS,
            )  # fmt: skip
        if DOCS:
            # the listed blocks with rows whose document starts after some of these keys: masked
            for j in range(plain * (G // BLOCK_M), tl.load(Walk.count + tile_off) * (G // BLOCK_M)):
                row0 = tl.load(starts + j // (G // BLOCK_M)) + (j % (G // BLOCK_M)) * BLOCK_M
                dk, dv = _dkdv_step(
                    dk, dv, k, v, k_pos, Q, DO, Stats, QPos, DQ, row0, b, h, QBound, stride_bb, qk_scale, sm_scale,
                    Sq, BLOCK_M, HEAD_DIM, True, DQ_MODE, DOCS,
                )  # fmt: skip
        # diagonal: G // BLOCK_M query tiles from local query row diag (-1: the diagonal is not selected)
        diag = tl.load(Walk.diag + tile_off)
        if diag >= 0:
            for sub in tl.static_range(G // BLOCK_M):
                dk, dv = _dkdv_step(
                    dk, dv, k, v, k_pos, Q, DO, Stats, QPos, DQ, diag + sub * BLOCK_M, b, h, QBound, stride_bb,
                    qk_scale, sm_scale, Sq, BLOCK_M, HEAD_DIM, True, DQ_MODE, DOCS,
                )  # fmt: skip
    out_off = b * Grads.stride_b + cols[:, None] * Grads.stride_s + hk * Grads.stride_h + d[None, :]
    tl.store(Grads.dk + out_off, dk * sm_scale, mask=col_ok[:, None])
    tl.store(Grads.dv + out_off, dv, mask=col_ok[:, None])


@triton.heuristics({"DOCS": given("QBound")})
@triton.jit(do_not_specialize=["VWIDTH"])
def _bwd_dkdv_vertical_kernel(
    Q: HeadTensor, K: HeadTensor, V: HeadTensor,  # [B, Sq, H, D], [B, Sk, Hkv, D], [B, Sk, Hkv, D]
    DO: HeadTensor, Stats: RowStats,  # [B, Sq, H, D]; the LSE and delta [B, H, Sq] f32
    Grads: KeyGrads, DQ,  # dK, dV [B, Sk, Hkv, D] f32 (added to); DQ (DQ_MODE 1) as in the block kernel
    QPos, KPos,  # global positions [Sq], [Sk]
    Walk: KeyWalk,  # its diag_mask, vcols (padding: Sk), vstart and (DOCS) vend
    QBound, stride_bb,  # the rows' left bounds [B, Sq] and their batch stride; None: no documents
    qk_scale, sm_scale, Sq, Sk, H, GROUP,
    NQT, VWIDTH, SPLIT,  # query tiles, width of Walk.vcols, query tiles per program
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, HEAD_DIM: tl.constexpr,
    DQ_MODE: tl.constexpr, DOCS: tl.constexpr,
):  # fmt: skip
    """dK/dV of one chunk of a head's vertical columns (those not covered by a selected diagonal),
    against the query tiles [split * SPLIT, (split + 1) * SPLIT): the rows are split over programs
    (grid axis 2) so that a few long columns keep the whole GPU busy; partial sums add atomically.
    Walk.vstart: the first query row that may see each chunk of BLOCK_V columns; Walk.vend (DOCS): the
    end of the rows whose document reaches the chunk's last column."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    split = tl.program_id(2)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    idx = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    cols = tl.load(Walk.vcols + b * Walk.stride_wb + h * Walk.stride_wh + idx, mask=idx < VWIDTH, other=Sk)
    valid = cols < Sk
    cols = tl.where(valid, cols, 0)
    d = tl.arange(0, HEAD_DIM)
    # the chunk's columns as a key tile [BLOCK_V, D], its values and positions
    k = tl.load(
        K.ptr + b * K.stride_b + cols[:, None] * K.stride_s + hk * K.stride_h + d[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    v = tl.load(
        V.ptr + b * V.stride_b + cols[:, None] * V.stride_s + hk * V.stride_h + d[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    k_pos = tl.load(KPos + cols, mask=valid, other=INT_MAX)
    if DQ_MODE == 1:  # dQ = dS K: the zero dS of a masked pair must not meet a non-finite key
        k = _finite(k)
    k_block = k_pos // G
    mask_row = Walk.diag_mask + b * Walk.stride_mb + h * Walk.stride_mh
    dk = tl.zeros([BLOCK_V, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_V, HEAD_DIM], dtype=tl.float32)
    t_lo = tl.maximum(tl.load(Walk.vstart + b * Walk.stride_tb + h * Walk.stride_th + chunk) // BLOCK_M, split * SPLIT)
    t_hi = tl.minimum(NQT, (split + 1) * SPLIT)
    if DOCS:  # rows past the chunk's last document see none of its columns
        t_hi = tl.minimum(t_hi, tl.cdiv(tl.load(Walk.vend + b * Walk.stride_tb + h * Walk.stride_th + chunk), BLOCK_M))
    if t_lo < t_hi:
        for t in range(t_lo, t_hi):  # query tile t: rows t * BLOCK_M .. + BLOCK_M - 1
            q_block = tl.load(QPos + t * BLOCK_M) // G  # runs of G aligned positions: one block per tile
            k_pos_use = tl.where(_uncovered(mask_row, q_block, k_block, valid), k_pos, INT_MAX)
            dk, dv = _dkdv_step(
                dk, dv, k, v, k_pos_use, Q, DO, Stats, QPos, DQ, t * BLOCK_M, b, h, QBound, stride_bb, qk_scale,
                sm_scale, Sq, BLOCK_M, HEAD_DIM, True, DQ_MODE, DOCS,
            )  # fmt: skip
        out_off = b * Grads.stride_b + cols[:, None] * Grads.stride_s + hk * Grads.stride_h + d[None, :]
        tl.atomic_add(Grads.dk + out_off, dk * sm_scale, mask=valid[:, None])
        tl.atomic_add(Grads.dv + out_off, dv, mask=valid[:, None])


@triton.heuristics({"DOCS": given("QBound")})
@triton.jit(do_not_specialize=["NCHUNK"])
def _bwd_dkdv_column_kernel(
    Q: HeadTensor, K: HeadTensor, V: HeadTensor,  # [B, Sq, H, D], [B, Sk, Hkv, D], [B, Sk, Hkv, D]
    DO: HeadTensor, Stats: RowStats,  # [B, Sq, H, D]; the LSE and delta [B, H, Sq] f32
    Grads: KeyGrads, DQ,  # dK, dV [B, Sk, Hkv, D] f32 (added to); DQ (DQ_MODE 1) as in the block kernel
    QPos, KPos,  # global positions [Sq], [Sk]
    Columns: ColumnWalk,  # index.py: [B, H, nQB, K] local key rows, [B, H, nQB] counts
    QBound, stride_bb,  # the rows' left bounds [B, Sq] and their batch stride; None: no documents
    qk_scale, sm_scale, Sq, Sk, H, GROUP,
    NCHUNK,  # chunks of BLOCK_V columns per query block: cdiv(K, BLOCK_V)
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, HEAD_DIM: tl.constexpr,
    DQ_MODE: tl.constexpr, DOCS: tl.constexpr,
):  # fmt: skip
    """dK/dV of one chunk of BLOCK_V of a query block's own columns against the block's G // BLOCK_M query
    tiles (local rows blk * G ..: aligned runs); added atomically, since blocks share column keys."""
    blk = tl.program_id(0) // NCHUNK
    chunk = tl.program_id(0) % NCHUNK
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    n = tl.load(Columns.count + b * Columns.stride_cb + h * Columns.stride_ch + blk)
    if chunk * BLOCK_V < n:
        idx = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
        valid = idx < n
        cols = tl.load(
            Columns.rows + b * Columns.stride_xb + h * Columns.stride_xh + blk * Columns.stride_xt + idx,
            mask=valid,
            other=0,
        )
        d = tl.arange(0, HEAD_DIM)
        # the chunk's columns as a key tile [BLOCK_V, D], its values and positions (INT_MAX: padding)
        k = tl.load(
            K.ptr + b * K.stride_b + cols[:, None] * K.stride_s + hk * K.stride_h + d[None, :],
            mask=valid[:, None],
            other=0.0,
        )
        v = tl.load(
            V.ptr + b * V.stride_b + cols[:, None] * V.stride_s + hk * V.stride_h + d[None, :],
            mask=valid[:, None],
            other=0.0,
        )
        k_pos = tl.load(KPos + cols, mask=valid, other=INT_MAX)
        if DQ_MODE == 1:  # dQ = dS K: the zero dS of a masked pair must not meet a non-finite key
            k = _finite(k)
        dk = tl.zeros([BLOCK_V, HEAD_DIM], dtype=tl.float32)
        dv = tl.zeros([BLOCK_V, HEAD_DIM], dtype=tl.float32)
        for sub in tl.static_range(G // BLOCK_M):  # rows past Sq of a partial last block add nothing
            dk, dv = _dkdv_step(
                dk, dv, k, v, k_pos, Q, DO, Stats, QPos, DQ, blk * G + sub * BLOCK_M, b, h, QBound, stride_bb,
                qk_scale, sm_scale, Sq, BLOCK_M, HEAD_DIM, True, DQ_MODE, DOCS,
            )  # fmt: skip
        out_off = b * Grads.stride_b + cols[:, None] * Grads.stride_s + hk * Grads.stride_h + d[None, :]
        tl.atomic_add(Grads.dk + out_off, dk * sm_scale, mask=valid[:, None])
        tl.atomic_add(Grads.dv + out_off, dv, mask=valid[:, None])


@triton.jit
def _row_delta_kernel(
    DO, Out, Delta,  # [B, S, H, D], [B, S, H, D], [B, H, S] f32
    R, H, S,  # R = B * S * H rows, row = (b, s, h)
    stride_dob, stride_dos, stride_doh,
    stride_deltab, stride_deltah,
    stride_ob, stride_os, stride_oh,
    BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """Delta[b, h, s] = sum_d dO * O in float32 for BLOCK_R rows."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < R
    b = rows // (S * H)
    s = (rows // H) % S
    h = rows % H
    d = tl.arange(0, HEAD_DIM)
    do = tl.load(
        DO + (b * stride_dob + s * stride_dos + h * stride_doh)[:, None] + d[None, :], mask=ok[:, None], other=0.0
    )
    o = tl.load(
        Out + (b * stride_ob + s * stride_os + h * stride_oh)[:, None] + d[None, :], mask=ok[:, None], other=0.0
    )
    tl.store(
        Delta + b * stride_deltab + h * stride_deltah + s, tl.sum(do.to(tl.float32) * o.to(tl.float32), 1), mask=ok
    )

"""The sorted column scorer (column_buckets.py) by a Triton kernel: the CUDA path of ``column_scorer: sorted``.

Per table, the rows of a chunk of query blocks are sorted by code and cut into *tiles*: up to BLOCK_M rows
of one bucket (``row_tiles``). All rows of a tile meet keys of the same bucket, each a window of the
table's keys sorted by (code, position) (``row_windows``), so a tile walks the union of its rows' windows
in steps of BLOCK_N sorted keys: the keys are gathered by position and scored against the tile's rows with
one tensor-core product, every key met by some row of the tile. A pair counts if it lies in its row's
window, is no vertical, is on no selected block diagonal and lies in no earlier table's window of its row
(a pair met in several tables counts once). Its weight exp2(s - lse2) is added to its block's score of its
key atomically, since the tables and tiles of one block's rows run in different programs; the sums are
therefore equal to the torch scorer's up to float rounding, in an order that may change from run to run.

``_bucket_score_kernel``, program (tile slot, (b * heads + h) * T + t): the tile's rows [BLOCK_M, D], their
base-2 LSE over the pattern and their windows stay in registers; scores are base 2 (``qk_scale`` includes
log2(e)), as in ops/sparse/kernels.py. The launcher takes the rows' LSE from the sparse forward on the
pattern and scores the query heads and blocks in chunks whose scores stay under ``SCORE_BYTES``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..documents import Documents
from ..pattern.vertical_slash import VerticalSlashPattern, compact
from ..sparse.kernels import LOG2E, HeadTensor, PerHead, RowStats
from .column_buckets import check_cap, row_windows, sort_keys
from .column_kernels import scorer_inputs
from .hashing import hashed_heads

_LOG2E = tl.constexpr(LOG2E)
SCORE_BYTES = 512 << 20  # float32 scores held at once per chunk of query heads and blocks
BLOCK_N = 64


@triton.jit
def _bucket_score_kernel(
    Q: HeadTensor, K: HeadTensor,  # queries [B, Sq, H, D], the whole sequence's keys [B, N, Hkv, D]
    Stats: RowStats, QPos,  # the rows' LSE [B, H, Sq] f32 (natural log), positions [Sq]
    RowOrder, TileStart,  # int32 [B, Hc, T, R]: the chunk's rows by (code, row); [B, Hc, T, S]: tiles' first
    RowCodes, Lo, Hi, First,  # int32 [B, Hc, T, R] by row: code, window [Lo, Hi) in KeyOrder, first position
    KeyOrder, KeyCodes,  # int32 [B, Hc, T, N]: key positions by (code, position); codes by position
    VMask: PerHead, DiagMask: PerHead,  # int8 [B, H, N], [B, H, nb]: the pattern's verticals and block diagonals
    Score: PerHead,  # f32 [B, Hc, R // G, N], zero where no pair adds
    qk_scale, R, N, S, HC, H0, GROUP, row0,  # HC heads from H0; row0: the chunk's first row of q
    T: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """Adds the pairs of one tile (up to BLOCK_M rows of one bucket of table t) to their blocks' scores."""
    slot = tl.program_id(0)
    bht = tl.program_id(1)
    t = bht % T
    bh = bht // T
    b = bh // HC
    h = H0 + bh % HC  # the query head in q, the LSE and the pattern
    hk = h // GROUP
    tile = TileStart + bht * S
    start = tl.load(tile + slot)
    if start < R:  # slots past the last tile hold R
        end = tl.load(tile + slot + 1, mask=slot + 1 < S, other=R)
        i = start + tl.arange(0, BLOCK_M)
        valid = i < end
        lr = tl.load(RowOrder + bht * R + i, mask=valid, other=0)  # the chunk's rows
        lo = tl.load(Lo + bht * R + lr, mask=valid, other=0)
        hi = tl.load(Hi + bht * R + lr, mask=valid, other=0)  # invalid rows: empty windows
        row = row0 + lr
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(
            Q.ptr + b * Q.stride_b + row[:, None] * Q.stride_s + h * Q.stride_h + d[None, :],
            mask=valid[:, None],
            other=0.0,
        )
        # base-2 LSE; +inf where the pattern leaves a row no key: p = 0, the row adds nothing
        lse = tl.load(Stats.lse + b * Stats.stride_b + h * Stats.stride_h + row, mask=valid, other=float("inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)
        q_block = tl.load(QPos + row, mask=valid, other=0) // G
        out = Score.ptr + b * Score.stride_b + (bh % HC) * Score.stride_h + (lr // G)[:, None] * Score.stride_x
        k_base = K.ptr + b * K.stride_b + hk * K.stride_h
        v_row = VMask.ptr + b * VMask.stride_b + h * VMask.stride_h
        mask_row = DiagMask.ptr + b * DiagMask.stride_b + h * DiagMask.stride_h
        order = KeyOrder + bht * N
        walk_lo = tl.min(tl.where(lo < hi, lo, 2147483647), 0)
        walk_hi = tl.max(hi, 0)
        for k0 in range(walk_lo, walk_hi, BLOCK_N):
            # a step no row's window reaches (windows of rows far apart) loads nothing
            if tl.max(((lo < k0 + BLOCK_N) & (hi > k0)).to(tl.int32), 0) > 0:
                kidx = k0 + tl.arange(0, BLOCK_N)
                kpos = tl.load(order + kidx, mask=kidx < walk_hi, other=0)
                k_t = tl.load(k_base + kpos[None, :] * K.stride_s + d[:, None])  # [D, BLOCK_N]
                s = tl.dot(q, k_t) * qk_scale
                take = (kidx[None, :] >= lo[:, None]) & (kidx[None, :] < hi[:, None])
                take = take & (tl.load(v_row + kpos) == 0)[None, :]  # verticals: kept by the pattern
                diag = q_block[:, None] - kpos[None, :] // G  # >= 1 in every window
                take = take & (tl.load(mask_row + diag, mask=take, other=1) == 0)
                for tp in range(0, t):  # a pair an earlier table's window holds counted there
                    earlier = (bh * T + tp) * R + lr
                    code = tl.load(RowCodes + earlier, mask=valid, other=0)
                    first = tl.load(First + earlier, mask=valid, other=0)
                    k_code = tl.load(KeyCodes + (bh * T + tp) * N + kpos)
                    take = take & ((code[:, None] != k_code[None, :]) | (kpos[None, :] < first[:, None]))
                p = tl.exp2(s - lse2[:, None])
                tl.atomic_add(out + kpos[None, :], p, mask=take, sem="relaxed")


def row_tiles(codes: Tensor, block_m: int, bits: int) -> tuple[Tensor, Tensor]:
    """The tiles of rows with codes int32 [B, H, T, R]: (int32 [B, H, T, R]: each table's rows sorted by
    (code, row); int32 [B, H, T, S]: where each tile starts in that order, ascending, padded with R). A tile
    is up to ``block_m`` consecutive rows of one code, so tiles cover every row once; S bounds their count
    without a device sync (at most ceil(R / block_m) + one per code present)."""
    r = codes.shape[-1]
    by_code, order = codes.sort(dim=-1, stable=True)
    index = torch.arange(r, device=codes.device).expand_as(by_code)
    new = torch.ones_like(by_code, dtype=torch.bool)
    new[..., 1:] = by_code[..., 1:] != by_code[..., :-1]
    run_start = torch.where(new, index, 0).cummax(-1).values
    first = (index - run_start) % block_m == 0
    slots = min(r, triton.cdiv(r, block_m) + min(r, 1 << bits))
    starts, _ = compact(index, first, fill=r, width=slots)
    return order.to(torch.int32).contiguous(), starts


def column_scores_sorted_triton(
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
    score_bytes: int = SCORE_BYTES,
) -> Iterator[tuple[Tensor, slice, Tensor]]:
    """The blocks' column scores by ``_bucket_score_kernel``, per chunk of query heads and whole query blocks
    of at most ``score_bytes`` of scores (as many blocks as fit first): (float32 [B, heads, blocks, N], which
    heads, int64 [blocks]: which global blocks, in q's order). Arguments as ``select_block_columns``, checked
    as ``column_kernels.scorer_inputs`` says (which also gives the rows' LSE over the pattern).

    A row the pattern leaves without keys (never one of an estimated pattern, which keeps the local window)
    adds nothing, nor do rows from ``documents.estimate_end`` on.
    """
    b, sq, hq, d = q.shape
    n = k.shape[1]
    g = pattern.block_size
    check_cap(cap)
    q, k, q_pos, q_bound, lse, vmask, dmask = scorer_inputs(q, k, pattern, scale, q_pos, documents, bits)
    blocks = triton.cdiv(sq, g)
    per_chunk = max(1, min(blocks, score_bytes // (b * n * 4)))
    heads_per_chunk = max(1, min(hq, score_bytes // (b * per_chunk * n * 4)))
    for h0 in range(0, hq, heads_per_chunk):
        heads = slice(h0, min(h0 + heads_per_chunk, hq))
        hc = heads.stop - h0
        _, _, q_codes, k_codes = hashed_heads(q, k, tables, bits, seed, heads)
        keys = sort_keys(k_codes)
        for block0 in range(0, blocks, per_chunk):
            rows = slice(block0 * g, min((block0 + per_chunk) * g, sq))
            r = rows.stop - rows.start
            bound = None if q_bound is None else q_bound[:, rows]
            win = row_windows(keys, q_codes[:, :, rows], q_pos[rows], documents, bound, g, cap)
            block_m = min(64, max(16, triton.next_power_of_2(r >> bits)))  # about one bucket's rows
            row_order, tile_start = row_tiles(win.codes, block_m, bits)
            score = torch.zeros(b, hc, triton.cdiv(r, g), n, dtype=torch.float32, device=q.device)
            _bucket_score_kernel[(tile_start.shape[-1], b * hc * tables)](
                Q=HeadTensor.of(q),
                K=HeadTensor.of(k),
                Stats=RowStats.of(lse),
                QPos=q_pos,
                RowOrder=row_order,
                TileStart=tile_start,
                RowCodes=win.codes,
                Lo=win.lo,
                Hi=win.hi,
                First=win.first,
                KeyOrder=keys.order,
                KeyCodes=keys.codes,
                VMask=PerHead.of(vmask),
                DiagMask=PerHead.of(dmask),
                Score=PerHead.of(score),
                qk_scale=scale * LOG2E,
                R=r,
                N=n,
                S=tile_start.shape[-1],
                HC=hc,
                H0=h0,
                GROUP=hq // k.shape[2],
                row0=rows.start,
                T=tables,
                G=g,
                BLOCK_M=block_m,
                BLOCK_N=BLOCK_N,
                HEAD_DIM=d,
                num_warps=4,
            )
            yield score, heads, q_pos[rows.start : rows.stop : g].long() // g

"""The per-block column scores (block_columns.py) by a Triton kernel: the CUDA path of ``select_block_columns``.

``_column_score_kernel``, program (query block of the chunk, b * H + h): the block's G rows [G, D], their
base-2 LSE over the pattern [G] and (DOCS) document bounds [G] stay in registers while the program walks
the keys before the block's first row in tiles of BLOCK_N (from the first row's document start, rounded
down to a tile, with DOCS). A tile on a block diagonal the pattern selects is skipped (the pattern keeps
all of it); in the others a pair counts if its key shares a bucket with the row in some table, is no
vertical and (DOCS) lies in the row's document, weighing exp2(s - lse2). The tile's column sums over
the G rows are its scores: every (block, key) is written by one program, no atomics. Scores are base 2
(``qk_scale`` includes log2(e)), as in ops/sparse/kernels.py.

The launcher takes the rows' LSE from the sparse forward on the pattern and scores the query blocks in
chunks, so that the scores held at once stay under ``SCORE_BYTES``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..documents import Documents
from ..pattern.vertical_slash import VerticalSlashPattern
from ..sparse import attention_forward
from ..sparse.attention import check_backend_inputs
from ..sparse.index import check_aligned_positions
from ..sparse.kernels import LOG2E, HeadTensor, PerHead, RowStats, given
from ..sparse.launch import bound_args, unit_stride
from .hashing import hashed_heads

_LOG2E = tl.constexpr(LOG2E)
SCORE_BYTES = 256 << 20  # float32 scores held at once per chunk of query blocks


@triton.heuristics({"DOCS": given("QBound")})
@triton.jit
def _column_score_kernel(
    Q: HeadTensor, K: HeadTensor,  # queries [B, Sq, H, D], the whole sequence's keys [B, N, Hkv, D]
    Stats: RowStats, QPos,  # the rows' LSE [B, H, Sq] f32 (natural log), positions [Sq]
    QBound, stride_bb,  # the rows' bounds [B or 1, Sq] and their batch stride (0: one row for all); None: no documents
    QCodes: PerHead, KCodes: PerHead,  # int32 [B, H, T, Sq], [B, H, T, N]: table-major, a tile's codes in one load
    VMask: PerHead, DiagMask: PerHead,  # int8 [B, H, N], [B, H, nb]: the pattern's verticals and block diagonals
    Score: PerHead,  # f32 [B, H, blocks, N], zero where no tile writes
    qk_scale, Sq, H, GROUP, block0,  # block0: the chunk's first local query block
    TABLES: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOCS: tl.constexpr,
):  # fmt: skip
    """Scores of one query block of G rows (local block block0 + program 0) against the keys before it."""
    tl.static_assert(G % BLOCK_N == 0)
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    row0 = (block0 + blk) * G
    rows = row0 + tl.arange(0, G)
    row_ok = rows < Sq  # a partial last block
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        Q.ptr + b * Q.stride_b + rows[:, None] * Q.stride_s + h * Q.stride_h + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )  # [G, D]
    # base-2 LSE [G]; +inf where a row is past Sq or the pattern leaves it no key: p = 0, the row adds nothing
    lse = tl.load(Stats.lse + b * Stats.stride_b + h * Stats.stride_h + rows, mask=row_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)
    first = tl.load(QPos + row0)  # the block's first position: the keys before it are 0 .. first - 1
    q_block = first // G
    if DOCS:
        bound = tl.load(QBound + b * stride_bb + rows, mask=row_ok, other=0)  # [G], ascending with the rows
        lo = tl.load(QBound + b * stride_bb + row0) // BLOCK_N * BLOCK_N  # no row sees a key before its bound
    else:
        lo = 0
    k_base = K.ptr + b * K.stride_b + hk * K.stride_h
    qc_base = QCodes.ptr + b * QCodes.stride_b + h * QCodes.stride_h + rows
    kc_base = KCodes.ptr + b * KCodes.stride_b + h * KCodes.stride_h
    v_row = VMask.ptr + b * VMask.stride_b + h * VMask.stride_h
    mask_row = DiagMask.ptr + b * DiagMask.stride_b + h * DiagMask.stride_h
    score_row = Score.ptr + b * Score.stride_b + h * Score.stride_h + blk * Score.stride_x
    for col0 in range(lo, first, BLOCK_N):  # every key < first < N: no bounds mask
        # a tile lies in one key block (BLOCK_N divides G); on a selected block diagonal the pattern keeps it all
        if tl.load(mask_row + (q_block - col0 // G)) == 0:
            cols = col0 + tl.arange(0, BLOCK_N)
            k_t = tl.load(k_base + cols[None, :] * K.stride_s + d[:, None])  # [D, N]
            s = tl.dot(q, k_t) * qk_scale  # [G, N]
            mates = tl.zeros([G, BLOCK_N], dtype=tl.int1)
            for t in tl.static_range(TABLES):
                qc = tl.load(qc_base + t * QCodes.stride_x, mask=row_ok, other=0)  # [G]
                kc = tl.load(kc_base + t * KCodes.stride_x + cols)  # [N]
                mates = mates | (qc[:, None] == kc[None, :])
            take = mates & (tl.load(v_row + cols) == 0)[None, :]  # verticals: kept by the pattern
            if DOCS:
                take = take & (cols[None, :] >= bound[:, None])
            p = tl.where(take, tl.exp2(s - lse2[:, None]), 0.0)
            tl.store(score_row + cols, tl.sum(p, 0))


class ScorerInputs(NamedTuple):
    """What a Triton column scorer reads (``scorer_inputs``): q, k (unit stride along head_dim), q_pos int32,
    q_bound (documents) int32 [B or 1, Sq] or None, lse f32 [B, H, Sq] (natural log), vmask int8 [B, H, N],
    dmask int8 [B, H, nb]."""

    q: Tensor
    k: Tensor
    q_pos: Tensor
    q_bound: Tensor | None
    lse: Tensor
    vmask: Tensor
    dmask: Tensor


def scorer_inputs(
    q: Tensor,
    k: Tensor,
    pattern: VerticalSlashPattern,
    scale: float,
    q_pos: Tensor,
    documents: Documents | None,
    bits: int,
) -> ScorerInputs:
    """The inputs of a Triton column scorer, checked (the kernels' dtypes and head dims, a pattern without block
    columns, bits <= 31 for int32 codes, q_pos in ascending aligned runs of G), with the rows' LSE over the
    pattern from the sparse forward (Triton backend; +inf, so weight 0, on rows from ``documents.estimate_end``
    on) and the pattern's verticals and selected block diagonals as byte masks."""
    check_backend_inputs(q, k, k, "triton")
    if pattern.block_cols is not None:
        raise ValueError("the Triton column scorers score on a pattern without block columns (its lines)")
    if bits > 31:
        raise ValueError(f"the Triton column scorers hold hash codes in int32: bits must be <= 31, got {bits}")
    check_aligned_positions(q_pos, pattern.block_size, "q_pos")
    q, k = unit_stride(q, k)
    q_pos = q_pos.to(torch.int32).contiguous()
    q_bound = None if documents is None else documents.left_bounds(q_pos)
    k_pos = torch.arange(k.shape[1], dtype=torch.int32, device=q.device)
    _, lse = attention_forward(q, k, k, pattern, q_pos, k_pos, scale, backend="triton", q_bound=q_bound)
    if documents is not None and documents.estimate_end is not None:  # rows that do not estimate weigh 0
        lse.masked_fill_(q_pos >= documents.estimate_end, float("inf"))
    vmask = pattern.vertical_mask().to(torch.int8)
    return ScorerInputs(q, k, q_pos, q_bound, lse, vmask, pattern.diag_mask().to(torch.int8))


def column_scores_triton(
    q: Tensor,
    k: Tensor,
    pattern: VerticalSlashPattern,
    scale: float,
    q_pos: Tensor,
    documents: Documents | None,
    tables: int,
    bits: int,
    seed: int,
    score_bytes: int = SCORE_BYTES,
) -> Iterator[tuple[Tensor, slice, Tensor]]:
    """The blocks' column scores by ``_column_score_kernel``, per chunk of whole query blocks of at most
    ``score_bytes`` of scores: (float32 [B, H, blocks, N], every head, int64 [blocks]: which global blocks, in
    q's order). Arguments as ``select_block_columns``, checked as ``scorer_inputs`` says.

    Unlike the reference, a row the pattern leaves without keys (never one of an estimated pattern, which
    keeps the local window) adds nothing to its block's scores, nor do rows from ``documents.estimate_end`` on.
    """
    b, sq, hq, d = q.shape
    n = k.shape[1]
    g = pattern.block_size
    q, k, q_pos, q_bound, lse, vmask, dmask = scorer_inputs(q, k, pattern, scale, q_pos, documents, bits)
    _, _, q_codes, k_codes = hashed_heads(q, k, tables, bits, seed)
    q_codes = q_codes.to(torch.int32).transpose(-1, -2).contiguous()  # [B, H, T, Sq]
    k_codes = k_codes.to(torch.int32).transpose(-1, -2).contiguous()  # [B, H, T, N]
    blocks = triton.cdiv(sq, g)
    per_chunk = max(1, score_bytes // (b * hq * n * 4))
    for block0 in range(0, blocks, per_chunk):
        count = min(per_chunk, blocks - block0)
        score = torch.zeros(b, hq, count, n, dtype=torch.float32, device=q.device)
        _column_score_kernel[(count, b * hq)](
            Q=HeadTensor.of(q),
            K=HeadTensor.of(k),
            Stats=RowStats.of(lse),
            QPos=q_pos,
            **bound_args(q_bound),
            QCodes=PerHead.of(q_codes),
            KCodes=PerHead.of(k_codes),
            VMask=PerHead.of(vmask),
            DiagMask=PerHead.of(dmask),
            Score=PerHead.of(score),
            qk_scale=scale * LOG2E,
            Sq=sq,
            H=hq,
            GROUP=hq // k.shape[2],
            block0=block0,
            TABLES=tables,
            G=g,
            BLOCK_N=min(g, 64),
            HEAD_DIM=d,
            num_warps=4,
        )
        yield score, slice(None), q_pos[block0 * g : (block0 + count) * g : g].long() // g

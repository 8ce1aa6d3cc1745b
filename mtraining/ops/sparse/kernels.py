"""Triton kernels for vertical-slash sparse attention: forward (out, lse), dQ, dK/dV.

Each query tile visits (1) the unmasked key blocks of its selected off-diagonal block diagonals,
from a precomputed list per G-block of queries (kernel_index.py), in key tiles of BLOCK_N, (2) the
causal-diagonal block with a position mask, and (3) the vertical columns of the head gathered from
this key chunk, skipping any column whose block diagonal is already selected (so no pair counts
twice). The key tiles of part (1) in the forward and dQ kernels come through
tensor descriptors (TMA bulk copies on Hopper): 7-10% faster forward and 4% faster dQ on an H200
than pointer loads; the dK/dV kernel keeps pointer loads, which measured 15% faster there
(bench/results/kernel_variants.json). The backward recomputes P from Q, K and the saved LSE (FlashAttention-2 style): one kernel
for dQ (same walk as the forward), one for dK/dV of the block part (per key tile over the query
heads of its GQA group, from the per-key-block list), and one for dK/dV of the vertical columns
(per chunk of columns, added atomically since the query heads of a GQA group share keys). Scores
are kept in base 2 (``exp2``); the LSE written out is natural-log.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# The kernels take the widths and strides of their index lists as plain ints (do_not_specialize):
# the lists change size with every pattern and ring step, and specialising on them would recompile.
INT_MAX = tl.constexpr(2147483647)


@triton.jit
def _online_update(acc, m_i, l_i, s, v):
    """One online-softmax step on base-2 scores s [M, N] (-inf = masked) and values v [N, D]."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _vertical_use(cols_idx, n_vert, VColsRow, KPos, MaskRow, qB, G: tl.constexpr):
    """Gather one chunk of vertical columns: (local rows, positions, usable) for query block qB."""
    valid = cols_idx < n_vert
    cols = tl.load(VColsRow + cols_idx, mask=valid, other=0)
    k_pos = tl.load(KPos + cols, mask=valid, other=INT_MAX)
    k_blk = k_pos // G
    covered = tl.load(MaskRow + (qB - k_blk), mask=valid & (k_blk <= qB), other=0)
    use = valid & (covered == 0)
    return cols, tl.where(use, k_pos, INT_MAX), use


@triton.jit(do_not_specialize=["s_sb", "s_sh", "s_st", "s_wb", "s_wh"])
def _fwd_kernel(
    Q,
    K,
    V,
    KDesc,
    VDesc,
    Out,
    Lse,
    QPos,
    KPos,
    QGBlock,
    Starts,
    Count,
    DiagStart,
    DiagMask,
    VCols,
    VCountQ,
    qk_scale,
    Sq,
    Sk,
    H,
    GROUP,
    s_qb,
    s_qs,
    s_qh,
    s_kb,
    s_ks,
    s_kh,
    s_vb,
    s_vs,
    s_vh,
    s_ob,
    s_os,
    s_oh,
    s_lb,
    s_lh,
    s_sb,
    s_sh,
    s_st,
    s_cb,
    s_ch,
    s_mb,
    s_mh,
    s_wb,
    s_wh,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MERGE: tl.constexpr,
):
    """(out, lse) of one query tile; MERGE: Out/Lse already hold a partial result over other keys
    (an earlier ring step) and this tile's result is merged into them by LSE, in place."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Sq
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * s_qb + rows[:, None] * s_qs + h * s_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    q_pos = tl.load(QPos + rows, mask=row_ok, other=-1)
    k_base = K + b * s_kb + hk * s_kh
    v_base = V + b * s_vb + hk * s_vh
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    blk = tile // (G // BLOCK_M)  # the walk lists are per G-block of query rows
    tile_off = b * s_cb + h * s_ch + blk
    # (1) off-diagonal key blocks, G // BLOCK_N tiles each: every pair is causal and in range, no mask.
    starts = Starts + b * s_sb + h * s_sh + blk * s_st
    for j in range(0, tl.load(Count + tile_off) * (G // BLOCK_N)):
        col0 = tl.load(starts + j // (G // BLOCK_N)) + (j % (G // BLOCK_N)) * BLOCK_N
        k = KDesc.load([b, col0, hk, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = VDesc.load([b, col0, hk, 0]).reshape(BLOCK_N, HEAD_DIM)
        acc, m_i, l_i = _online_update(acc, m_i, l_i, tl.dot(q, tl.trans(k)) * qk_scale, v)
    # (2) the causal-diagonal block, masked by position.
    diag_start = tl.load(DiagStart + tile_off)
    if diag_start >= 0:
        for sub in tl.static_range(G // BLOCK_N):
            cols = diag_start + sub * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < Sk
            k_pos = tl.load(KPos + cols, mask=col_ok, other=INT_MAX)
            k = tl.load(k_base + cols[None, :] * s_ks + d[:, None], mask=col_ok[None, :], other=0.0)
            v = tl.load(v_base + cols[:, None] * s_vs + d[None, :], mask=col_ok[:, None], other=0.0)
            s = tl.where(k_pos[None, :] <= q_pos[:, None], tl.dot(q, k) * qk_scale, float("-inf"))
            acc, m_i, l_i = _online_update(acc, m_i, l_i, s, v)
    # (3) vertical columns whose block diagonal is not selected.
    qB = tl.load(QGBlock + blk)
    n_vert = tl.load(VCountQ + tile_off)
    vcols_row = VCols + b * s_wb + h * s_wh
    mask_row = DiagMask + b * s_mb + h * s_mh
    for c in range(0, n_vert, BLOCK_V):
        cols, k_pos, use = _vertical_use(c + tl.arange(0, BLOCK_V), n_vert, vcols_row, KPos, mask_row, qB, G)
        k = tl.load(k_base + cols[None, :] * s_ks + d[:, None], mask=use[None, :], other=0.0)
        v = tl.load(v_base + cols[:, None] * s_vs + d[None, :], mask=use[:, None], other=0.0)
        s = tl.where(k_pos[None, :] <= q_pos[:, None], tl.dot(q, k) * qk_scale, float("-inf"))
        acc, m_i, l_i = _online_update(acc, m_i, l_i, s, v)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) / 1.4426950408889634)
    out_ptr = Out + b * s_ob + rows[:, None] * s_os + h * s_oh + d[None, :]
    lse_ptr = Lse + b * s_lb + h * s_lh + rows
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
    tl.store(out_ptr, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr, lse, mask=row_ok)


@triton.jit
def _dq_step(dq, q, do, lse2, delta_row, kT, vT, s):
    """dQ += dS K for base-2 scores s [M, N] (-inf = masked), keys/values given transposed [D, N]."""
    p = tl.exp2(s - lse2[:, None])
    ds = p * (tl.dot(do, vT) - delta_row[:, None])
    return dq + tl.dot(ds.to(kT.dtype), tl.trans(kT))


@triton.jit(do_not_specialize=["s_sb", "s_sh", "s_st", "s_wb", "s_wh"])
def _bwd_dq_kernel(
    Q,
    K,
    V,
    KDesc,
    VDesc,
    DO,
    Lse,
    Delta,
    DQ,
    QPos,
    KPos,
    QGBlock,
    Starts,
    Count,
    DiagStart,
    DiagMask,
    VCols,
    VCountQ,
    qk_scale,
    sm_scale,
    Sq,
    Sk,
    H,
    GROUP,
    s_qb,
    s_qs,
    s_qh,
    s_kb,
    s_ks,
    s_kh,
    s_vb,
    s_vs,
    s_vh,
    s_ob,
    s_os,
    s_oh,
    s_lb,
    s_lh,
    s_sb,
    s_sh,
    s_st,
    s_cb,
    s_ch,
    s_mb,
    s_mh,
    s_wb,
    s_wh,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """dQ (float32, Q's strides) of one query tile over the same tiles and columns as the forward."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Sq
    d = tl.arange(0, HEAD_DIM)
    q_off = b * s_qb + rows[:, None] * s_qs + h * s_qh + d[None, :]
    q = tl.load(Q + q_off, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * s_ob + rows[:, None] * s_os + h * s_oh + d[None, :], mask=row_ok[:, None], other=0.0)
    lse = tl.load(Lse + b * s_lb + h * s_lh + rows, mask=row_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta_row = tl.load(Delta + b * s_lb + h * s_lh + rows, mask=row_ok, other=0.0)
    q_pos = tl.load(QPos + rows, mask=row_ok, other=-1)
    k_base = K + b * s_kb + hk * s_kh
    v_base = V + b * s_vb + hk * s_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    blk = tile // (G // BLOCK_M)
    tile_off = b * s_cb + h * s_ch + blk
    starts = Starts + b * s_sb + h * s_sh + blk * s_st
    for j in range(0, tl.load(Count + tile_off) * (G // BLOCK_N)):
        col0 = tl.load(starts + j // (G // BLOCK_N)) + (j % (G // BLOCK_N)) * BLOCK_N
        kT = tl.trans(KDesc.load([b, col0, hk, 0]).reshape(BLOCK_N, HEAD_DIM))
        vT = tl.trans(VDesc.load([b, col0, hk, 0]).reshape(BLOCK_N, HEAD_DIM))
        dq = _dq_step(dq, q, do, lse2, delta_row, kT, vT, tl.dot(q, kT) * qk_scale)
    diag_start = tl.load(DiagStart + tile_off)
    if diag_start >= 0:
        for sub in tl.static_range(G // BLOCK_N):
            cols = diag_start + sub * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < Sk
            k_pos = tl.load(KPos + cols, mask=col_ok, other=INT_MAX)
            kT = tl.load(k_base + cols[None, :] * s_ks + d[:, None], mask=col_ok[None, :], other=0.0)
            vT = tl.load(v_base + cols[None, :] * s_vs + d[:, None], mask=col_ok[None, :], other=0.0)
            s = tl.where(k_pos[None, :] <= q_pos[:, None], tl.dot(q, kT) * qk_scale, float("-inf"))
            dq = _dq_step(dq, q, do, lse2, delta_row, kT, vT, s)
    qB = tl.load(QGBlock + blk)
    n_vert = tl.load(VCountQ + tile_off)
    vcols_row = VCols + b * s_wb + h * s_wh
    mask_row = DiagMask + b * s_mb + h * s_mh
    for c in range(0, n_vert, BLOCK_V):
        cols, k_pos, use = _vertical_use(c + tl.arange(0, BLOCK_V), n_vert, vcols_row, KPos, mask_row, qB, G)
        kT = tl.load(k_base + cols[None, :] * s_ks + d[:, None], mask=use[None, :], other=0.0)
        vT = tl.load(v_base + cols[None, :] * s_vs + d[:, None], mask=use[None, :], other=0.0)
        s = tl.where(k_pos[None, :] <= q_pos[:, None], tl.dot(q, kT) * qk_scale, float("-inf"))
        dq = _dq_step(dq, q, do, lse2, delta_row, kT, vT, s)
    tl.store(DQ + q_off, dq * sm_scale, mask=row_ok[:, None])


@triton.jit
def _dkdv_step(
    dk,
    dv,
    k,
    v,
    k_pos,
    Q,
    DO,
    Lse,
    Delta,
    QPos,
    DQ,
    row0,
    b,
    h,
    qk_scale,
    sm_scale,
    Sq,
    s_qb,
    s_qs,
    s_qh,
    s_ob,
    s_os,
    s_oh,
    s_lb,
    s_lh,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASK: tl.constexpr,
    DQ_MODE: tl.constexpr,
):
    """Accumulate dK/dV [N, D] of key rows k/v against the query rows row0 .. row0 + BLOCK_M - 1 of head h.

    Rows past Sq load lse = +inf, so they add nothing (and their dQ is exactly 0); MASK adds the
    causal test by position. DQ_MODE 1 also adds this tile's dQ = dS K into the float32 DQ (Q's
    strides) atomically; 0 leaves dQ to its own kernel. Scores are formed query-major (S = Q K^T,
    dP = dO V^T, K and V as the shared-memory operand) and transposed for dV += P^T dO and
    dK += dS^T Q: 17% faster on an H200 than the key-major S^T = K Q^T, which keeps K and V as
    register operands (bench/results/kernel_variants.json).
    """
    d = tl.arange(0, HEAD_DIM)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < Sq
    q_off = b * s_qb + rows[:, None] * s_qs + h * s_qh + d[None, :]
    q = tl.load(Q + q_off, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * s_ob + rows[:, None] * s_os + h * s_oh + d[None, :], mask=row_ok[:, None], other=0.0)
    lse = tl.load(Lse + b * s_lb + h * s_lh + rows, mask=row_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta_row = tl.load(Delta + b * s_lb + h * s_lh + rows, mask=row_ok, other=0.0)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASK:
        q_pos = tl.load(QPos + rows, mask=row_ok, other=-1)
        s = tl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
    p = tl.exp2(s - lse2[:, None])
    dv += tl.dot(tl.trans(p.to(do.dtype)), do)
    ds = (p * (tl.dot(do, tl.trans(v)) - delta_row[:, None])).to(q.dtype)
    dk += tl.dot(tl.trans(ds), q)
    if DQ_MODE == 1:
        dq = tl.dot(ds, k) * sm_scale
        tl.atomic_add(DQ + q_off, dq, mask=row_ok[:, None], sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["s_sb", "s_sh", "s_st"])
def _bwd_dkdv_block_kernel(
    Q,
    K,
    V,
    DO,
    Lse,
    Delta,
    DK,
    DV,
    DQ,
    QPos,
    KPos,
    Starts,
    Count,
    DiagStart,
    qk_scale,
    sm_scale,
    Sq,
    Sk,
    H,
    GROUP,
    s_qb,
    s_qs,
    s_qh,
    s_kb,
    s_ks,
    s_kh,
    s_vb,
    s_vs,
    s_vh,
    s_ob,
    s_os,
    s_oh,
    s_lb,
    s_lh,
    s_gb,
    s_gs,
    s_gh,
    s_sb,
    s_sh,
    s_st,
    s_cb,
    s_ch,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DQ_MODE: tl.constexpr,
):
    """dK/dV (float32, strides s_g*) of one key tile's block part, over the query heads of its group."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    hkv_count = H // GROUP
    b = bh // hkv_count
    hk = bh % hkv_count
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < Sk
    d = tl.arange(0, HEAD_DIM)
    k = tl.load(K + b * s_kb + cols[:, None] * s_ks + hk * s_kh + d[None, :], mask=col_ok[:, None], other=0.0)
    v = tl.load(V + b * s_vb + cols[:, None] * s_vs + hk * s_vh + d[None, :], mask=col_ok[:, None], other=0.0)
    k_pos = tl.load(KPos + cols, mask=col_ok, other=INT_MAX)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    blk = tile // (G // BLOCK_N)  # the walk lists are per G-block of keys
    for g in range(0, GROUP):
        h = hk * GROUP + g
        tile_off = b * s_cb + h * s_ch + blk
        starts = Starts + b * s_sb + h * s_sh + blk * s_st
        # off-diagonal query blocks, G // BLOCK_M tiles each (rows past Sq of a last, partial block add nothing)
        for j in range(0, tl.load(Count + tile_off) * (G // BLOCK_M)):
            row0 = tl.load(starts + j // (G // BLOCK_M)) + (j % (G // BLOCK_M)) * BLOCK_M
            dk, dv = _dkdv_step(
                dk,
                dv,
                k,
                v,
                k_pos,
                Q,
                DO,
                Lse,
                Delta,
                QPos,
                DQ,
                row0,
                b,
                h,
                qk_scale,
                sm_scale,
                Sq,
                s_qb,
                s_qs,
                s_qh,
                s_ob,
                s_os,
                s_oh,
                s_lb,
                s_lh,
                BLOCK_M,
                HEAD_DIM,
                False,
                DQ_MODE,
            )
        diag_start = tl.load(DiagStart + tile_off)
        if diag_start >= 0:
            for sub in tl.static_range(G // BLOCK_M):
                dk, dv = _dkdv_step(
                    dk,
                    dv,
                    k,
                    v,
                    k_pos,
                    Q,
                    DO,
                    Lse,
                    Delta,
                    QPos,
                    DQ,
                    diag_start + sub * BLOCK_M,
                    b,
                    h,
                    qk_scale,
                    sm_scale,
                    Sq,
                    s_qb,
                    s_qs,
                    s_qh,
                    s_ob,
                    s_os,
                    s_oh,
                    s_lb,
                    s_lh,
                    BLOCK_M,
                    HEAD_DIM,
                    True,
                    DQ_MODE,
                )
    out_off = b * s_gb + cols[:, None] * s_gs + hk * s_gh + d[None, :]
    tl.store(DK + out_off, dk * sm_scale, mask=col_ok[:, None])
    tl.store(DV + out_off, dv, mask=col_ok[:, None])


@triton.jit(do_not_specialize=["s_wb", "s_wh", "s_tb", "s_th", "VWIDTH"])
def _bwd_dkdv_vertical_kernel(
    Q,
    K,
    V,
    DO,
    Lse,
    Delta,
    DK,
    DV,
    DQ,
    QPos,
    KPos,
    DiagMask,
    VCols,
    VStartRow,
    qk_scale,
    sm_scale,
    Sq,
    Sk,
    H,
    GROUP,
    NQT,
    VWIDTH,
    SPLIT,
    s_qb,
    s_qs,
    s_qh,
    s_kb,
    s_ks,
    s_kh,
    s_vb,
    s_vs,
    s_vh,
    s_ob,
    s_os,
    s_oh,
    s_lb,
    s_lh,
    s_gb,
    s_gs,
    s_gh,
    s_mb,
    s_mh,
    s_wb,
    s_wh,
    s_tb,
    s_th,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DQ_MODE: tl.constexpr,
):
    """dK/dV of one chunk of a head's vertical columns (those not covered by a selected diagonal),
    against the query tiles [split * SPLIT, (split + 1) * SPLIT): the rows are split over programs
    (grid axis 2) so that a few long columns keep the whole GPU busy; partial sums add atomically."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    split = tl.program_id(2)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    idx = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    cols = tl.load(VCols + b * s_wb + h * s_wh + idx, mask=idx < VWIDTH, other=Sk)
    valid = cols < Sk
    cols = tl.where(valid, cols, 0)
    d = tl.arange(0, HEAD_DIM)
    k = tl.load(K + b * s_kb + cols[:, None] * s_ks + hk * s_kh + d[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(V + b * s_vb + cols[:, None] * s_vs + hk * s_vh + d[None, :], mask=valid[:, None], other=0.0)
    k_pos = tl.load(KPos + cols, mask=valid, other=INT_MAX)
    k_blk = k_pos // G
    mask_row = DiagMask + b * s_mb + h * s_mh
    dk = tl.zeros([BLOCK_V, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_V, HEAD_DIM], dtype=tl.float32)
    t_lo = tl.maximum(tl.load(VStartRow + b * s_tb + h * s_th + chunk) // BLOCK_M, split * SPLIT)
    t_hi = tl.minimum(NQT, (split + 1) * SPLIT)
    if t_lo < t_hi:
        for t in range(t_lo, t_hi):
            qB = tl.load(QPos + t * BLOCK_M) // G  # runs of G aligned positions: one block per tile
            covered = tl.load(mask_row + (qB - k_blk), mask=valid & (k_blk <= qB), other=0)
            k_pos_use = tl.where(valid & (covered == 0), k_pos, INT_MAX)
            dk, dv = _dkdv_step(
                dk,
                dv,
                k,
                v,
                k_pos_use,
                Q,
                DO,
                Lse,
                Delta,
                QPos,
                DQ,
                t * BLOCK_M,
                b,
                h,
                qk_scale,
                sm_scale,
                Sq,
                s_qb,
                s_qs,
                s_qh,
                s_ob,
                s_os,
                s_oh,
                s_lb,
                s_lh,
                BLOCK_M,
                HEAD_DIM,
                True,
                DQ_MODE,
            )
        out_off = b * s_gb + cols[:, None] * s_gs + hk * s_gh + d[None, :]
        tl.atomic_add(DK + out_off, dk * sm_scale, mask=valid[:, None])
        tl.atomic_add(DV + out_off, dv, mask=valid[:, None])


@triton.jit
def _row_delta_kernel(
    DO,
    Out,
    Delta,
    R,
    H,
    S,
    s_ob,
    s_os,
    s_oh,
    s_db,
    s_dh,
    s_pb,
    s_ps,
    s_ph,
    BLOCK_R: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Delta[b, h, s] = sum_d dO * O in float32 for BLOCK_R of the R = B * S * H rows (row = (b, s, h))."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < R
    b = rows // (S * H)
    s = (rows // H) % S
    h = rows % H
    d = tl.arange(0, HEAD_DIM)
    do = tl.load(DO + (b * s_ob + s * s_os + h * s_oh)[:, None] + d[None, :], mask=ok[:, None], other=0.0)
    o = tl.load(Out + (b * s_pb + s * s_ps + h * s_ph)[:, None] + d[None, :], mask=ok[:, None], other=0.0)
    tl.store(Delta + b * s_db + h * s_dh + s, tl.sum(do.to(tl.float32) * o.to(tl.float32), 1), mask=ok)

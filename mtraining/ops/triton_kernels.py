"""Triton kernels for vertical-slash sparse attention: forward (out, lse), dQ, dK/dV.

Each query tile walks (1) the selected block diagonals: key block ``kB = qB - delta`` for every
selected ``delta``, unmasked except on the causal diagonal ``delta == 0``, then (2) the vertical
columns of the head gathered from this key chunk, skipping any column whose block diagonal is
already selected (so no pair counts twice). The backward recomputes P from Q, K and the saved LSE
(FlashAttention-2 style): one kernel for dQ (same walk as the forward), one for dK/dV of the block
part (per key tile, walking ``qB = kB + delta`` over the query heads of its GQA group), and one for
dK/dV of the vertical columns (per chunk of columns, added atomically since query heads of a GQA
group share keys). Scores are kept in base 2 (``exp2``); the LSE written out is natural-log.

Index arrays (see kernel_index.KernelIndex) are int32; per-(batch, head) arrays are passed with
their batch and head strides.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
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
def _fwd_kernel(
    Q, K, V, Out, Lse, QPos, KPos,
    QGBlock, KBlockStart, Diags, DiagCount, DiagMask, VCols, VCountQ,
    qk_scale, Sq, Sk, H, GROUP,
    s_qb, s_qs, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_ob, s_os, s_oh, s_lb, s_lh,
    s_db, s_dh, s_nb, s_nh, s_mb, s_mh, s_cb, s_ch, s_tb, s_th,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
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
    qB = tl.load(QGBlock + tile)
    k_base = K + b * s_kb + hk * s_kh
    v_base = V + b * s_vb + hk * s_vh
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    diag_base = Diags + b * s_db + h * s_dh
    n_diag = tl.load(DiagCount + b * s_nb + h * s_nh)
    # (1a) off-diagonal blocks: every pair is causal and in range, no mask.
    for j in range(0, n_diag):
        delta = tl.load(diag_base + j)
        kB = qB - delta
        if (delta > 0) & (kB >= 0):
            ks = tl.load(KBlockStart + kB)
            if ks >= 0:
                for sub in tl.static_range(G // BLOCK_N):
                    cols = ks + sub * BLOCK_N + tl.arange(0, BLOCK_N)
                    k = tl.load(k_base + cols[None, :] * s_ks + d[:, None])
                    v = tl.load(v_base + cols[:, None] * s_vs + d[None, :])
                    s = tl.dot(q, k) * qk_scale
                    acc, m_i, l_i = _online_update(acc, m_i, l_i, s, v)
    # (1b) the causal diagonal block, masked by position.
    if n_diag > 0:
        if tl.load(diag_base) == 0:
            ks = tl.load(KBlockStart + qB)
            if ks >= 0:
                for sub in tl.static_range(G // BLOCK_N):
                    cols = ks + sub * BLOCK_N + tl.arange(0, BLOCK_N)
                    col_ok = cols < Sk
                    k_pos = tl.load(KPos + cols, mask=col_ok, other=INT_MAX)
                    k = tl.load(k_base + cols[None, :] * s_ks + d[:, None], mask=col_ok[None, :], other=0.0)
                    v = tl.load(v_base + cols[:, None] * s_vs + d[None, :], mask=col_ok[:, None], other=0.0)
                    s = tl.dot(q, k) * qk_scale
                    s = tl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
                    acc, m_i, l_i = _online_update(acc, m_i, l_i, s, v)
    # (2) vertical columns whose block diagonal is not selected.
    n_vert = tl.load(VCountQ + b * s_tb + h * s_th + tile)
    vcol_base = VCols + b * s_cb + h * s_ch
    mask_base = DiagMask + b * s_mb + h * s_mh
    for c in range(0, n_vert, BLOCK_V):
        idx = c + tl.arange(0, BLOCK_V)
        valid = idx < n_vert
        cols = tl.load(vcol_base + idx, mask=valid, other=0)
        k_pos = tl.load(KPos + cols, mask=valid, other=INT_MAX)
        k_blk = k_pos // G
        covered = tl.load(mask_base + (qB - k_blk), mask=valid & (k_blk <= qB), other=0)
        use = valid & (covered == 0)
        k = tl.load(k_base + cols[None, :] * s_ks + d[:, None], mask=use[None, :], other=0.0)
        v = tl.load(v_base + cols[:, None] * s_vs + d[None, :], mask=use[:, None], other=0.0)
        s = tl.dot(q, k) * qk_scale
        s = tl.where(use[None, :] & (k_pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        acc, m_i, l_i = _online_update(acc, m_i, l_i, s, v)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) / 1.4426950408889634)
    tl.store(
        Out + b * s_ob + rows[:, None] * s_os + h * s_oh + d[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None],
    )
    tl.store(Lse + b * s_lb + h * s_lh + rows, lse, mask=row_ok)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ, QPos, KPos,
    QGBlock, KBlockStart, Diags, DiagCount, DiagMask, VCols, VCountQ,
    qk_scale, sm_scale, Sq, Sk, H, GROUP,
    s_qb, s_qs, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_ob, s_os, s_oh, s_lb, s_lh,
    s_db, s_dh, s_nb, s_nh, s_mb, s_mh, s_cb, s_ch, s_tb, s_th,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """dQ of one query tile over the same blocks and columns as the forward. DO and DQ share Q's strides."""
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
    qB = tl.load(QGBlock + tile)
    k_base = K + b * s_kb + hk * s_kh
    v_base = V + b * s_vb + hk * s_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    diag_base = Diags + b * s_db + h * s_dh
    n_diag = tl.load(DiagCount + b * s_nb + h * s_nh)
    for j in range(0, n_diag):
        delta = tl.load(diag_base + j)
        kB = qB - delta
        if kB >= 0:
            ks = tl.load(KBlockStart + kB)
            if ks >= 0:
                for sub in tl.static_range(G // BLOCK_N):
                    cols = ks + sub * BLOCK_N + tl.arange(0, BLOCK_N)
                    col_ok = cols < Sk
                    k_pos = tl.load(KPos + cols, mask=col_ok, other=INT_MAX)
                    kT = tl.load(k_base + cols[None, :] * s_ks + d[:, None], mask=col_ok[None, :], other=0.0)
                    vT = tl.load(v_base + cols[None, :] * s_vs + d[:, None], mask=col_ok[None, :], other=0.0)
                    s = tl.dot(q, kT) * qk_scale
                    s = tl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
                    p = tl.exp2(s - lse2[:, None])
                    dp = tl.dot(do, vT)
                    ds = p * (dp - delta_row[:, None])
                    dq += tl.dot(ds.to(kT.dtype), tl.trans(kT))
    n_vert = tl.load(VCountQ + b * s_tb + h * s_th + tile)
    vcol_base = VCols + b * s_cb + h * s_ch
    mask_base = DiagMask + b * s_mb + h * s_mh
    for c in range(0, n_vert, BLOCK_V):
        idx = c + tl.arange(0, BLOCK_V)
        valid = idx < n_vert
        cols = tl.load(vcol_base + idx, mask=valid, other=0)
        k_pos = tl.load(KPos + cols, mask=valid, other=INT_MAX)
        k_blk = k_pos // G
        covered = tl.load(mask_base + (qB - k_blk), mask=valid & (k_blk <= qB), other=0)
        use = valid & (covered == 0)
        kT = tl.load(k_base + cols[None, :] * s_ks + d[:, None], mask=use[None, :], other=0.0)
        vT = tl.load(v_base + cols[None, :] * s_vs + d[:, None], mask=use[None, :], other=0.0)
        s = tl.dot(q, kT) * qk_scale
        s = tl.where(use[None, :] & (k_pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        p = tl.exp2(s - lse2[:, None])
        dp = tl.dot(do, vT)
        ds = p * (dp - delta_row[:, None])
        dq += tl.dot(ds.to(kT.dtype), tl.trans(kT))
    tl.store(DQ + q_off, dq * sm_scale, mask=row_ok[:, None])


@triton.jit
def _bwd_dkdv_tile(dk, dv, k, v, k_pos, Q, DO, Lse, Delta, QPos, rows, b, h, qk_scale, Sq,
                   s_qb, s_qs, s_qh, s_ob, s_os, s_oh, s_lb, s_lh, HEAD_DIM: tl.constexpr):
    """Accumulate dK/dV [N, D] of key rows k/v against query rows ``rows`` of head h (masked by position)."""
    d = tl.arange(0, HEAD_DIM)
    row_ok = rows < Sq
    q = tl.load(Q + b * s_qb + rows[:, None] * s_qs + h * s_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * s_ob + rows[:, None] * s_os + h * s_oh + d[None, :], mask=row_ok[:, None], other=0.0)
    lse = tl.load(Lse + b * s_lb + h * s_lh + rows, mask=row_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta_row = tl.load(Delta + b * s_lb + h * s_lh + rows, mask=row_ok, other=0.0)
    q_pos = tl.load(QPos + rows, mask=row_ok, other=-1)
    sT = tl.dot(k, tl.trans(q)) * qk_scale
    sT = tl.where(k_pos[:, None] <= q_pos[None, :], sT, float("-inf"))
    pT = tl.exp2(sT - lse2[None, :])
    dv += tl.dot(pT.to(do.dtype), do)
    dpT = tl.dot(v, tl.trans(do))
    dsT = pT * (dpT - delta_row[None, :])
    dk += tl.dot(dsT.to(q.dtype), q)
    return dk, dv


@triton.jit
def _bwd_dkdv_block_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, QPos, KPos,
    KGBlock, QBlockStart, Diags, DiagCount,
    qk_scale, sm_scale, Sq, Sk, H, GROUP, NB,
    s_qb, s_qs, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_ob, s_os, s_oh, s_lb, s_lh,
    s_gb, s_gs, s_gh, s_db, s_dh, s_nb, s_nh,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """dK/dV of one key tile (block part) summed over the query heads of its GQA group (float32, strides s_g*)."""
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
    kB = tl.load(KGBlock + tile)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        diag_base = Diags + b * s_db + h * s_dh
        n_diag = tl.load(DiagCount + b * s_nb + h * s_nh)
        for j in range(0, n_diag):
            qB = kB + tl.load(diag_base + j)
            if qB < NB:
                qs = tl.load(QBlockStart + qB)
                if qs >= 0:
                    for sub in tl.static_range(G // BLOCK_M):
                        rows = qs + sub * BLOCK_M + tl.arange(0, BLOCK_M)
                        dk, dv = _bwd_dkdv_tile(dk, dv, k, v, k_pos, Q, DO, Lse, Delta, QPos, rows, b, h,
                                                qk_scale, Sq, s_qb, s_qs, s_qh, s_ob, s_os, s_oh, s_lb, s_lh,
                                                HEAD_DIM)
    out_off = b * s_gb + cols[:, None] * s_gs + hk * s_gh + d[None, :]
    tl.store(DK + out_off, dk * sm_scale, mask=col_ok[:, None])
    tl.store(DV + out_off, dv, mask=col_ok[:, None])


@triton.jit
def _bwd_dkdv_vertical_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, QPos, KPos,
    QGBlock, DiagMask, VCols, VStartQ,
    qk_scale, sm_scale, Sq, Sk, H, GROUP, NQT, VWIDTH,
    s_qb, s_qs, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_ob, s_os, s_oh, s_lb, s_lh,
    s_gb, s_gs, s_gh, s_mb, s_mh, s_cb, s_ch, s_tb, s_th,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """dK/dV of one chunk of a head's vertical columns (those not covered by a selected diagonal)."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    idx = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    cols = tl.load(VCols + b * s_cb + h * s_ch + idx, mask=idx < VWIDTH, other=Sk)
    valid = cols < Sk
    cols = tl.where(valid, cols, 0)
    d = tl.arange(0, HEAD_DIM)
    k = tl.load(K + b * s_kb + cols[:, None] * s_ks + hk * s_kh + d[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(V + b * s_vb + cols[:, None] * s_vs + hk * s_vh + d[None, :], mask=valid[:, None], other=0.0)
    k_pos = tl.load(KPos + cols, mask=valid, other=INT_MAX)
    k_blk = k_pos // G
    mask_base = DiagMask + b * s_mb + h * s_mh
    dk = tl.zeros([BLOCK_V, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_V, HEAD_DIM], dtype=tl.float32)
    start = tl.load(VStartQ + b * s_tb + h * s_th + chunk)
    for t in range(start, NQT):
        qB = tl.load(QGBlock + t)
        covered = tl.load(mask_base + (qB - k_blk), mask=valid & (k_blk <= qB), other=0)
        use = valid & (covered == 0)
        k_pos_use = tl.where(use, k_pos, INT_MAX)
        rows = t * BLOCK_M + tl.arange(0, BLOCK_M)
        dk, dv = _bwd_dkdv_tile(dk, dv, k, v, k_pos_use, Q, DO, Lse, Delta, QPos, rows, b, h,
                                qk_scale, Sq, s_qb, s_qs, s_qh, s_ob, s_os, s_oh, s_lb, s_lh, HEAD_DIM)
    out_off = b * s_gb + cols[:, None] * s_gs + hk * s_gh + d[None, :]
    tl.atomic_add(DK + out_off, dk * sm_scale, mask=valid[:, None])
    tl.atomic_add(DV + out_off, dv, mask=valid[:, None])

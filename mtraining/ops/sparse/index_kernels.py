"""The walks of index.py built by three Triton launches (the CUDA path).

The torch builders in index.py take ~130 small torch ops per chunk pair and its walks; on a
GPU each op costs more host time than its device work, so index building was host-bound, per layer,
step and ring step. These kernels produce exactly the same tensors (dtypes, shapes, padding,
order), from the pattern and the positions, in one launch per builder (plus the allocations of
their outputs: 14 torch ops for the pair and both walks):

- ``_pair_kernel`` (``chunk_pair_triton``): where each global block starts in either chunk, the diagonal
  mask, and the pattern's verticals that live in the key chunk (compacted, ascending);
- ``_walk_kernel`` (``query_walk_triton`` / ``key_walk_triton``): per G-block of one side, the local starts of the
  other side's blocks on the selected off-diagonal block diagonals (compacted in the order of the
  diagonal list), their count and the causal-diagonal start; for queries the number of verticals
  each block may see, for keys the first query row of each chunk of verticals. With packed documents
  (DOCS) also the walks' document part (index.py): blocks no row's document reaches are dropped, the
  prefix that needs no mask is counted, and for queries the first vertical each block may see, for
  keys the end of the rows that may see each chunk of verticals.

Positions are ascending aligned runs (index.py docstring), so "where does global block gb
start locally" and "is key position p in this chunk" are binary searches in the positions: no
table has to be initialised before a scatter, which would need a second launch. All list widths
are host-known, so nothing waits for the device. The torch builders stay the CPU path and the
test oracle (tests/ops/test_walk_kernels.py runs these kernels in the interpreter against them).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..pattern import VerticalSlashPattern
from .index import ABSENT, ChunkPair, KeyWalk, QueryWalk, list_width

_ABSENT = tl.constexpr(ABSENT)

# Vector widths of the builders (powers of two): global blocks per program of the pair kernel, verticals
# per step of its compaction loop, local blocks per program of the walk kernel, diagonals per step of its
# loop. Tests shrink them so that every loop runs several steps.
BLOCKS = dict(nb=256, verts=1024, rows=16, diags=64)


@triton.jit
def _search(Row, n, x, steps, RIGHT: tl.constexpr):
    """How many entries of the ascending Row[0:n] are < x (<= x with RIGHT), for every element of x.

    ``steps`` >= n.bit_length() halvings always reach an empty range."""
    lo = tl.zeros(x.shape, dtype=tl.int32)
    hi = lo + n
    for _ in range(steps):
        live = lo < hi
        mid = (lo + hi) // 2
        val = tl.load(Row + mid, mask=live, other=0)
        if RIGHT:
            right = val <= x
        else:
            right = val < x
        lo = tl.where(live & right, mid + 1, lo)
        hi = tl.where(live & ~right, mid, hi)
    return lo


@triton.jit
def _run_starts(Pos, n, steps, gblock, G: tl.constexpr):
    """Local row where global block ``gblock`` starts in the positions Pos[0:n], -1 where absent."""
    row = _search(Pos, n, gblock * G, steps, False)
    found = tl.load(Pos + row, mask=row < n, other=-1) == gblock * G
    return tl.where(found, row, -1)


@triton.jit(do_not_specialize=["D", "V", "VW", "d_steps", "stride_db", "stride_dh", "stride_vb", "stride_vh"])
def _pair_kernel(
    QPos, KPos,  # int32 global positions [Sq], [Sk]
    BlockDiags, VertPos, NumVerts,  # of the pattern: [B, H, D], [B, H, V], [B, H]
    QStart, KStart,  # out: int32 [NB] local row where each global block starts in either chunk, -1 where absent
    DiagMask,  # out: int8 [B, H, NB]
    VCols, VColPos,  # out: int32 [B, H, VW] local rows and positions of the verticals in the key chunk
    Sq, Sk, NB, H, D, V, VW,
    q_steps, k_steps, d_steps,  # binary-search halvings over Sq, Sk and D entries
    stride_db, stride_dh,  # BlockDiags
    stride_vb, stride_vh,  # VertPos
    stride_nb, stride_nh,  # NumVerts
    G: tl.constexpr, BLOCK_NB: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Program (i, bh): the diagonal mask of head bh for diagonals [i * BLOCK_NB, +BLOCK_NB); programs
    (i, 0) also the block-start tables of both chunks there; programs (0, bh) the verticals of head bh."""
    i = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    blocks = i * BLOCK_NB + tl.arange(0, BLOCK_NB)
    in_range = blocks < NB
    # diagonal mask: is delta in the ascending list (padded with NB, which no delta equals)
    diag_row = BlockDiags + b * stride_db + h * stride_dh
    at = _search(diag_row, D, blocks, d_steps, False)
    hit = tl.load(diag_row + at, mask=at < D, other=-1) == blocks
    tl.store(DiagMask + bh * NB + blocks, hit.to(tl.int8), mask=in_range)
    if bh == 0:
        tl.store(QStart + blocks, _run_starts(QPos, Sq, q_steps, blocks, G), mask=in_range)
        tl.store(KStart + blocks, _run_starts(KPos, Sk, k_steps, blocks, G), mask=in_range)
    if i == 0:
        # verticals present in the key chunk, as local rows, moved to the front in order
        n_vert = tl.load(NumVerts + b * stride_nb + h * stride_nh)
        vert_row = VertPos + b * stride_vb + h * stride_vh
        out = bh.to(tl.int64) * VW
        kept = 0
        for c in range(0, n_vert, BLOCK_V):
            j = c + tl.arange(0, BLOCK_V)
            real = j < n_vert
            p = tl.load(vert_row + j, mask=real, other=0)
            local = tl.minimum(_search(KPos, Sk, p, k_steps, False), Sk - 1)
            keep = real & (tl.load(KPos + local, mask=real, other=-1) == p)
            slot = kept + tl.cumsum(keep.to(tl.int32), 0) - 1
            tl.store(VCols + out + slot, local, mask=keep)
            tl.store(VColPos + out + slot, p.to(tl.int32), mask=keep)
            kept += tl.sum(keep.to(tl.int32), 0)
        for c in range(0, VW, BLOCK_V):
            j = c + tl.arange(0, BLOCK_V)
            pad = (j >= kept) & (j < VW)
            tl.store(VCols + out + j, tl.zeros_like(j) + Sk, mask=pad)
            tl.store(VColPos + out + j, tl.zeros_like(j) + _ABSENT, mask=pad)


class WalkLists(NamedTuple):
    """What ``_walk_kernel`` writes for one side, int32, contiguous: gblock [N] (query side), starts [B, H, N, W],
    count and diag [B, H, N], extra (vcount [B, H, N] or vstart [B, H, NX]); with documents (None otherwise)
    unmasked [B, H, N] and doc_extra (vfirst [B, H, N] or vend [B, H, NX])."""

    gblock: Tensor
    starts: Tensor
    count: Tensor
    diag: Tensor
    extra: Tensor
    unmasked: Tensor | None
    doc_extra: Tensor | None


@triton.jit(do_not_specialize=["W", "VW", "NX", "XSTEP", "v_steps", "stride_db", "stride_dh", "stride_bb"])
def _walk_kernel(
    QPos, KPos,  # int32 global positions [Sq], [Sk]
    BlockDiags, NumDiags,  # of the pattern: [B, H, D], [B, H]
    DiagMask, OtherStart, VColPos,  # of the ChunkPair: [B, H, NB], the other side's block starts [NB], [B, H, VW]
    QBound,  # DOCS: int32 [B or 1, Sq] the query rows' document bounds
    Out: WalkLists,  # the lists it builds (contiguous)
    Sq, N, NB, H, W, VW, NX, XSTEP,
    q_steps, v_steps,  # binary-search halvings over Sq and VW entries
    stride_db, stride_dh,  # BlockDiags
    stride_nb, stride_nh,  # NumDiags
    stride_bb,  # QBound
    G: tl.constexpr, QUERY: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, DOCS: tl.constexpr,
):  # fmt: skip
    """Program (t, bh): the lists of local blocks [t * BLOCK_R, +BLOCK_R) of this side (QUERY: the
    query chunk, other side the keys, block gb meets gb - delta; else the reverse, gb + delta) for head
    bh, and the entries [t * BLOCK_R, +BLOCK_R) of Out.extra: vcount per query block (QUERY), or vstart
    per chunk of XSTEP verticals (NX of them); with DOCS the same of Out.unmasked and Out.doc_extra."""
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = t * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N
    if t * BLOCK_R < N:
        if QUERY:
            gblock = tl.load(QPos + rows * G, mask=row_ok, other=0) // G
        else:
            gblock = tl.load(KPos + rows * G, mask=row_ok, other=0) // G
        gblock = gblock.to(tl.int32)
        if QUERY:
            if bh == 0:
                tl.store(Out.gblock + rows, gblock, mask=row_ok)
        n_diag = tl.load(NumDiags + b * stride_nb + h * stride_nh)
        diag_row = BlockDiags + b * stride_db + h * stride_dh
        out = (bh * N + rows).to(tl.int64) * W
        count = tl.zeros([BLOCK_R], dtype=tl.int32)
        if DOCS:
            bound_row = QBound + b * stride_bb
            plain = tl.zeros([BLOCK_R], dtype=tl.int32)
            if QUERY:  # this side's blocks: the bounds of their first and last rows
                lo = tl.load(bound_row + rows * G, mask=row_ok, other=0)
                hi = tl.load(bound_row + tl.minimum(rows * G + G - 1, Sq - 1), mask=row_ok, other=0)
        for c in range(0, n_diag, BLOCK_D):
            j = c + tl.arange(0, BLOCK_D)
            delta = tl.load(diag_row + j, mask=j < n_diag, other=0)
            if QUERY:
                other = gblock[:, None] - delta[None, :]
            else:
                other = gblock[:, None] + delta[None, :]
            ok = row_ok[:, None] & (delta > 0)[None, :] & (other >= 0) & (other < NB)
            start = tl.load(OtherStart + other, mask=ok, other=-1)
            keep = ok & (start >= 0)
            if DOCS:  # key block kb is seen iff kb G + G - 1 >= lo, needs no mask iff kb G >= hi
                if QUERY:
                    seen = other * G + G - 1 >= lo[:, None]
                    free = other * G >= hi[:, None]
                else:
                    other_lo = tl.load(bound_row + start, mask=keep, other=0)
                    other_hi = tl.load(bound_row + tl.minimum(start + G - 1, Sq - 1), mask=keep, other=0)
                    seen = gblock[:, None] * G + G - 1 >= other_lo
                    free = gblock[:, None] * G >= other_hi
                keep = keep & seen
                plain += tl.sum((keep & free).to(tl.int32), 1)
            keep = keep.to(tl.int32)
            slot = count[:, None] + tl.cumsum(keep, 1) - 1
            tl.store(Out.starts + out[:, None] + slot, start, mask=(keep != 0) & (slot < W))  # slot < W always
            count += tl.sum(keep, 1)
        for c in range(0, W, BLOCK_D):
            s = c + tl.arange(0, BLOCK_D)
            pad = row_ok[:, None] & (s[None, :] >= count[:, None]) & (s < W)[None, :]
            tl.store(Out.starts + out[:, None] + s[None, :], tl.zeros([BLOCK_R, BLOCK_D], tl.int32) + _ABSENT, mask=pad)
        tl.store(Out.count + bh * N + rows, count, mask=row_ok)
        if DOCS:
            tl.store(Out.unmasked + bh * N + rows, plain, mask=row_ok)
        own = tl.load(OtherStart + gblock, mask=row_ok & (gblock < NB), other=-1)
        causal = tl.load(DiagMask + bh * NB) != 0
        tl.store(Out.diag + bh * N + rows, tl.where(causal, own, -1), mask=row_ok)
    vcol_row = VColPos + bh.to(tl.int64) * VW
    if QUERY:
        # verticals the block may see: positions <= its last query (vcol_pos ascending, padded with ABSENT)
        last = tl.load(QPos + tl.minimum(rows * G + G - 1, Sq - 1), mask=row_ok, other=0)
        seen = _search(vcol_row, VW, last, v_steps, True)
        tl.store(Out.extra + bh * N + rows, seen, mask=row_ok)
        if DOCS:  # the first vertical at or after the block's first row's bound
            first_lo = tl.load(QBound + b * stride_bb + rows * G, mask=row_ok, other=0)
            tl.store(Out.doc_extra + bh * N + rows, _search(vcol_row, VW, first_lo, v_steps, False), mask=row_ok)
    else:
        # first query row at or after the first vertical of each chunk (Sq for padding)
        x = t * BLOCK_R + tl.arange(0, BLOCK_R)
        x_ok = x < NX
        first = tl.load(vcol_row + x * XSTEP, mask=x_ok, other=0)
        tl.store(Out.extra + bh * NX + x, _search(QPos, Sq, first, q_steps, False), mask=x_ok)
        if DOCS:  # rows whose bound is at most the chunk's last vertical (0 for a chunk of padding)
            real = _search(vcol_row, VW, tl.zeros_like(x) + _ABSENT, v_steps, False)  # verticals present
            last_at = tl.minimum((x + 1) * XSTEP, real) - 1
            some = x_ok & (last_at >= x * XSTEP)
            last = tl.load(vcol_row + last_at, mask=some, other=0)
            end = _search(QBound + b * stride_bb, Sq, last, q_steps, True)
            tl.store(Out.doc_extra + bh * NX + x, tl.where(some, end, 0), mask=x_ok)


def _steps(n: int) -> int:
    """Halvings of a binary search over n entries."""
    return max(n, 1).bit_length()


def chunk_pair_triton(pattern: VerticalSlashPattern, q_pos: Tensor, k_pos: Tensor) -> ChunkPair:
    """index.chunk_pair_torch in one launch."""
    nb, dev = pattern.num_blocks, q_pos.device
    q_pos, k_pos = q_pos.to(torch.int32), k_pos.to(torch.int32)
    sq, sk = q_pos.shape[0], k_pos.shape[0]
    b, h, d = pattern.block_diags.shape
    v = pattern.vertical_pos.shape[-1]
    vw = max(v, 1)
    q_start = torch.empty(nb, dtype=torch.int32, device=dev)
    k_start = torch.empty(nb, dtype=torch.int32, device=dev)
    diag_mask = torch.empty((b, h, nb), dtype=torch.int8, device=dev)
    vcols = torch.empty((b, h, vw), dtype=torch.int32, device=dev)
    vcol_pos = torch.empty((b, h, vw), dtype=torch.int32, device=dev)
    diags, verts, n_verts = pattern.block_diags, pattern.vertical_pos, pattern.num_verticals
    _pair_kernel[(triton.cdiv(nb, BLOCKS["nb"]), b * h)](
        QPos=q_pos,
        KPos=k_pos,
        BlockDiags=diags,
        VertPos=verts,
        NumVerts=n_verts,
        QStart=q_start,
        KStart=k_start,
        DiagMask=diag_mask,
        VCols=vcols,
        VColPos=vcol_pos,
        Sq=sq,
        Sk=sk,
        NB=nb,
        H=h,
        D=d,
        V=v,
        VW=vw,
        q_steps=_steps(sq),
        k_steps=_steps(sk),
        d_steps=_steps(d),
        stride_db=diags.stride(0),
        stride_dh=diags.stride(1),
        stride_vb=verts.stride(0),
        stride_vh=verts.stride(1),
        stride_nb=n_verts.stride(0),
        stride_nh=n_verts.stride(1),
        G=pattern.block_size,
        BLOCK_NB=BLOCKS["nb"],
        BLOCK_V=BLOCKS["verts"],
    )
    return ChunkPair(q_pos, k_pos, q_start, k_start, diag_mask, vcols, vcol_pos)


def _walk(pattern: VerticalSlashPattern, pair: ChunkPair, query: bool, extra: int, x_step: int, q_bound: Tensor | None):
    """Launch ``_walk_kernel`` for one side; returns (gblock or None, starts, count, diag, extra, unmasked,
    doc_extra), the last two None without documents (``q_bound``)."""
    g, nb = pattern.block_size, pattern.num_blocks
    dev = pair.q_pos.device
    sq, sk = pair.q_pos.shape[0], pair.k_pos.shape[0]
    this_len, other_len = (sq, sk) if query else (sk, sq)
    n = -(-this_len // g)
    b, h, _ = pattern.block_diags.shape
    vw = pair.vcol_pos.shape[-1]
    width = list_width(pattern, other_len)
    gblock = torch.empty(n, dtype=torch.int32, device=dev) if query else None
    starts = torch.empty((b, h, n, width), dtype=torch.int32, device=dev)
    count = torch.empty((b, h, n), dtype=torch.int32, device=dev)
    diag = torch.empty((b, h, n), dtype=torch.int32, device=dev)
    out = torch.empty((b, h, extra), dtype=torch.int32, device=dev)
    docs = q_bound is not None
    unmasked = torch.empty((b, h, n), dtype=torch.int32, device=dev) if docs else None
    doc_extra = torch.empty((b, h, extra), dtype=torch.int32, device=dev) if docs else None
    rows = BLOCKS["rows"]
    _walk_kernel[(triton.cdiv(max(n, extra), rows), b * h)](
        QPos=pair.q_pos,
        KPos=pair.k_pos,
        BlockDiags=pattern.block_diags,
        NumDiags=pattern.num_diags,
        DiagMask=pair.diag_mask,
        OtherStart=pair.k_block_start if query else pair.q_block_start,
        VColPos=pair.vcol_pos,
        QBound=q_bound,
        Out=WalkLists(gblock if query else count, starts, count, diag, out, unmasked, doc_extra),  # gblock: query side
        Sq=sq,
        N=n,
        NB=nb,
        H=h,
        W=width,
        VW=vw,
        NX=extra,
        XSTEP=x_step,
        q_steps=_steps(sq),
        v_steps=_steps(vw),
        stride_db=pattern.block_diags.stride(0),
        stride_dh=pattern.block_diags.stride(1),
        stride_nb=pattern.num_diags.stride(0),
        stride_nh=pattern.num_diags.stride(1),
        stride_bb=(q_bound.stride(0) if q_bound.shape[0] > 1 else 0) if docs else None,
        G=g,
        QUERY=query,
        BLOCK_R=rows,
        BLOCK_D=BLOCKS["diags"],
        DOCS=docs,
    )
    return gblock, starts, count, diag, out, unmasked, doc_extra


def query_walk_triton(pattern: VerticalSlashPattern, pair: ChunkPair, q_bound: Tensor | None = None) -> QueryWalk:
    """index.query_walk_torch in one launch."""
    n = -(-pair.q_pos.shape[0] // pattern.block_size)
    gblock, starts, count, diag, vcount, unmasked, vfirst = _walk(pattern, pair, True, n, 1, q_bound)
    return QueryWalk.of(gblock, starts, count, diag, pair.diag_mask, pair.vcols, vcount, unmasked, vfirst)


def key_walk_triton(
    pattern: VerticalSlashPattern, pair: ChunkPair, v_chunk: int, q_bound: Tensor | None = None
) -> KeyWalk:
    """index.key_walk_torch in one launch (verticals in chunks of ``v_chunk``)."""
    chunks = -(-pair.vcol_pos.shape[-1] // v_chunk)
    _, starts, count, diag, vstart, unmasked, vend = _walk(pattern, pair, False, chunks, v_chunk, q_bound)
    return KeyWalk.of(starts, count, diag, vstart, pair, unmasked, vend)

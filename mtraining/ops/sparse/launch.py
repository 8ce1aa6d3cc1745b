"""Launches of the sparse-attention kernels (kernels.py) with the contract of ops/reference.py.

Tile configurations, the walks of each chunk pair (index.py; built by Triton launches on CUDA,
index_kernels.py, and cached on the pattern), and the kernel launches, by keyword.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import triton
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from ..pattern import VerticalSlashPattern
from . import kernels
from .index import (
    DENSE_BLOCK,
    ChunkPair,
    ColumnWalk,
    KeyWalk,
    QueryWalk,
    chunk_pair_torch,
    column_walk_torch,
    key_walk_torch,
    query_walk_torch,
)
from .index_kernels import chunk_pair_triton, key_walk_triton, query_walk_triton


@dataclass(frozen=True)
class Tiles:
    """Tile sizes of one pass (each divides the pattern block G) and its kernels' launch shape."""

    block_m: int
    block_n: int
    block_v: int
    num_warps: int
    num_stages: int
    # backward only, how dQ is made: "kernel" (its own kernel: 3 more matrix products per tile) or
    # "atomic" (added by the dK/dV kernels as they go; slower on an H200, DESIGN.md "Backward").
    dq_mode: Literal["kernel", "atomic"] = "kernel"
    # backward only: query tiles per program of the vertical dK/dV kernel (long columns are split
    # over programs so that they fill the GPU)
    v_split: int = 64


@dataclass(frozen=True)
class TileConfig:
    """Tiles of the forward, dQ and dK/dV kernels."""

    fwd: Tiles
    dq: Tiles
    dkdv: Tiles


def tile_config(
    block_size: int, head_dim: int, device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> TileConfig:
    """Small tiles under the interpreter; on the GPU the half-precision tiles bench/tune_kernels.py
    chose on an H200, and tiles that fit in shared memory for float32 (a correctness path)."""
    g = block_size
    if device.type != "cuda":
        t = Tiles(min(g, 32), min(g, 32), min(g, 32), 4, 1, v_split=2)
        return TileConfig(t, t, t)
    if dtype == torch.float32:
        t = Tiles(min(g, 32), min(g, 32), 32, 4, 1)
        return TileConfig(Tiles(min(g, 64), min(g, 64), 32, 4, 1), t, t)
    bwd = Tiles(min(g, 64), min(g, 64), 64, 4, 2)
    return TileConfig(Tiles(min(g, 128), min(g, 128), 64, 8, 3), bwd, bwd)


_DQ_MODES = {"kernel": 0, "atomic": 1}


# ----------------------------------------------------------------------------- walks, once per chunk pair
def chunk_pair(pattern: VerticalSlashPattern, q_pos: Tensor, k_pos: Tensor) -> ChunkPair:
    """What the query and key walks of a chunk pair share, built once per pattern and chunk pair
    (``pattern.index_cache``): by one Triton launch on CUDA, in torch ops elsewhere."""
    build = chunk_pair_triton if q_pos.is_cuda else chunk_pair_torch
    return pattern.index_cache.get(("pair",), q_pos, k_pos, lambda: build(pattern, q_pos, k_pos))


def query_walk(pattern: VerticalSlashPattern, q_pos: Tensor, k_pos: Tensor, q_bound: Tensor | None = None) -> QueryWalk:
    """The forward's and dQ kernel's walk of a chunk pair (``q_bound``: the rows' document bounds),
    built once per pattern and chunk pair."""
    build = query_walk_triton if q_pos.is_cuda else query_walk_torch
    return pattern.index_cache.get(
        ("query",), q_pos, k_pos, lambda: build(pattern, chunk_pair(pattern, q_pos, k_pos), q_bound), q_bound
    )


def key_walk(
    pattern: VerticalSlashPattern, q_pos: Tensor, k_pos: Tensor, v_chunk: int, q_bound: Tensor | None = None
) -> KeyWalk:
    """The dK/dV kernels' walk of a chunk pair, verticals in chunks of ``v_chunk`` (``q_bound``: the rows'
    document bounds), built once per pattern, chunk pair and ``v_chunk``."""
    build = key_walk_triton if q_pos.is_cuda else key_walk_torch
    return pattern.index_cache.get(
        ("key", v_chunk),
        q_pos,
        k_pos,
        lambda: build(pattern, chunk_pair(pattern, q_pos, k_pos), v_chunk, q_bound),
        q_bound,
    )


def column_walk(pattern: VerticalSlashPattern, q_pos: Tensor, k_pos: Tensor) -> ColumnWalk | None:
    """The query blocks' own columns in a chunk pair (None without ``pattern.block_cols``), built once per
    pattern and chunk pair, in torch ops on every device."""
    if pattern.block_cols is None:
        return None
    return pattern.index_cache.get(("column",), q_pos, k_pos, lambda: column_walk_torch(pattern, q_pos, k_pos))


# ----------------------------------------------------------------------------- launch arguments
def _strides(name: str, t: Tensor, dims: str) -> dict[str, int]:
    """Keyword strides of the leading dims of ``t``: ``_strides("q", q, "bsh")`` -> stride_qb, stride_qs, stride_qh."""
    return {f"stride_{name}{dim}": stride for dim, stride in zip(dims, t.stride())}


def _unit_stride(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The kernels step along head_dim by 1: copy any tensor whose last dim is not contiguous
    (an expanded gradient such as that of ``out.sum()`` has stride 0 there)."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def _key_tiles(t: Tensor, block_n: int) -> TensorDescriptor:
    """Descriptor of [B, S, H, D] keys or values read in tiles of ``block_n`` rows of one head.

    TMA needs a 16-byte aligned base and strides: anything else (a view at an odd offset) is copied.
    """
    if t.data_ptr() % 16 or any(s * t.element_size() % 16 for s in t.stride()[:-1]):
        t = t.clone(memory_format=torch.contiguous_format)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, block_n, 1, t.shape[-1]])


def _resolve(q: Tensor, pattern: VerticalSlashPattern | None, q_pos: Tensor, k_pos: Tensor) -> VerticalSlashPattern:
    """A dense pattern stands in for pattern=None (dense causal)."""
    if pattern is not None:
        return pattern
    seq_len = int(max(q_pos.max().item(), k_pos.max().item())) + 1
    return VerticalSlashPattern.dense(q.shape[0], q.shape[2], seq_len, DENSE_BLOCK, device=q.device)


def _query_walk_args(w: QueryWalk) -> dict:
    """The QueryWalk arguments of the forward and dQ kernels (its document part None without documents)."""
    return dict(
        QGBlock=w.q_gblock,
        Starts=w.starts,
        Count=w.count,
        DiagStart=w.diag,
        DiagMask=w.diag_mask,
        VCols=w.vcols,
        VCountQ=w.vcount,
        Unmasked=w.unmasked,
        VFirst=w.vfirst,
        **_strides("s", w.starts, "bht"),
        **_strides("c", w.count, "bh"),
        **_strides("m", w.diag_mask, "bh"),
        **_strides("w", w.vcols, "bh"),
    )


def _column_args(columns: ColumnWalk | None, walk: QueryWalk) -> dict:
    """The ColumnWalk arguments of the forward and dQ kernels (None: no per-block columns; the COLUMNS
    constexpr); its counts take the QueryWalk's count strides (the kernels index both alike)."""
    if columns is None:
        return dict(ColRows=None, ColCount=None, stride_xb=None, stride_xh=None, stride_xt=None, COLUMNS=False)
    count = columns.count
    if count.stride() != walk.count.stride():
        count = torch.empty_like(walk.count).copy_(count)
    return dict(ColRows=columns.rows, ColCount=count, **_strides("x", columns.rows, "bht"), COLUMNS=True)


def _bound_args(q_bound: Tensor | None) -> dict:
    """The rows' document bounds [B or 1, Sq] of the kernels (None: no documents; the DOCS constexpr),
    a batch stride 0 when one row of bounds serves every batch row."""
    if q_bound is None:
        return dict(QBound=None, stride_bb=None, DOCS=False)
    return dict(QBound=q_bound, stride_bb=q_bound.stride(0) if q_bound.shape[0] > 1 else 0, DOCS=True)


def _query_tile_args(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, block_n: int) -> dict:
    """What the forward and dQ kernels read of the inputs: Q, K, V (K and V also as tensor
    descriptors of ``block_n``-row tiles), the positions and the shapes."""
    return dict(
        Q=q,
        K=k,
        V=v,
        KDesc=_key_tiles(k, block_n),
        VDesc=_key_tiles(v, block_n),
        QPos=q_pos,
        KPos=k_pos,
        Sq=q.shape[1],
        Sk=k.shape[1],
        H=q.shape[2],
        GROUP=q.shape[2] // k.shape[2],
        **_strides("q", q, "bsh"),
        **_strides("k", k, "bsh"),
        **_strides("v", v, "bsh"),
    )


# ----------------------------------------------------------------------------- the backend contract
def forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: VerticalSlashPattern | None,
    q_pos: Tensor,
    k_pos: Tensor,
    scale: float,
    out_dtype: torch.dtype,
    merge_into: tuple[Tensor, Tensor] | None = None,
    q_bound: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(out [B, Sq, Hq, D] in out_dtype, lse [B, Hq, Sq] float32); with ``merge_into`` (out, lse) of
    earlier keys, the kernel merges its result into them in place and returns them. ``q_bound``
    [B or 1, Sq] int32: the rows' document bounds (packed documents)."""
    q, k, v = _unit_stride(q, k, v)
    pattern = _resolve(q, pattern, q_pos, k_pos)
    b, sq, hq, d = q.shape
    t = tile_config(pattern.block_size, d, q.device, q.dtype).fwd
    walk = query_walk(pattern, q_pos, k_pos, q_bound)
    columns = column_walk(pattern, q_pos, k_pos)
    if merge_into is not None:
        out, lse = merge_into
    else:
        out = torch.full((b, sq, hq, d), float("nan"), dtype=out_dtype, device=q.device)
        lse = torch.full((b, hq, sq), float("nan"), dtype=torch.float32, device=q.device)
    kernels._fwd_kernel[(triton.cdiv(sq, t.block_m), b * hq)](
        **_query_tile_args(q, k, v, q_pos, k_pos, t.block_n),
        **_query_walk_args(walk),
        **_column_args(columns, walk),
        **_bound_args(q_bound),
        Out=out,
        Lse=lse,
        qk_scale=scale * kernels.LOG2E,
        **_strides("o", out, "bsh"),
        **_strides("l", lse, "bh"),
        G=pattern.block_size,
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        BLOCK_V=t.block_v,
        HEAD_DIM=d,
        MERGE=merge_into is not None,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
    )
    return out, lse


def backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor,
    delta: Tensor,
    pattern: VerticalSlashPattern | None,
    q_pos: Tensor,
    k_pos: Tensor,
    scale: float,
    dq_dtype: torch.dtype | None = None,
    q_bound: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) float32 for the pairs of this chunk pair, given the full-row lse and delta
    (``q_bound``: the rows' document bounds, as in ``forward``).

    dq comes in ``dq_dtype`` if given (the dQ kernel writes it directly: no float32 copy).
    """
    do, q, k, v = _unit_stride(do, q, k, v)
    pattern = _resolve(q, pattern, q_pos, k_pos)
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    cfg = tile_config(pattern.block_size, d, q.device, q.dtype)
    lse = lse.float().contiguous()
    delta = delta.float().contiguous()
    # dq has q's strides (the kernels index both alike); atomically accumulated dq must start at zero.
    mode = cfg.dkdv.dq_mode
    own_kernel = mode == "kernel"
    dq_out = dq_dtype or torch.float32
    dq = torch.empty_like(q, dtype=dq_out if own_kernel else torch.float32).fill_(float("nan") if own_kernel else 0.0)
    dk = torch.full((b, sk, hkv, d), float("nan"), dtype=torch.float32, device=q.device)
    dv = torch.full_like(dk, float("nan"))
    rows = dict(
        DO=do,
        Lse=lse,
        Delta=delta,
        qk_scale=scale * kernels.LOG2E,
        sm_scale=scale,
        **_strides("do", do, "bsh"),
        **_strides("l", lse, "bh"),
    )
    columns = column_walk(pattern, q_pos, k_pos)
    if own_kernel:
        t = cfg.dq
        q_walk = query_walk(pattern, q_pos, k_pos, q_bound)
        kernels._bwd_dq_kernel[(triton.cdiv(sq, t.block_m), b * hq)](
            **_query_tile_args(q, k, v, q_pos, k_pos, t.block_n),
            **_query_walk_args(q_walk),
            **_column_args(columns, q_walk),
            **_bound_args(q_bound),
            **rows,
            DQ=dq,
            G=pattern.block_size,
            BLOCK_M=t.block_m,
            BLOCK_N=t.block_n,
            BLOCK_V=t.block_v,
            HEAD_DIM=d,
            num_warps=t.num_warps,
            num_stages=t.num_stages,
        )
    t = cfg.dkdv
    walk = key_walk(pattern, q_pos, k_pos, t.block_v, q_bound)
    pair = chunk_pair(pattern, q_pos, k_pos)
    shared = dict(
        Q=q,
        K=k,
        V=v,
        **rows,
        DK=dk,
        DV=dv,
        DQ=dq,
        QPos=q_pos,
        KPos=k_pos,
        Sq=sq,
        Sk=sk,
        H=hq,
        GROUP=hq // hkv,
        **_strides("q", q, "bsh"),
        **_strides("k", k, "bsh"),
        **_strides("v", v, "bsh"),
        **_strides("dk", dk, "bsh"),
        G=pattern.block_size,
        BLOCK_M=t.block_m,
        HEAD_DIM=d,
        DQ_MODE=_DQ_MODES[mode],
        **_bound_args(q_bound),
        num_warps=t.num_warps,
        num_stages=t.num_stages,
    )
    kernels._bwd_dkdv_block_kernel[(triton.cdiv(sk, t.block_n), b * hkv)](
        **shared,
        Starts=walk.starts,
        Count=walk.count,
        DiagStart=walk.diag,
        Unmasked=walk.unmasked,
        **_strides("s", walk.starts, "bht"),
        **_strides("c", walk.count, "bh"),
        BLOCK_N=t.block_n,
    )
    n_qt = triton.cdiv(sq, t.block_m)
    vwidth = pair.vcols.shape[-1]
    kernels._bwd_dkdv_vertical_kernel[(triton.cdiv(vwidth, t.block_v), b * hq, triton.cdiv(n_qt, t.v_split))](
        **shared,
        DiagMask=pair.diag_mask,
        VCols=pair.vcols,
        VStartRow=walk.vstart,
        VEndRow=walk.vend,
        NQT=n_qt,
        VWIDTH=vwidth,
        SPLIT=t.v_split,
        **_strides("m", pair.diag_mask, "bh"),
        **_strides("w", pair.vcols, "bh"),
        **_strides("t", walk.vstart, "bh"),
        BLOCK_V=t.block_v,
    )
    if columns is not None:
        chunks = triton.cdiv(columns.rows.shape[-1], t.block_v)
        kernels._bwd_dkdv_column_kernel[(columns.rows.shape[2] * chunks, b * hq)](
            **shared,
            ColRows=columns.rows,
            ColCount=columns.count,
            NCHUNK=chunks,
            **_strides("x", columns.rows, "bht"),
            **_strides("c", columns.count, "bh"),
            BLOCK_V=t.block_v,
        )
    return dq.to(dq_out), dk, dv


def row_delta(do: Tensor, out: Tensor) -> Tensor:
    """delta [B, H, S] = rowsum(dO * O) in float32 in one pass (no float32 copies of dO and O)."""
    do, out = _unit_stride(do, out)
    b, sq, h, d = out.shape
    delta = torch.empty((b, h, sq), dtype=torch.float32, device=out.device)
    rows, block = b * sq * h, 64
    kernels._row_delta_kernel[(triton.cdiv(rows, block),)](
        DO=do,
        Out=out,
        Delta=delta,
        R=rows,
        H=h,
        S=sq,
        **_strides("do", do, "bsh"),
        **_strides("delta", delta, "bh"),
        **_strides("o", out, "bsh"),
        BLOCK_R=block,
        HEAD_DIM=d,
    )
    return delta

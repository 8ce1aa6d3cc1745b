"""Launches of the sparse-attention kernels (kernels.py) with the contract of the torch backend (ops/reference.py).

Tile configurations, the walks of each chunk pair (index.py; built by Triton launches on CUDA,
index_kernels.py, and cached on the pattern), and the kernel launches, by keyword: the forward, and the
backward as one function per kernel (dQ, dK/dV of the block part, of the verticals, of the per-block columns).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import triton
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from ..backend import Chunk
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
    without_blocks,
)
from .index_kernels import chunk_pair_triton, key_walk_triton, query_walk_triton
from .kernels import HeadTensor, KeyGrads, RowStats


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


def query_walk(
    pattern: VerticalSlashPattern, q_pos: Tensor, k_pos: Tensor, q_bound: Tensor | None = None, blocks: bool = True
) -> QueryWalk:
    """The forward's and dQ kernel's walk of a chunk pair (``q_bound``: the rows' document bounds),
    built once per pattern and chunk pair; ``blocks=False``: ``without_blocks``, the verticals only."""
    if not blocks:
        return pattern.index_cache.get(
            ("query", "verticals"),
            q_pos,
            k_pos,
            lambda: without_blocks(query_walk(pattern, q_pos, k_pos, q_bound)),
            q_bound,
        )
    build = query_walk_triton if q_pos.is_cuda else query_walk_torch
    return pattern.index_cache.get(
        ("query",), q_pos, k_pos, lambda: build(pattern, chunk_pair(pattern, q_pos, k_pos), q_bound), q_bound
    )


def key_walk(
    pattern: VerticalSlashPattern,
    q_pos: Tensor,
    k_pos: Tensor,
    v_chunk: int,
    q_bound: Tensor | None = None,
    blocks: bool = True,
) -> KeyWalk:
    """The dK/dV kernels' walk of a chunk pair, verticals in chunks of ``v_chunk`` (``q_bound``: the rows'
    document bounds), built once per pattern, chunk pair and ``v_chunk``; ``blocks=False``: ``without_blocks``."""
    if not blocks:
        return pattern.index_cache.get(
            ("key", v_chunk, "verticals"),
            q_pos,
            k_pos,
            lambda: without_blocks(key_walk(pattern, q_pos, k_pos, v_chunk, q_bound)),
            q_bound,
        )
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
    """Keyword strides of the leading dims of ``t``: ``_strides("do", do, "bsh")`` -> stride_dob, stride_dos, stride_doh."""
    return {f"stride_{name}{dim}": stride for dim, stride in zip(dims, t.stride())}


def unit_stride(*tensors: Tensor) -> tuple[Tensor, ...]:
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


def _columns(columns: ColumnWalk | None, walk: QueryWalk) -> ColumnWalk | None:
    """The ColumnWalk as the forward and dQ kernels take it: its counts with the QueryWalk's count strides
    (the kernels index both alike)."""
    if columns is None or columns.count.stride() == walk.count.stride():
        return columns
    return ColumnWalk.of(columns.rows, torch.empty_like(walk.count).copy_(columns.count))


def bound_args(q_bound: Tensor | None) -> dict:
    """The rows' document bounds [B or 1, Sq] and their batch stride (0 when one row of bounds serves every
    batch row); None without documents (the kernels' DOCS heuristic)."""
    if q_bound is None:
        return dict(QBound=None, stride_bb=None)
    return dict(QBound=q_bound, stride_bb=q_bound.stride(0) if q_bound.shape[0] > 1 else 0)


def _inputs(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor) -> dict:
    """What every attention kernel reads of the inputs: Q, K, V, the positions and the shapes."""
    return dict(
        Q=HeadTensor.of(q),
        K=HeadTensor.of(k),
        V=HeadTensor.of(v),
        QPos=q_pos,
        KPos=k_pos,
        Sq=q.shape[1],
        Sk=k.shape[1],
        H=q.shape[2],
        GROUP=q.shape[2] // k.shape[2],
    )


def _launch(tiles: Tiles) -> dict:
    """The launch options of a pass."""
    return dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)


# ----------------------------------------------------------------------------- the backend contract
def forward(
    chunk: Chunk,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out_dtype: torch.dtype,
    merge_into: tuple[Tensor, Tensor] | None = None,
    *,
    blocks: bool = True,
) -> tuple[Tensor, Tensor]:
    """``AttentionBackend.forward`` (ops/backend.py) by the forward kernel, which merges into ``merge_into`` itself;
    ``blocks=False``: only the verticals no selected block diagonal covers (``index.without_blocks``)."""
    q_pos, k_pos, scale, q_bound = chunk.q_pos, chunk.k_pos, chunk.scale, chunk.q_bound
    q, k, v = unit_stride(q, k, v)
    pattern = _resolve(q, chunk.pattern, q_pos, k_pos)
    b, sq, hq, d = q.shape
    t = tile_config(pattern.block_size, d, q.device, q.dtype).fwd
    walk = query_walk(pattern, q_pos, k_pos, q_bound, blocks)
    if merge_into is not None:
        out, lse = merge_into
    else:
        out = torch.full((b, sq, hq, d), float("nan"), dtype=out_dtype, device=q.device)
        lse = torch.full((b, hq, sq), float("nan"), dtype=torch.float32, device=q.device)
    kernels._fwd_kernel[(triton.cdiv(sq, t.block_m), b * hq)](
        **_inputs(q, k, v, q_pos, k_pos),
        KDesc=_key_tiles(k, t.block_n),
        VDesc=_key_tiles(v, t.block_n),
        Out=HeadTensor.of(out),
        Stats=RowStats.of(lse),
        Walk=walk,
        Columns=_columns(column_walk(pattern, q_pos, k_pos), walk),
        **bound_args(q_bound),
        qk_scale=scale * kernels.LOG2E,
        G=pattern.block_size,
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        BLOCK_V=t.block_v,
        HEAD_DIM=d,
        MERGE=merge_into is not None,
        **_launch(t),
    )
    return out, lse


@dataclass(frozen=True)
class _Backward:
    """What the backward's kernels share: their common arguments (the inputs, dO, the rows' statistics, dQ,
    the documents, the scales), dK and dV, the pattern, the chunk pair and the tiles."""

    args: dict
    grads: KeyGrads
    pattern: VerticalSlashPattern
    q_pos: Tensor
    k_pos: Tensor
    q_bound: Tensor | None
    cfg: TileConfig

    def dkdv(self) -> dict:
        """The arguments every dK/dV kernel takes: the common ones, dK and dV, and the dK/dV tiles."""
        t = self.cfg.dkdv
        return dict(
            **self.args,
            Grads=self.grads,
            G=self.pattern.block_size,
            BLOCK_M=t.block_m,
            HEAD_DIM=self.grads.dk.shape[-1],
            DQ_MODE=_DQ_MODES[t.dq_mode],
            **_launch(t),
        )


def _dq(bw: _Backward, k: Tensor, v: Tensor, walk: QueryWalk) -> None:
    """dQ by its own kernel over the query walk (the forward's), written into the arguments' DQ (Q's strides)."""
    t = bw.cfg.dq
    b, sq, hq, d = bw.args["Q"].ptr.shape
    kernels._bwd_dq_kernel[(triton.cdiv(sq, t.block_m), b * hq)](
        **bw.args,
        KDesc=_key_tiles(k, t.block_n),
        VDesc=_key_tiles(v, t.block_n),
        Walk=walk,
        Columns=_columns(column_walk(bw.pattern, bw.q_pos, bw.k_pos), walk),
        G=bw.pattern.block_size,
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        BLOCK_V=t.block_v,
        HEAD_DIM=d,
        **_launch(t),
    )


def _dkdv_block(bw: _Backward, walk: KeyWalk) -> None:
    """dK/dV of every key tile's block part (off-diagonal blocks, then the causal-diagonal block)."""
    b, sk, hkv, _ = bw.grads.dk.shape
    block_n = bw.cfg.dkdv.block_n
    kernels._bwd_dkdv_block_kernel[(triton.cdiv(sk, block_n), b * hkv)](**bw.dkdv(), Walk=walk, BLOCK_N=block_n)


def _dkdv_vertical(bw: _Backward, walk: KeyWalk) -> None:
    """dK/dV of the vertical columns, added atomically (each column chunk's rows split over programs)."""
    t = bw.cfg.dkdv
    b, sq, hq, _ = bw.args["Q"].ptr.shape
    n_qt = triton.cdiv(sq, t.block_m)
    vwidth = walk.vcols.shape[-1]
    kernels._bwd_dkdv_vertical_kernel[(triton.cdiv(vwidth, t.block_v), b * hq, triton.cdiv(n_qt, t.v_split))](
        **bw.dkdv(), Walk=walk, NQT=n_qt, VWIDTH=vwidth, SPLIT=t.v_split, BLOCK_V=t.block_v
    )


def _dkdv_columns(bw: _Backward, columns: ColumnWalk) -> None:
    """dK/dV of the query blocks' own columns, added atomically (blocks share column keys)."""
    block_v = bw.cfg.dkdv.block_v
    b, _, hq, _ = bw.args["Q"].ptr.shape
    chunks = triton.cdiv(columns.rows.shape[-1], block_v)
    kernels._bwd_dkdv_column_kernel[(columns.rows.shape[2] * chunks, b * hq)](
        **bw.dkdv(), Columns=columns, NCHUNK=chunks, BLOCK_V=block_v
    )


def backward(
    chunk: Chunk,
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor,
    delta: Tensor,
    dq_dtype: torch.dtype | None = None,
    *,
    blocks: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """``AttentionBackend.backward`` (ops/backend.py) by the dQ and dK/dV kernels; the dQ kernel writes dq in ``dq_dtype``
    directly (no float32 copy). ``blocks=False``: only the verticals no selected block diagonal covers (the block
    kernel then only zeroes dK and dV)."""
    q_pos, k_pos, scale, q_bound = chunk.q_pos, chunk.k_pos, chunk.scale, chunk.q_bound
    do, q, k, v = unit_stride(do, q, k, v)
    pattern = _resolve(q, chunk.pattern, q_pos, k_pos)
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    cfg = tile_config(pattern.block_size, d, q.device, q.dtype)
    # dq has q's strides (the kernels index both alike); atomically accumulated dq must start at zero.
    own_kernel = cfg.dkdv.dq_mode == "kernel"
    dq_out = dq_dtype or torch.float32
    dq = torch.empty_like(q, dtype=dq_out if own_kernel else torch.float32).fill_(float("nan") if own_kernel else 0.0)
    dk = torch.full((b, sk, hkv, d), float("nan"), dtype=torch.float32, device=q.device)
    dv = torch.full_like(dk, float("nan"))
    args = dict(
        **_inputs(q, k, v, q_pos, k_pos),
        DO=HeadTensor.of(do),
        Stats=RowStats.of(lse.float().contiguous(), delta.float().contiguous()),
        DQ=dq,
        **bound_args(q_bound),
        qk_scale=scale * kernels.LOG2E,
        sm_scale=scale,
    )
    bw = _Backward(args, KeyGrads.of(dk, dv), pattern, q_pos, k_pos, q_bound, cfg)
    if own_kernel:
        _dq(bw, k, v, query_walk(pattern, q_pos, k_pos, q_bound, blocks))
    walk = key_walk(pattern, q_pos, k_pos, cfg.dkdv.block_v, q_bound, blocks)
    _dkdv_block(bw, walk)
    _dkdv_vertical(bw, walk)
    columns = column_walk(pattern, q_pos, k_pos)
    if columns is not None:
        _dkdv_columns(bw, columns)
    return dq.to(dq_out), dk, dv


def row_delta(do: Tensor, out: Tensor) -> Tensor:
    """delta [B, H, S] = rowsum(dO * O) in float32 in one pass (no float32 copies of dO and O)."""
    do, out = unit_stride(do, out)
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

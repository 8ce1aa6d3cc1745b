"""Triton backend: launches the kernels of triton_kernels.py with the contract of torch_backend.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import triton
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from ..pattern import VerticalSlashPattern
from . import kernels as tk
from .index import DENSE_BLOCK, ChunkPair, KeyWalk, QueryWalk, build_key_walk, build_query_walk, chunk_pair


@dataclass(frozen=True)
class Tiles:
    """Tile sizes of one pass (each divides the pattern block G) and its kernels' launch shape."""

    block_m: int
    block_n: int
    block_v: int
    num_warps: int
    num_stages: int
    # backward only, how dQ is made: "kernel" (its own kernel: 3 more matrix products per tile) or
    # "atomic" (added by the dK/dV kernels as they go; on an H200 slower, bench/results/tune_kernels.json).
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
    """Small tiles under the interpreter; on the GPU the fastest measured on an H200 (bench/tune_kernels.py)
    for half precision, and tiles that fit in shared memory for float32 (a correctness path)."""
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


def _cached(pattern: VerticalSlashPattern, key: tuple, q_pos: Tensor, k_pos: Tensor, build):
    """``build()``, computed once per (key, chunk pair) within one pattern's life.

    The cache holds the position tensors themselves, so their ids cannot be reused while it lives.
    """
    key = (*key, id(q_pos), id(k_pos))
    hit = pattern.index_cache.get(key)
    if hit is None:
        hit = pattern.index_cache[key] = (q_pos, k_pos, build())
    return hit[2]


def _pair(pattern: VerticalSlashPattern, q_pos: Tensor, k_pos: Tensor) -> ChunkPair:
    """What the query and key walks of a chunk pair share (built once per pattern and chunk pair)."""
    return _cached(pattern, ("pair",), q_pos, k_pos, lambda: chunk_pair(pattern, q_pos, k_pos))


def query_walk(pattern: VerticalSlashPattern, q_pos: Tensor, k_pos: Tensor) -> QueryWalk:
    """The forward's and dQ kernel's index of this chunk pair (built once per pattern and chunk pair)."""
    return _cached(pattern, ("query",), q_pos, k_pos, lambda: build_query_walk(pattern, _pair(pattern, q_pos, k_pos)))


def key_walk(pattern: VerticalSlashPattern, q_pos: Tensor, k_pos: Tensor, v_chunk: int) -> KeyWalk:
    """The dK/dV kernels' index of this chunk pair, verticals in chunks of ``v_chunk``."""
    return _cached(
        pattern, ("key", v_chunk), q_pos, k_pos, lambda: build_key_walk(pattern, _pair(pattern, q_pos, k_pos), v_chunk)
    )


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


def _query_walk_args(w: QueryWalk) -> tuple[tuple, tuple]:
    """Index tensors and strides shared by the forward and dQ kernels."""
    return (w.q_gblock, w.starts, w.count, w.diag, w.diag_mask, w.vcols, w.vcount), (
        *w.starts.stride()[:3],
        *w.count.stride()[:2],
        *w.diag_mask.stride()[:2],
        *w.vcols.stride()[:2],
    )


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
) -> tuple[Tensor, Tensor]:
    """(out [B, Sq, Hq, D] in out_dtype, lse [B, Hq, Sq] float32); with ``merge_into`` (out, lse) of
    earlier keys, the kernel merges its result into them in place and returns them."""
    q, k, v = _unit_stride(q, k, v)
    pattern = _resolve(q, pattern, q_pos, k_pos)
    b, sq, hq, d = q.shape
    t = tile_config(pattern.block_size, d, q.device, q.dtype).fwd
    tensors, strides = _query_walk_args(query_walk(pattern, q_pos, k_pos))
    if merge_into is not None:
        out, lse = merge_into
    else:
        out = torch.full((b, sq, hq, d), float("nan"), dtype=out_dtype, device=q.device)
        lse = torch.full((b, hq, sq), float("nan"), dtype=torch.float32, device=q.device)
    tk._fwd_kernel[(triton.cdiv(sq, t.block_m), b * hq)](
        q,
        k,
        v,
        _key_tiles(k, t.block_n),
        _key_tiles(v, t.block_n),
        out,
        lse,
        q_pos,
        k_pos,
        *tensors,
        scale * tk.LOG2E,
        sq,
        k.shape[1],
        hq,
        hq // k.shape[2],
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *out.stride()[:3],
        *lse.stride()[:2],
        *strides,
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
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) float32 for the pairs of this chunk pair, given the full-row lse and delta.

    dq comes in ``dq_dtype`` if given (the dQ kernel writes it directly: no float32 copy).
    """
    do, q, k, v = _unit_stride(do, q, k, v)
    pattern = _resolve(q, pattern, q_pos, k_pos)
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
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
    scales = (scale * tk.LOG2E, scale)
    qkv_strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *lse.stride()[:2])
    if own_kernel:
        t = cfg.dq
        tensors, strides = _query_walk_args(query_walk(pattern, q_pos, k_pos))
        tk._bwd_dq_kernel[(triton.cdiv(sq, t.block_m), b * hq)](
            q,
            k,
            v,
            _key_tiles(k, t.block_n),
            _key_tiles(v, t.block_n),
            do,
            lse,
            delta,
            dq,
            q_pos,
            k_pos,
            *tensors,
            *scales,
            sq,
            sk,
            hq,
            group,
            *qkv_strides,
            *strides,
            G=pattern.block_size,
            BLOCK_M=t.block_m,
            BLOCK_N=t.block_n,
            BLOCK_V=t.block_v,
            HEAD_DIM=d,
            num_warps=t.num_warps,
            num_stages=t.num_stages,
        )
    t = cfg.dkdv
    w = key_walk(pattern, q_pos, k_pos, t.block_v)
    pair = _pair(pattern, q_pos, k_pos)
    launch = dict(DQ_MODE=_DQ_MODES[mode], num_warps=t.num_warps, num_stages=t.num_stages)
    tk._bwd_dkdv_block_kernel[(triton.cdiv(sk, t.block_n), b * hkv)](
        q,
        k,
        v,
        do,
        lse,
        delta,
        dk,
        dv,
        dq,
        q_pos,
        k_pos,
        w.starts,
        w.count,
        w.diag,
        *scales,
        sq,
        sk,
        hq,
        group,
        *qkv_strides,
        *dk.stride()[:3],
        *w.starts.stride()[:3],
        *w.count.stride()[:2],
        G=pattern.block_size,
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        HEAD_DIM=d,
        **launch,
    )
    n_qt = triton.cdiv(sq, t.block_m)
    tk._bwd_dkdv_vertical_kernel[(triton.cdiv(pair.vcols.shape[-1], t.block_v), b * hq, triton.cdiv(n_qt, t.v_split))](
        q,
        k,
        v,
        do,
        lse,
        delta,
        dk,
        dv,
        dq,
        q_pos,
        k_pos,
        pair.diag_mask,
        pair.vcols,
        w.vstart,
        *scales,
        sq,
        sk,
        hq,
        group,
        n_qt,
        pair.vcols.shape[-1],
        t.v_split,
        *qkv_strides,
        *dk.stride()[:3],
        *pair.diag_mask.stride()[:2],
        *pair.vcols.stride()[:2],
        *w.vstart.stride()[:2],
        G=pattern.block_size,
        BLOCK_M=t.block_m,
        BLOCK_V=t.block_v,
        HEAD_DIM=d,
        **launch,
    )
    return dq.to(dq_out), dk, dv


def row_delta(do: Tensor, out: Tensor) -> Tensor:
    """delta [B, H, S] = rowsum(dO * O) in float32 in one pass (no float32 copies of dO and O)."""
    do, out = _unit_stride(do, out)
    b, sq, h, d = out.shape
    delta = torch.empty((b, h, sq), dtype=torch.float32, device=out.device)
    rows, block = b * sq * h, 64
    tk._row_delta_kernel[(triton.cdiv(rows, block),)](
        do,
        out,
        delta,
        rows,
        h,
        sq,
        *do.stride()[:3],
        *delta.stride()[:2],
        *out.stride()[:3],
        BLOCK_R=block,
        HEAD_DIM=d,
    )
    return delta

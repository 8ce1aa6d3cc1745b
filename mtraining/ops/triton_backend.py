"""Triton backend: launches the kernels of triton_kernels.py with the contract of torch_backend.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from . import triton_kernels as tk
from .kernel_index import DENSE_BLOCK, KernelIndex, build_kernel_index
from .pattern import VerticalSlashPattern


@dataclass(frozen=True)
class Tiles:
    """Tile sizes of one pass (each divides the pattern block G) and its kernels' launch shape."""

    block_m: int
    block_n: int
    block_v: int
    num_warps: int
    num_stages: int
    fused_dq: bool = False  # backward only: dQ added atomically by the dK/dV kernels, no dQ kernel


@dataclass(frozen=True)
class TileConfig:
    """Forward tiles, and backward tiles (dQ and dK/dV kernels share one kernel index)."""

    fwd: Tiles
    bwd: Tiles


def tile_config(block_size: int, head_dim: int, device: torch.device) -> TileConfig:
    """Small tiles under the interpreter; on the GPU the fastest measured on an H200 (bench/results)."""
    if device.type != "cuda":
        t = min(block_size, 32)
        return TileConfig(Tiles(t, t, t, 4, 1), Tiles(t, t, t, 4, 1))
    g = block_size
    return TileConfig(Tiles(min(g, 128), min(g, 128), 64, 8, 3), Tiles(min(g, 64), min(g, 64), 64, 4, 3))


def _index(pattern: VerticalSlashPattern, q_pos: Tensor, k_pos: Tensor, tiles: Tiles) -> KernelIndex:
    """Build (or reuse, within one pattern's life) the kernel index of this chunk pair.

    The cache holds the position tensors themselves, so their ids cannot be reused while it lives.
    """
    key = (id(q_pos), id(k_pos), tiles.block_m, tiles.block_n, tiles.block_v)
    hit = pattern.index_cache.get(key)
    if hit is None:
        index = build_kernel_index(pattern, q_pos, k_pos, tiles.block_m, tiles.block_n, tiles.block_v)
        hit = pattern.index_cache[key] = (q_pos, k_pos, index)
    return hit[2]


def _resolve(q: Tensor, pattern: VerticalSlashPattern | None, q_pos: Tensor, k_pos: Tensor) -> VerticalSlashPattern:
    """A dense pattern stands in for pattern=None (dense causal)."""
    if pattern is not None:
        return pattern
    seq_len = int(max(q_pos.max().item(), k_pos.max().item())) + 1
    return VerticalSlashPattern.dense(q.shape[0], q.shape[2], seq_len, DENSE_BLOCK, device=q.device)


def _walk_args(idx: KernelIndex) -> tuple:
    """Index tensors and strides shared by the forward and dQ kernels."""
    return (
        idx.q_gblock, idx.fwd_starts, idx.fwd_count, idx.fwd_diag, idx.diag_mask, idx.vcols, idx.vcount_q,
    ), (
        *idx.fwd_starts.stride()[:3], *idx.fwd_count.stride()[:2], *idx.diag_mask.stride()[:2],
        *idx.vcols.stride()[:2],
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
) -> tuple[Tensor, Tensor]:
    """(out [B, Sq, Hq, D] in out_dtype, lse [B, Hq, Sq] float32)."""
    pattern = _resolve(q, pattern, q_pos, k_pos)
    b, sq, hq, d = q.shape
    cfg = tile_config(pattern.block_size, d, q.device).fwd
    idx = _index(pattern, q_pos, k_pos, cfg)
    out = torch.full((b, sq, hq, d), float("nan"), dtype=out_dtype, device=q.device)
    lse = torch.full((b, hq, sq), float("nan"), dtype=torch.float32, device=q.device)
    tensors, strides = _walk_args(idx)
    tk._fwd_kernel[(triton.cdiv(sq, cfg.block_m), b * hq)](
        q, k, v, out, lse, q_pos, k_pos, *tensors,
        scale * tk.LOG2E, sq, k.shape[1], hq, hq // k.shape[2],
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], *lse.stride()[:2], *strides,
        G=pattern.block_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, HEAD_DIM=d,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
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
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) float32 for the pairs of this chunk pair, given the full-row lse and delta."""
    pattern = _resolve(q, pattern, q_pos, k_pos)
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    cfg = tile_config(pattern.block_size, d, q.device).bwd
    idx = _index(pattern, q_pos, k_pos, cfg)
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    lse = lse.float().contiguous()
    delta = delta.float().contiguous()
    # dq has q's strides (the kernels index both alike); atomically accumulated dq must start at zero.
    dq = torch.empty_like(q, dtype=torch.float32).fill_(0.0 if cfg.fused_dq else float("nan"))
    dk = torch.full((b, sk, hkv, d), float("nan"), dtype=torch.float32, device=q.device)
    dv = torch.full_like(dk, float("nan"))
    scales = (scale * tk.LOG2E, scale)
    qkv_strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *lse.stride()[:2])
    tensors, strides = _walk_args(idx)
    if not cfg.fused_dq:
        tk._bwd_dq_kernel[(triton.cdiv(sq, cfg.block_m), b * hq)](
            q, k, v, do, lse, delta, dq, q_pos, k_pos, *tensors,
            *scales, sq, sk, hq, group, *qkv_strides, *strides,
            G=pattern.block_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, HEAD_DIM=d,
            **launch,
        )
    tk._bwd_dkdv_block_kernel[(triton.cdiv(sk, cfg.block_n), b * hkv)](
        q, k, v, do, lse, delta, dk, dv, dq, q_pos, k_pos, idx.bwd_starts, idx.bwd_count, idx.bwd_diag,
        *scales, sq, sk, hq, group, *qkv_strides, *dk.stride()[:3],
        *idx.bwd_starts.stride()[:3], *idx.bwd_count.stride()[:2],
        G=pattern.block_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=d, FUSED_DQ=cfg.fused_dq,
        **launch,
    )
    tk._bwd_dkdv_vertical_kernel[(triton.cdiv(idx.vcols.shape[-1], cfg.block_v), b * hq)](
        q, k, v, do, lse, delta, dk, dv, dq, q_pos, k_pos, idx.q_gblock, idx.diag_mask, idx.vcols, idx.vstart_q,
        *scales, sq, sk, hq, group, idx.q_gblock.shape[0], idx.vcols.shape[-1], *qkv_strides, *dk.stride()[:3],
        *idx.diag_mask.stride()[:2], *idx.vcols.stride()[:2], *idx.vstart_q.stride()[:2],
        G=pattern.block_size, BLOCK_M=cfg.block_m, BLOCK_V=cfg.block_v, HEAD_DIM=d, FUSED_DQ=cfg.fused_dq,
        **launch,
    )
    return dq, dk, dv

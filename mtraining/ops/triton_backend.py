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
class TileConfig:
    """Tile sizes (all divide the pattern block G) and launch shape of the kernels."""

    block_m: int
    block_n: int
    block_v: int
    num_warps: int
    num_stages: int


def tile_config(block_size: int, head_dim: int, device: torch.device) -> TileConfig:
    """Tiles that fit the block grid; larger on the GPU, small under the interpreter."""
    if device.type != "cuda":
        t = min(block_size, 32)
        return TileConfig(t, t, t, 4, 1)
    return TileConfig(min(block_size, 64), min(block_size, 64), 64, 4 if head_dim <= 64 else 8, 2)


def _index(pattern: VerticalSlashPattern, q_pos: Tensor, k_pos: Tensor, cfg: TileConfig) -> KernelIndex:
    return build_kernel_index(pattern, q_pos, k_pos, cfg.block_m, cfg.block_n, cfg.block_v)


def _resolve(q: Tensor, pattern: VerticalSlashPattern | None, q_pos: Tensor, k_pos: Tensor) -> VerticalSlashPattern:
    """A dense pattern stands in for pattern=None (dense causal)."""
    if pattern is not None:
        return pattern
    seq_len = int(max(q_pos.max().item(), k_pos.max().item())) + 1
    return VerticalSlashPattern.dense(q.shape[0], q.shape[2], seq_len, DENSE_BLOCK, device=q.device)


def _pattern_strides(idx: KernelIndex) -> tuple[int, ...]:
    return (
        idx.diags.stride(0), idx.diags.stride(1),
        idx.diag_count.stride(0), idx.diag_count.stride(1),
        idx.diag_mask.stride(0), idx.diag_mask.stride(1),
        idx.vcols.stride(0), idx.vcols.stride(1),
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
    cfg = tile_config(pattern.block_size, d, q.device)
    idx = _index(pattern, q_pos, k_pos, cfg)
    out = torch.full((b, sq, hq, d), float("nan"), dtype=out_dtype, device=q.device)
    lse = torch.full((b, hq, sq), float("nan"), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(sq, cfg.block_m), b * hq)
    tk._fwd_kernel[grid](
        q, k, v, out, lse, q_pos, k_pos,
        idx.q_gblock, idx.k_block_start, idx.diags, idx.diag_count, idx.diag_mask, idx.vcols, idx.vcount_q,
        scale * tk.LOG2E, sq, k.shape[1], hq, hq // k.shape[2],
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], *lse.stride()[:2],
        *_pattern_strides(idx), idx.vcount_q.stride(0), idx.vcount_q.stride(1),
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
    cfg = tile_config(pattern.block_size, d, q.device)
    idx = _index(pattern, q_pos, k_pos, cfg)
    do = do.contiguous() if do.stride(-1) != 1 else do
    lse = lse.float().contiguous()
    delta = delta.float().contiguous()
    dq = torch.empty_like(q, dtype=torch.float32).fill_(float("nan"))  # same strides as q: the kernel indexes both alike
    dk = torch.full((b, sk, hkv, d), float("nan"), dtype=torch.float32, device=q.device)
    dv = torch.full_like(dk, float("nan"))
    common = (scale * tk.LOG2E, scale)
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    qkv_strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *lse.stride()[:2])
    tk._bwd_dq_kernel[(triton.cdiv(sq, cfg.block_m), b * hq)](
        q, k, v, do, lse, delta, dq, q_pos, k_pos,
        idx.q_gblock, idx.k_block_start, idx.diags, idx.diag_count, idx.diag_mask, idx.vcols, idx.vcount_q,
        *common, sq, sk, hq, group,
        *qkv_strides, *_pattern_strides(idx), idx.vcount_q.stride(0), idx.vcount_q.stride(1),
        G=pattern.block_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, HEAD_DIM=d,
        **launch,
    )
    tk._bwd_dkdv_block_kernel[(triton.cdiv(sk, cfg.block_n), b * hkv)](
        q, k, v, do, lse, delta, dk, dv, q_pos, k_pos,
        idx.k_gblock, idx.q_block_start, idx.diags, idx.diag_count,
        *common, sq, sk, hq, group, pattern.num_blocks,
        *qkv_strides, *dk.stride()[:3],
        idx.diags.stride(0), idx.diags.stride(1), idx.diag_count.stride(0), idx.diag_count.stride(1),
        G=pattern.block_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=d,
        **launch,
    )
    n_chunks = triton.cdiv(idx.vcols.shape[-1], cfg.block_v)
    tk._bwd_dkdv_vertical_kernel[(n_chunks, b * hq)](
        q, k, v, do, lse, delta, dk, dv, q_pos, k_pos,
        idx.q_gblock, idx.diag_mask, idx.vcols, idx.vstart_q,
        *common, sq, sk, hq, group, idx.q_gblock.shape[0], idx.vcols.shape[-1],
        *qkv_strides, *dk.stride()[:3],
        idx.diag_mask.stride(0), idx.diag_mask.stride(1), idx.vcols.stride(0), idx.vcols.stride(1),
        idx.vstart_q.stride(0), idx.vstart_q.stride(1),
        G=pattern.block_size, BLOCK_M=cfg.block_m, BLOCK_V=cfg.block_v, HEAD_DIM=d,
        **launch,
    )
    return dq, dk, dv


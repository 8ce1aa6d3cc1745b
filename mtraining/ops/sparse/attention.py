"""Public sparse attention: backend dispatch, the forward/backward primitives, the autograd op.

``attention_forward`` / ``attention_backward`` are the building blocks the ring engines call once
per ring step; ``sparse_attention`` is the single-device autograd op users call.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from .. import reference as torch_backend
from ..checks import SUPPORTED_HEAD_DIMS, check_pattern, check_qkv, check_reuse, default_positions
from ..dense import blocks as dense_blocks
from ..pattern import VerticalSlashPattern
from .index import DENSE_BLOCK, check_aligned_positions

Backend = Literal["auto", "triton", "torch"]
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def resolve_backend(backend: Backend, device: torch.device) -> Literal["triton", "torch"]:
    """'auto' picks the Triton kernels on CUDA and plain PyTorch elsewhere (ask for 'triton' explicitly
    to run the kernels in Triton's interpreter on the CPU, with TRITON_INTERPRET=1)."""
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    return backend


def _backend_module(name: str):
    if name == "triton":
        from . import launch as triton_backend

        return triton_backend
    return torch_backend


def prepare_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: VerticalSlashPattern | None,
    q_pos: Tensor | None,
    k_pos: Tensor | None,
    softmax_scale: float | None,
    backend: Backend,
) -> tuple[Tensor, Tensor, float, str]:
    """Validate everything once; return (q_pos, k_pos, scale, resolved backend)."""
    name = resolve_backend(backend, q.device)
    check_qkv(q, k, v, float_dtypes=KERNEL_DTYPES if name == "triton" else None)
    if name == "triton" and q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {q.shape[-1]} is not supported by the kernels; use one of {SUPPORTED_HEAD_DIMS}")
    q_given, k_given = q_pos is not None, k_pos is not None
    q_pos, k_pos = default_positions(q, k, q_pos, k_pos)
    if pattern is not None:
        check_pattern(pattern, q)
    if name == "triton":
        grid = pattern.block_size if pattern is not None else DENSE_BLOCK
        # default positions are checked on the host: the device check would wait for the GPU
        if q_given or (k.shape[1] - q.shape[1]) % grid:
            check_aligned_positions(q_pos, grid, "q_pos")
        if k_given:
            check_aligned_positions(k_pos, grid, "k_pos")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return q_pos, k_pos, scale, name


def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: VerticalSlashPattern | None,
    q_pos: Tensor,
    k_pos: Tensor,
    scale: float,
    *,
    backend: str = "auto",
    out_dtype: torch.dtype | None = None,
    merge_into: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """One block of attention: (out [B, Sq, Hq, D], lse [B, Hq, Sq] float32). No validation (hot path).

    ``merge_into``: (out, lse) over other keys (an earlier ring step, out in ``out_dtype``), into
    which this block's result is merged in place (by the kernel itself on the Triton backend).
    """
    name = resolve_backend(backend, q.device)
    return _backend_module(name).forward(q, k, v, pattern, q_pos, k_pos, scale, out_dtype or q.dtype, merge_into)


def attention_backward(
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
    *,
    backend: str = "auto",
    dq_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv, float32; dq in ``dq_dtype`` if given) of one block given the full-row
    lse and delta = rowsum(dO * O)."""
    name = resolve_backend(backend, q.device)
    return _backend_module(name).backward(do, q, k, v, lse, delta, pattern, q_pos, k_pos, scale, dq_dtype)


def row_delta(do: Tensor, out: Tensor) -> Tensor:
    """delta [B, H, S] = rowsum(dO * O) in float32 (float64 for float64): the softmax-backward correction term."""
    if out.is_cuda and out.dtype != torch.float64 and out.shape[-1] in SUPPORTED_HEAD_DIMS:
        from .launch import row_delta as one_pass

        return one_pass(do, out)
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    return (do.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()


def _dense_route(q: Tensor, k: Tensor, pattern, q_pos: Tensor, k_pos: Tensor, backend: str):
    """(block ops, blocks) when a dense call runs as dense blocks (cuDNN on CUDA; dense_blocks.py), else None."""
    if pattern is not None:
        return None
    ops = dense_blocks.select_ops(q, k, backend)
    blocks = dense_blocks.blocks_for(q_pos, k_pos) if ops is not None else None
    return (ops, blocks) if blocks is not None else None


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pattern, q_pos, k_pos, scale, backend, reuse):
        route = _dense_route(q, k, pattern, q_pos, k_pos, backend)
        if reuse is not None:
            out, lse = reuse
        elif route is not None:
            out, lse = dense_blocks.forward(q, k, v, route[1], scale, q.dtype, route[0])
        else:
            out, lse = attention_forward(q, k, v, pattern, q_pos, k_pos, scale, backend=backend)
        ctx.save_for_backward(q, k, v, out, lse, q_pos, k_pos)
        ctx.pattern, ctx.scale, ctx.backend, ctx.route = pattern, scale, backend, route
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, q_pos, k_pos = ctx.saved_tensors
        if ctx.route is not None:
            ops, blocks = ctx.route
            dq, dk, dv = dense_blocks.backward(dout, q, k, v, out, lse, blocks, ctx.scale, ops)
        else:
            delta = row_delta(dout, out)
            dq, dk, dv = attention_backward(
                dout,
                q,
                k,
                v,
                lse,
                delta,
                ctx.pattern,
                q_pos,
                k_pos,
                ctx.scale,
                backend=ctx.backend,
                dq_dtype=q.dtype,
            )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: VerticalSlashPattern | None = None,
    q_pos: Tensor | None = None,
    k_pos: Tensor | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: Backend = "auto",
    reuse: tuple[Tensor, Tensor] | None = None,
):
    """Causal vertical-slash sparse attention (dense causal when ``pattern`` is None: on CUDA in
    fp16/bf16 through cuDNN as a few dense blocks, see ops/dense_blocks.py and MTRAINING_DENSE_BACKEND).

    q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D]; positions are global (default: the last Sq of Sk keys).
    Returns out [B, Sq, Hq, D] (and lse [B, Hq, Sq] float32 with ``return_lse``). Differentiable in
    q, k, v; the pattern carries no gradient. ``reuse``: (out, lse) that an earlier call with the same
    inputs returned; the forward kernels are skipped and the backward uses them (for the forward
    that activation checkpointing recomputes).
    """
    q_pos, k_pos, scale, name = prepare_inputs(q, k, v, pattern, q_pos, k_pos, softmax_scale, backend)
    check_reuse(reuse, q)
    out, lse = _SparseAttention.apply(q, k, v, pattern, q_pos, k_pos, scale, name, reuse)
    return (out, lse) if return_lse else out

"""Flat ring attention: every rank's queries meet every rank's keys in W steps, in any layout.

At step t rank r attends its Q shard to the K/V shard that started on rank (r - t) mod W, while
the next K/V shard is already travelling (comm.py: asynchronous P2P, double-buffered, a side
stream on CUDA). Each step is one call of ``attention_forward`` with the global positions of the
rows, so the global pattern (or dense causal) selects exactly the right pairs in every layout;
partial (out, lse) merge exactly in float32 (float64 for float64 inputs). Dense calls (no pattern)
run a step as a few dense blocks through cuDNN instead where the step decomposes so
(ops/dense_blocks.py: every contiguous and zigzag step, the striped layout's step 0).

The backward computes delta = rowsum(dO * O) once, circulates K/V again and, one hop behind,
the dK/dV accumulator of the keys being visited: at step t rank r adds its contribution to the
accumulator of rank (r - t)'s keys and passes it on, so after W hops every rank holds the full
dK/dV of its own shard. dQ stays local. K/V travel with their own (GQA) heads, never expanded.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from ...ops.checks import SUPPORTED_HEAD_DIMS, check_pattern, check_qkv, check_reuse
from ...ops.dense import blocks as dense_blocks
from ...ops.pattern import PatternConfig, VerticalSlashPattern
from ...ops.reference import merge_partial
from ...ops.sparse.attention import (
    KERNEL_DTYPES,
    Backend,
    attention_backward,
    attention_forward,
    resolve_backend,
    row_delta,
)
from ..estimate import estimate_pattern_cp
from ..layout import Layout
from .comm import RingComm


@functools.lru_cache(maxsize=64)
def _positions(layout: Layout, device: torch.device) -> tuple[Tensor, ...]:
    """int32 global positions of every rank's shard on ``device`` (stable objects: kernel indices cache on them)."""
    return tuple(layout.positions(r).to(device=device, dtype=torch.int32) for r in range(layout.world_size))


@functools.lru_cache(maxsize=64)
def _active_steps(layout: Layout, rank: int) -> tuple[bool, ...]:
    """Per ring step: does rank's Q see any key of the step's source causally (first key <= last query)?"""
    last_query = int(layout.positions(rank)[-1])
    w = layout.world_size
    return tuple(int(layout.positions((rank - t) % w)[0]) <= last_query for t in range(w))


@functools.lru_cache(maxsize=16)
def _ring_comm(group: dist.ProcessGroup, device: torch.device) -> RingComm:
    """One RingComm (neighbours, side stream) per group object and device; a re-created group is a new key."""
    return RingComm(group, device)


@functools.lru_cache(maxsize=8)
def _dense_pattern(batch: int, heads: int, seq_len: int, block: int, device: torch.device) -> VerticalSlashPattern:
    """Dense causal on the layout's G-grid, for the Triton kernels (its index cache then lives across calls)."""
    return VerticalSlashPattern.dense(batch, heads, seq_len, block, device=device)


@functools.lru_cache(maxsize=256)
def _layout_blocks(layout: Layout, rank: int, src: int) -> tuple[dense_blocks.Block, ...] | None:
    """Dense blocks of rank's queries against src's keys (None: too many, run the backend's dense path)."""
    return dense_blocks.decompose(layout.positions(rank), layout.positions(src))


class DenseSteps:
    """Dense (pattern=None) ring steps through per-block attention (cuDNN on CUDA) where they decompose."""

    def __init__(self, layout: Layout, rank: int, ops: dense_blocks.BlockOps) -> None:
        self.layout = layout
        self.rank = rank
        self.ops = ops

    def blocks(self, src: int) -> tuple[dense_blocks.Block, ...] | None:
        return _layout_blocks(self.layout, self.rank, src)


def _step_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern,
    plan,
    src: int,
    out_dtype: torch.dtype,
    merge_into: tuple[Tensor, Tensor] | None = None,
):
    """One ring step's (out, lse) of this rank's queries against the keys that started on ``src``;
    with ``merge_into`` (the earlier steps' out and lse) merged into those, in place."""
    blocks = plan.dense.blocks(src) if plan.dense is not None else None
    if blocks is None:
        return attention_forward(
            q,
            k,
            v,
            pattern,
            plan.q_pos,
            plan.positions[src],
            plan.scale,
            backend=plan.backend,
            out_dtype=out_dtype,
            merge_into=merge_into,
        )
    part = dense_blocks.forward(q, k, v, blocks, plan.scale, out_dtype, plan.dense.ops)
    if merge_into is None:
        return part
    merge_partial(*merge_into, *part)
    return merge_into


def _step_backward(do, q, k, v, out, lse, delta, pattern, plan, src: int):
    """One ring step's (dq, dk, dv) given the whole rows' out, lse and delta."""
    blocks = plan.dense.blocks(src) if plan.dense is not None else None
    if blocks is not None:
        return dense_blocks.backward(do, q, k, v, out, lse, blocks, plan.scale, plan.dense.ops)
    return attention_backward(
        do, q, k, v, lse, delta, pattern, plan.q_pos, plan.positions[src], plan.scale, backend=plan.backend
    )


class _Plan:
    """What a ring call needs besides tensors: neighbours, positions, active steps, backend, scale, dense steps."""

    def __init__(
        self,
        comm: RingComm,
        layout: Layout,
        device: torch.device,
        backend: str,
        scale: float,
        dense_ops: dense_blocks.BlockOps | None = None,
    ) -> None:
        self.comm = comm
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.positions = _positions(layout, device)
        self.active = _active_steps(layout, self.rank)
        self.backend = backend
        self.scale = scale
        self.dense = DenseSteps(layout, self.rank, dense_ops) if dense_ops is not None else None

    @property
    def q_pos(self) -> Tensor:
        return self.positions[self.rank]

    def k_pos(self, step: int) -> Tensor:
        """Positions of the K/V shard visited at ``step`` (it started on rank - step)."""
        return self.positions[(self.rank - step) % self.world_size]


def _spares(like: Tensor, count: int, dtype: torch.dtype | None = None) -> list[tuple[Tensor, Tensor]]:
    """``count`` contiguous receive buffers for a pair shaped like ``like`` (k and v, or dk and dv)."""
    make = functools.partial(torch.empty, like.shape, dtype=dtype or like.dtype, device=like.device)
    return [(make(), make()) for _ in range(count)]


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, pattern: VerticalSlashPattern | None, plan: _Plan):
    """(out in the accumulation dtype, lse) of this rank's queries against all keys."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    w = plan.world_size
    spares = _spares(k, min(w - 1, 2))
    cur = (k.contiguous(), v.contiguous())  # P2P sends whole buffers
    out = lse = None
    for step in range(w):
        if step + 1 < w:
            nxt = spares[step % 2]
            transfer = plan.comm.start(cur, nxt)
        if plan.active[step]:  # always at step 0 (own keys)
            src = (plan.rank - step) % w
            out, lse = _step_forward(
                q, cur[0], cur[1], pattern, plan, src, acc, merge_into=None if out is None else (out, lse)
            )
        if step + 1 < w:
            transfer.wait()
            cur = nxt
    return out, lse


def _ring_backward(do, q, k, v, out, lse, pattern, plan: _Plan):
    """(dq, dk, dv) in the accumulation dtype for this rank's shard."""
    w = plan.world_size
    delta = row_delta(do, out)
    kv_spares = _spares(k, min(w - 1, 2))
    grad_bufs = _spares(k, 2 if w > 1 else 0, torch.float64 if q.dtype == torch.float64 else torch.float32)
    cur = (k.contiguous(), v.contiguous())
    dq = grads = grad_transfer = None
    for step in range(w):
        if step + 1 < w:
            nxt = kv_spares[step % 2]
            kv_transfer = plan.comm.start(cur, nxt)
        part = None
        if plan.active[step]:
            part = _step_backward(do, q, cur[0], cur[1], out, lse, delta, pattern, plan, (plan.rank - step) % w)
            dq = part[0] if dq is None else dq.add_(part[0])
        if step == 0:
            grads = (part[1].contiguous(), part[2].contiguous())
        else:
            grad_transfer.wait()  # the accumulator of this step's keys, one hop behind the K/V
            grads = grad_bufs[(step - 1) % 2]
            if part is not None:
                grads[0].add_(part[1])
                grads[1].add_(part[2])
        if w > 1:  # pass the accumulator on; after the last step this hop delivers it to its owner
            grad_transfer = plan.comm.start(grads, grad_bufs[step % 2], tag=1)
        if step + 1 < w:
            kv_transfer.wait()
            cur = nxt
    if w > 1:
        grad_transfer.wait()
        grads = grad_bufs[(w - 1) % 2]
    return dq, grads[0], grads[1]


class RingEngine(NamedTuple):
    """A ring schedule: forward -> (out in the accumulation dtype, lse); backward -> (dq, dk, dv)."""

    forward: Callable
    backward: Callable


class _RingAttention(torch.autograd.Function):
    """Autograd wrapper shared by the ring schedules (flat here, hierarchical in hierarchical.py)."""

    @staticmethod
    def forward(ctx, q, k, v, pattern, plan, engine: RingEngine, reuse):
        if reuse is not None:  # (out, lse) of an earlier forward of this call: no ring pass
            out, lse = reuse
        else:
            out, lse = engine.forward(q, k, v, pattern, plan)
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pattern, ctx.plan, ctx.engine = pattern, plan, engine
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.engine.backward(dout, q, k, v, out, lse, ctx.pattern, ctx.plan)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


FLAT = RingEngine(_ring_forward, _ring_backward)


def _check_inputs(
    q: Tensor, k: Tensor, v: Tensor, world_size: int, layout: Layout, pattern: VerticalSlashPattern | None, name: str
) -> None:
    if layout.world_size != world_size:
        raise ValueError(
            f"layout is for {layout.world_size} ranks but the process group has {world_size}; "
            f"build it with make_layout({layout.name!r}, {layout.seq_len}, {world_size}, {layout.block_size}) "
            "or pass the matching group"
        )
    check_qkv(q, k, v, float_dtypes=KERNEL_DTYPES if name == "triton" else None)
    if name == "triton" and q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {q.shape[-1]} is not supported by the kernels; use one of {SUPPORTED_HEAD_DIMS}")
    for t_name, t in (("q", q), ("k", k)):
        if t.shape[1] != layout.local_len:
            raise ValueError(
                f"{t_name} holds {t.shape[1]} tokens per rank but the {layout.name} layout of seq_len "
                f"{layout.seq_len} over {world_size} ranks gives {layout.local_len}; shard the full sequence "
                "with layout.shard(x, rank)"
            )
    if pattern is None:
        return
    check_pattern(pattern, q)
    if pattern.seq_len != layout.seq_len:
        raise ValueError(
            f"pattern is for seq_len {pattern.seq_len} but the layout for {layout.seq_len}; estimate the "
            "pattern on the same global sequence the layout splits"
        )
    layout.check_pattern_block(pattern.block_size)


def _prepare(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup | None,
    layout: Layout,
    pattern: VerticalSlashPattern | None,
    pattern_config: PatternConfig | None,
    softmax_scale: float | None,
    backend: str,
    layer_idx: int,
    reuse: tuple[Tensor, Tensor] | None,
) -> tuple[VerticalSlashPattern | None, str, float, dense_blocks.BlockOps | None]:
    """Validate a ring call (``reuse`` included) and settle its (global pattern, backend name, softmax
    scale, dense block ops), for every schedule. Dense calls (no pattern, no config) take per-block attention (cuDNN on CUDA) for
    the steps that decompose into a few dense blocks; the Triton kernels run the others on a dense pattern.
    """
    if pattern is not None and pattern_config is not None:
        raise ValueError(
            "pass either pattern (a global VerticalSlashPattern) or pattern_config (to estimate one), not both"
        )
    name = resolve_backend(backend, q.device)
    _check_inputs(q, k, v, dist.get_world_size(group), layout, pattern, name)
    check_reuse(reuse, q)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if pattern_config is not None:
        pattern = estimate_pattern_cp(q.detach(), k.detach(), pattern_config, group, layout, layer_idx, scale)
    dense_ops = dense_blocks.select_ops(q, k, name) if pattern is None else None
    if pattern is None and name == "triton":
        pattern = _dense_pattern(q.shape[0], q.shape[2], layout.seq_len, layout.block_size, q.device)
    return pattern, name, scale, dense_ops


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup | None,
    layout: Layout,
    pattern: VerticalSlashPattern | None = None,
    pattern_config: PatternConfig | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: Backend = "auto",
    layer_idx: int = 0,
    ring: str = "flat",
    inner_size: int | None = None,
    reuse: tuple[Tensor, Tensor] | None = None,
):
    """Context-parallel causal attention (vertical-slash sparse with a pattern) over ``group``.

    q [B, S/W, Hq, D], k/v [B, S/W, Hkv, D]: this rank's shard in ``layout`` order. ``pattern`` is
    the global pattern (identical on all ranks); ``pattern_config`` (a ``PatternConfig``) estimates
    it from these q/k across the group first; neither means dense causal. Returns out
    [B, S/W, Hq, D] (and lse [B, Hq, S/W], float32 or float64 for float64 inputs). Differentiable
    in q, k, v. ``ring="hierarchical"`` runs an inner ring of ``inner_size`` ranks per node (default
    LOCAL_WORLD_SIZE) inside an outer ring across nodes (hierarchical.py); flat is inner_size = W.
    ``reuse``: (out, lse) that an earlier call with the same inputs returned; the forward ring is
    skipped and the backward uses them (for the forward that activation checkpointing recomputes).
    """
    if ring == "hierarchical":
        from .hierarchical import hierarchical_ring_attention

        return hierarchical_ring_attention(
            q,
            k,
            v,
            group,
            layout,
            pattern,
            pattern_config,
            softmax_scale,
            return_lse,
            backend,
            layer_idx,
            inner_size,
            reuse=reuse,
        )
    if ring != "flat":
        raise ValueError(f"ring must be 'flat' or 'hierarchical', got {ring!r}")
    if inner_size is not None and inner_size != dist.get_world_size(group):
        raise ValueError(f"inner_size={inner_size} needs ring='hierarchical' (the flat ring is one ring of all ranks)")
    pattern, name, scale, dense_ops = _prepare(
        q, k, v, group, layout, pattern, pattern_config, softmax_scale, backend, layer_idx, reuse
    )
    comm = _ring_comm(group if group is not None else dist.group.WORLD, q.device)
    plan = _Plan(comm, layout, q.device, name, scale, dense_ops)
    out, lse = _RingAttention.apply(q, k, v, pattern, plan, FLAT, reuse)
    return (out, lse) if return_lse else out

"""The autograd op every context-parallel schedule runs under: forward and backward passes of a ``Schedule``."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from ...ops.sparse.attention import ChunkPlan
from .plan import RingPlan

Plan = RingPlan | ChunkPlan  # a ring's steps, or the all-gather's one chunk pair


class Schedule(Protocol):
    """A schedule (flat.py, hierarchical.py, allgather.py): how K/V (and dK/dV) travel between the ranks."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, plan: Plan) -> tuple[Tensor, Tensor]:
        """(out in the accumulation dtype, lse) of this rank's queries against every rank's keys."""
        ...

    def backward(
        self, do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, plan: Plan
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(dq, dk, dv) in the accumulation dtype for this rank's shard."""
        ...


class RingAttention(torch.autograd.Function):
    """out, lse = RingAttention.apply(q, k, v, plan, schedule, reuse); differentiable in q, k, v.

    ``reuse``: (out, lse) of an earlier forward of the same call: no forward pass, the backward uses them.
    """

    @staticmethod
    def forward(ctx, q, k, v, plan: Plan, schedule: Schedule, reuse):
        if reuse is not None:
            out, lse = reuse
        else:
            out, lse = schedule.forward(q, k, v, plan)
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.schedule = plan, schedule
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.schedule.backward(dout, q, k, v, out, lse, ctx.plan)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None

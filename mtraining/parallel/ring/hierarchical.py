"""Hierarchical ring attention: an inner ring inside each node, an outer ring across nodes.

Topology (topology.py): W = O x I ranks, node n holds group ranks n*I .. n*I + I - 1; rank (n, l)
has local rank l. For outer step o = 0 .. O-1 the I ranks of node n together hold the K/V shards of
node (n - o) mod O (rank (n, l) holds the one that started on rank ((n - o) mod O, l)):

- before the inner loop, each rank starts sending the K/V it holds to the same local rank of the
  next node (outer ring) -- the next node group's K/V for outer step o + 1 -- so the slow link has a
  whole inner cycle of compute to hide behind;
- inner step i = 0 .. I-1: rank (n, l) attends its Q to the K/V that started on rank
  ((n - o) mod O, (l - i) mod I), while the next inner K/V is in flight (same double-buffered
  asynchronous P2P as the flat ring, ``comm.RingComm`` on the inner group);
- after the inner loop the outer transfer is waited for.

Every step calls ``attention_forward`` with the global positions of the visited shard's original
owner (dense steps: cuDNN blocks where they apply, as in the flat ring), so any layout and the
global pattern work as in the flat ring, and (out, lse) merge exactly (ring.py's helpers). With
I = W (one node) this is exactly the flat ring's schedule.

Backward: K/V circulate the same way. The dK/dV accumulator of the shard being visited travels one
hop behind it around the inner ring, so after an inner cycle rank (n, l) holds node n's whole
contribution to the shard of ((n - o) mod O, l); it adds the accumulator of the same shard that
arrived from the previous node along the outer ring (carrying nodes n - o .. n - 1) and passes the
sum on along the outer ring (started at the end of outer step o, it lands behind outer step o + 1's
inner cycle). After O outer hops every rank holds the full dK/dV of its own shard. dQ stays local.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from ...ops.pattern import PatternConfig, VerticalSlashPattern
from ...ops.sparse.attention import row_delta
from .. import emulation
from ..layout import Layout
from ..topology import Topology, ring_groups
from .attention import (
    DenseSteps,
    RingEngine,
    _positions,
    _prepare,
    _ring_comm,
    _RingAttention,
    _spares,
    _step_backward,
    _step_forward,
)
from .comm import RingComm


@functools.lru_cache(maxsize=64)
def _visible(layout: Layout, rank: int) -> tuple[bool, ...]:
    """Per source rank: does rank's Q see any of its keys causally (first key <= last query)?"""
    last_query = int(layout.positions(rank)[-1])
    return tuple(int(layout.positions(src)[0]) <= last_query for src in range(layout.world_size))


class _HierPlan:
    """Ring groups, comms, positions, visibility, backend and scale of one hierarchical call."""

    def __init__(
        self,
        topo: Topology,
        inner: RingComm | None,
        outer,
        layout: Layout,
        device: torch.device,
        backend: str,
        scale: float,
        dense_ops=None,
    ) -> None:
        self.topo = topo
        self.inner = inner
        self.outer = outer
        self.positions = _positions(layout, device)
        self.visible = _visible(layout, topo.rank)
        self.backend = backend
        self.scale = scale
        self.dense = DenseSteps(layout, topo.rank, dense_ops) if dense_ops is not None else None

    @property
    def q_pos(self) -> Tensor:
        return self.positions[self.topo.rank]

    def source(self, outer_step: int, inner_step: int) -> int:
        """Group rank whose K/V shard this rank visits at (outer_step, inner_step)."""
        t = self.topo
        return t.group_rank(t.node - outer_step, t.local_rank - inner_step)


def _hier_forward(q: Tensor, k: Tensor, v: Tensor, pattern: VerticalSlashPattern | None, plan: _HierPlan):
    """(out in the accumulation dtype, lse) of this rank's queries against all keys."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    n_outer, n_inner = plan.topo.outer_size, plan.topo.inner_size
    outer_spares = _spares(k, min(n_outer - 1, 2))
    inner_spares = _spares(k, min(n_inner - 1, 2))
    held = (k.contiguous(), v.contiguous())  # the node group's shard for this outer step
    out = lse = None
    for o in range(n_outer):
        if o + 1 < n_outer:
            outer_next = outer_spares[o % 2]
            outer_transfer = plan.outer.start(held, outer_next)
        cur = held
        for i in range(n_inner):
            if i + 1 < n_inner:
                nxt = inner_spares[i % 2]
                transfer = plan.inner.start(cur, nxt)
            src = plan.source(o, i)
            if plan.visible[src]:
                out, lse = _step_forward(
                    q, cur[0], cur[1], pattern, plan, src, acc, merge_into=None if out is None else (out, lse)
                )
            if i + 1 < n_inner:
                transfer.wait()
                cur = nxt
        if o + 1 < n_outer:
            outer_transfer.wait()
            held = outer_next
    return out, lse


def _hier_backward(do, q, k, v, out, lse, pattern, plan: _HierPlan):
    """(dq, dk, dv) in the accumulation dtype for this rank's shard."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    n_outer, n_inner = plan.topo.outer_size, plan.topo.inner_size
    delta = row_delta(do, out)
    outer_spares = _spares(k, min(n_outer - 1, 2))
    inner_spares = _spares(k, min(n_inner - 1, 2))
    inner_grads = _spares(k, 2 if n_inner > 1 else 0, acc)
    outer_grads = _spares(k, 2 if n_outer > 1 else 0, acc)
    held = (k.contiguous(), v.contiguous())
    dq = None
    outer_grad_transfer = None
    zeros = None
    for o in range(n_outer):
        if o + 1 < n_outer:
            outer_next = outer_spares[o % 2]
            outer_transfer = plan.outer.start(held, outer_next)
        cur = held
        grads = grad_transfer = None
        for i in range(n_inner):
            if i + 1 < n_inner:
                nxt = inner_spares[i % 2]
                kv_transfer = plan.inner.start(cur, nxt)
            src = plan.source(o, i)
            part = None
            if plan.visible[src]:
                part = _step_backward(do, q, cur[0], cur[1], out, lse, delta, pattern, plan, src)
                dq = part[0] if dq is None else dq.add_(part[0])
            if i == 0:
                if part is None:  # this rank sees none of the shard's keys: start from zeros (never written)
                    if zeros is None:
                        zeros = (
                            torch.zeros(k.shape, dtype=acc, device=k.device),
                            torch.zeros(k.shape, dtype=acc, device=k.device),
                        )
                    grads = zeros
                else:
                    grads = (part[1].to(acc).contiguous(), part[2].to(acc).contiguous())
            else:
                grad_transfer.wait()  # the inner accumulator of this step's keys, one hop behind the K/V
                grads = inner_grads[(i - 1) % 2]
                if part is not None:
                    grads[0].add_(part[1])
                    grads[1].add_(part[2])
            if n_inner > 1:  # after the last inner step this hop brings the accumulator back to local rank l
                grad_transfer = plan.inner.start(grads, inner_grads[i % 2], tag=1)
            if i + 1 < n_inner:
                kv_transfer.wait()
                cur = nxt
        if n_inner > 1:
            grad_transfer.wait()
            grads = inner_grads[(n_inner - 1) % 2]
        # grads: node n's contribution to the shard of ((n - o) mod O, l); add the earlier nodes' part
        if o > 0:
            outer_grad_transfer.wait()
            incoming = outer_grads[(o - 1) % 2]
            incoming[0].add_(grads[0])
            incoming[1].add_(grads[1])
            grads = incoming
        if n_outer > 1:  # after the last outer step this hop delivers the sum to its owner
            send = grads if o > 0 else (grads[0].clone(), grads[1].clone()) if n_inner > 1 else grads
            outer_grad_transfer = plan.outer.start(send, outer_grads[o % 2], tag=1)
        if o + 1 < n_outer:
            outer_transfer.wait()
            held = outer_next
    if n_outer > 1:
        outer_grad_transfer.wait()
        grads = outer_grads[(n_outer - 1) % 2]
    return dq, grads[0], grads[1]


HIERARCHICAL = RingEngine(_hier_forward, _hier_backward)


def hierarchical_ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup | None,
    layout: Layout,
    pattern: VerticalSlashPattern | None = None,
    pattern_config: PatternConfig | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    layer_idx: int = 0,
    inner_size: int | None = None,
    outer_link: emulation.LinkModel | None = None,
    reuse: tuple[Tensor, Tensor] | None = None,
):
    """``ring_attention`` over a two-level ring: ``inner_size`` ranks per node (default LOCAL_WORLD_SIZE).

    Same contract as ``ring.ring_attention`` (shapes, pattern, return values, differentiable in q,
    k, v). ``outer_link`` (benchmarks only; default: the active ``emulation.emulate_outer_link``
    context, else none) makes outer-ring transfers take as long as on that link.
    """
    groups = ring_groups(group, inner_size)  # validates inner_size first
    pattern, name, scale, dense_ops = _prepare(
        q, k, v, group, layout, pattern, pattern_config, softmax_scale, backend, layer_idx, reuse
    )
    inner = _ring_comm(groups.inner, q.device) if groups.inner is not None else None
    outer = _ring_comm(groups.outer, q.device) if groups.outer is not None else None
    link = outer_link if outer_link is not None else emulation.active_outer_link()
    if outer is not None and link is not None:
        outer = emulation.EmulatedComm(outer, link)
    plan = _HierPlan(groups.topology, inner, outer, layout, q.device, name, scale, dense_ops)
    out, lse = _RingAttention.apply(q, k, v, pattern, plan, HIERARCHICAL, reuse)
    return (out, lse) if return_lse else out

"""Hierarchical ring attention: an inner ring inside each node, an outer ring across nodes.

Topology (topology.py): W = O x I ranks, node n holds group ranks n*I .. n*I + I - 1; rank (n, l)
has local rank l. For outer step o = 0 .. O-1 the I ranks of node n together hold the K/V shards of
node (n - o) mod O (rank (n, l) holds the one that started on rank ((n - o) mod O, l)):

- before the inner loop, each rank starts sending the K/V it holds to the same local rank of the
  next node (outer ring) -- the next node group's K/V for outer step o + 1 -- so the slow link has a
  whole inner cycle of compute to hide behind;
- inner step i = 0 .. I-1: rank (n, l) attends its Q to the K/V that started on rank
  ((n - o) mod O, (l - i) mod I), while the next inner K/V is in flight: one pass around the inner
  ring, the same loop as the flat ring's (passes.py);
- after the inner loop the outer transfer is waited for.

Every step runs as the call's ``RingPlan`` says for the visited shard's original owner, so any layout
and the global pattern work as in the flat ring. With I = W (one node) this is exactly the flat ring's
schedule.

Backward: K/V circulate the same way. The dK/dV accumulator of the shard being visited travels one
hop behind it around the inner ring (passes.py), so after an inner cycle rank (n, l) holds node n's whole
contribution to the shard of ((n - o) mod O, l); it adds the accumulator of the same shard that
arrived from the previous node along the outer ring (carrying nodes n - o .. n - 1) and passes the
sum on along the outer ring (started at the end of outer step o, it lands behind outer step o + 1's
inner cycle). After O outer hops every rank holds the full dK/dV of its own shard. dQ stays local.
"""

from __future__ import annotations

from torch import Tensor

from ...ops.numerics import acc_dtype
from ...ops.sparse import attention_delta
from ..topology import Topology
from .comm import Comm, spares
from .passes import backward_pass, forward_pass
from .plan import RingPlan


class HierarchicalRing:
    """The hierarchical schedule (``Schedule``); ``inner``/``outer``: None for a ring of one rank."""

    def __init__(self, topology: Topology, inner: Comm | None, outer: Comm | None) -> None:
        self.topo = topology
        self.inner = inner
        self.outer = outer

    def sources(self, outer_step: int) -> list[int]:
        """Group ranks whose K/V this rank visits at each inner step of ``outer_step``."""
        t = self.topo
        return [t.group_rank(t.node - outer_step, t.local_rank - i) for i in range(t.inner_size)]

    def forward(self, q: Tensor, k: Tensor, v: Tensor, plan: RingPlan) -> tuple[Tensor, Tensor]:
        n_outer, n_inner = self.topo.outer_size, self.topo.inner_size
        outer_spares = spares(k, min(n_outer - 1, 2))
        inner_spares = spares(k, min(n_inner - 1, 2))
        held = (k.contiguous(), v.contiguous())  # the node group's shard for this outer step
        out = lse = None
        for o in range(n_outer):
            if o + 1 < n_outer:
                outer_next = outer_spares[o % 2]
                outer_transfer = self.outer.start(held, outer_next)
            out, lse = forward_pass(self.inner, plan, self.sources(o), q, held, inner_spares, acc_dtype(q), out, lse)
            if o + 1 < n_outer:
                outer_transfer.wait()
                held = outer_next
        return out, lse

    def backward(
        self, do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, plan: RingPlan
    ) -> tuple[Tensor, Tensor, Tensor]:
        acc = acc_dtype(q)
        n_outer, n_inner = self.topo.outer_size, self.topo.inner_size
        delta = attention_delta(do, out)
        outer_spares = spares(k, min(n_outer - 1, 2))
        inner_spares = spares(k, min(n_inner - 1, 2))
        inner_grads = spares(k, 2 if n_inner > 1 else 0, acc)
        outer_grads = spares(k, 2 if n_outer > 1 else 0, acc)
        held = (k.contiguous(), v.contiguous())
        dq = outer_grad_transfer = None
        for o in range(n_outer):
            if o + 1 < n_outer:
                outer_next = outer_spares[o % 2]
                outer_transfer = self.outer.start(held, outer_next)
            # node n's contribution to the shard of ((n - o) mod O, l)
            dq, grads = backward_pass(
                self.inner, plan, self.sources(o), do, q, held, out, lse, delta, inner_spares, inner_grads, dq
            )
            if o > 0:  # add the earlier nodes' part, arrived along the outer ring
                outer_grad_transfer.wait()
                incoming = outer_grads[(o - 1) % 2]
                incoming[0].add_(grads[0])
                incoming[1].add_(grads[1])
                grads = incoming
            if n_outer > 1:  # after the last outer step this hop delivers the sum to its owner
                # at o = 0 an inner accumulator buffer is reused by the next inner pass: send a copy
                send = grads if o > 0 or n_inner == 1 else (grads[0].clone(), grads[1].clone())
                outer_grad_transfer = self.outer.start(send, outer_grads[o % 2], tag=1)
            if o + 1 < n_outer:
                outer_transfer.wait()
                held = outer_next
        if n_outer > 1:
            outer_grad_transfer.wait()
            grads = outer_grads[(n_outer - 1) % 2]
        return dq, grads[0], grads[1]

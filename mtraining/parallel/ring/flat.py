"""Flat ring: W steps over the whole group; at step t rank r visits the K/V that started on rank (r - t) mod W."""

from __future__ import annotations

from torch import Tensor

from ...ops.numerics import acc_dtype
from ...ops.sparse import attention_delta
from .comm import Comm, spares
from .passes import backward_pass, forward_pass
from .plan import RingPlan


class FlatRing:
    """The flat schedule (``Schedule``): one pass of K/V around ``comm``'s ring of all ranks."""

    def __init__(self, comm: Comm, rank: int, world_size: int) -> None:
        self.comm = comm
        self.sources = [(rank - t) % world_size for t in range(world_size)]

    def forward(self, q: Tensor, k: Tensor, v: Tensor, plan: RingPlan) -> tuple[Tensor, Tensor]:
        kv_spares = spares(k, min(len(self.sources) - 1, 2))
        kv = (k.contiguous(), v.contiguous())  # P2P sends whole buffers
        return forward_pass(self.comm, plan, self.sources, q, kv, kv_spares, acc_dtype(q), None, None)

    def backward(
        self, do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, plan: RingPlan
    ) -> tuple[Tensor, Tensor, Tensor]:
        w = len(self.sources)
        delta = attention_delta(do, out)
        kv_spares = spares(k, min(w - 1, 2))
        grad_spares = spares(k, 2 if w > 1 else 0, acc_dtype(q))
        kv = (k.contiguous(), v.contiguous())
        dq, (dk, dv) = backward_pass(
            self.comm, plan, self.sources, do, q, kv, out, lse, delta, kv_spares, grad_spares, None
        )
        return dq, dk, dv

"""One trip of K/V around a ring, the loop both schedules run: the flat ring once over the whole group,
the hierarchical ring once per outer step over the ranks of a node.

Forward: at hop i this rank attends its queries to the K/V it holds (those that started on
``sources[i]``) while the next K/V is already travelling (double-buffered, ``comm.RingComm``); partial
(out, lse) merge exactly. Backward: K/V travel the same way and, one hop behind them, the dK/dV
accumulator of the keys being visited: at hop i this rank adds its contribution to the accumulator of
the keys it holds and passes it on, so after the last hop the accumulator of the K/V this rank held at
the start is back with it, summed over the ring. dQ stays local. K/V travel with their own (GQA) heads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ...ops.numerics import acc_dtype
from .comm import Comm
from .plan import RingPlan

Pair = tuple[Tensor, Tensor]


def forward_pass(
    comm: Comm | None,
    plan: RingPlan,
    sources: Sequence[int],
    q: Tensor,
    kv: Pair,
    kv_spares: list[Pair],
    out_dtype: torch.dtype,
    out: Tensor | None,
    lse: Tensor | None,
) -> tuple[Tensor | None, Tensor | None]:
    """(out, lse) with q's attention to the K/V of every rank in ``sources`` merged in.

    Args:
        comm: the ring the K/V travel (None when ``sources`` has one rank).
        plan: the call's ``RingPlan``.
        sources: the rank whose K/V this rank holds at each hop (``kv``: those of ``sources[0]``).
        q: [B, S, Hq, D] this rank's queries.
        kv: contiguous (k, v) held at the start.
        kv_spares: min(len(sources) - 1, 2) receive buffers shaped like k (``comm.spares``).
        out_dtype: dtype of ``out`` (the accumulation dtype).
        out, lse: the result over earlier keys, or None, None.
    """
    cur = kv
    last = len(sources) - 1
    for i, src in enumerate(sources):
        if i < last:
            nxt = kv_spares[i % 2]
            transfer = comm.start(cur, nxt)
        out, lse = plan.attend(src, q, cur[0], cur[1], out_dtype, out, lse)  # see Note [skipped steps]
        if i < last:
            transfer.wait()
            cur = nxt
    return out, lse


def backward_pass(
    comm: Comm | None,
    plan: RingPlan,
    sources: Sequence[int],
    do: Tensor,
    q: Tensor,
    kv: Pair,
    out: Tensor,
    lse: Tensor,
    delta: Tensor,
    kv_spares: list[Pair],
    grad_spares: list[Pair],
    dq: Tensor | None,
) -> tuple[Tensor | None, Pair]:
    """(dq, (dk, dv)): ``dq`` plus this pass's contributions, and the dK/dV of the K/V ``kv`` summed over
    the ring's ranks (their pairs with those keys), back on this rank.

    Arguments as in ``forward_pass``; out, lse, delta are the whole rows'; ``grad_spares``: two
    accumulator buffers in the accumulation dtype when the ring has more than one rank, else none. The
    result's dK/dV may be one of ``grad_spares``.
    """
    cur = kv
    last = len(sources) - 1
    grads = grad_transfer = None
    for i, src in enumerate(sources):
        if i < last:
            nxt = kv_spares[i % 2]
            kv_transfer = comm.start(cur, nxt)
        part = plan.grads(src, do, q, cur[0], cur[1], out, lse, delta)
        if part is not None:
            dq = part[0] if dq is None else dq.add_(part[0])
        if i == 0:
            if part is not None:
                grads = (part[1].contiguous(), part[2].contiguous())
            else:  # this rank sees none of these keys: the accumulator starts at zero
                acc = acc_dtype(q)
                grads = (torch.zeros_like(cur[0], dtype=acc), torch.zeros_like(cur[1], dtype=acc))
        else:
            grad_transfer.wait()  # the accumulator of the keys now held, one hop behind the K/V
            grads = grad_spares[(i - 1) % 2]
            if part is not None:
                grads[0].add_(part[1])
                grads[1].add_(part[2])
        if last > 0:  # pass the accumulator on; after the last hop it is back with the keys' holder
            grad_transfer = comm.start(grads, grad_spares[i % 2], tag=1)
        if i < last:
            kv_transfer.wait()
            cur = nxt
    if last > 0:
        grad_transfer.wait()
        grads = grad_spares[last % 2]
    return dq, grads

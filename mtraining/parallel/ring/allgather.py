"""All-gather context parallelism: queries stay local, K/V of the whole sequence are gathered once.

The schedule the frameworks that added context parallelism for trainable sparse attention chose
(``ring_attention(..., ring="allgather")``): each rank all-gathers every rank's K/V into the global
order (one collective for both, then one permuting copy: keys must come in ascending aligned runs,
ops/sparse/index.py), computes its own queries against all keys as ONE chunk pair
(``ops.sparse.plan_chunk``: the pattern's blocks and verticals through the Triton kernels, or dense
blocks through cuDNN: contiguous and zigzag queries against the whole sequence are 2 and 4 blocks), and in
the backward gathers K/V again (they are not kept), computes dQ, dK, dV of its rows, and reduce-scatters
the float32 dK/dV so each rank gets the sum over all queries for its own keys.

Nothing overlaps with compute, and every rank holds the whole sequence's K/V for a layer (twice while it
is reordered: 4 x S x Hkv x D x 2 bytes, 1 GB at 512K for Qwen2.5-3B's 2 KV heads in bf16) and, in the
backward, its float32 gradients. Its transfers are (W-1)/W of a shard each way, the ring's W-1 hops
without the per-step waits: it should win where a ring step's compute is too short to hide its hop
(short sequences, sparse patterns, many ranks) and K/V are small (GQA), and lose to the ring where a
step's compute hides the transfer and memory is tight (DESIGN.md).

Any layout works: the striped layout deals every rank the same mix of positions, so its queries see
keys everywhere and the work stays balanced; packed documents enter as the rows' left bounds.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from ...ops.dense import Block, decompose
from ...ops.documents import Documents
from ...ops.numerics import acc_dtype
from ...ops.pattern import VerticalSlashPattern
from ...ops.sparse import attention_delta
from ...ops.sparse.attention import ChunkPlan, document_blocks, plan_chunk
from ..layout import Layout
from .plan import document_plan, layout_plan

# torch >= 2.12 names them *_single (the *_tensor names are deprecated there)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@functools.lru_cache(maxsize=16)
def _global_order(layout: Layout, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(owner rank, local index) of every global position, and every rank's positions in rank order, on
    ``device``; built once per layout (the tensors' identity keys the kernels' walk caches)."""
    owner, local = layout.owner(torch.arange(layout.seq_len))
    ranked = torch.cat([layout.positions(r) for r in range(layout.world_size)])
    return owner.to(device), local.to(device), ranked.to(device)


@functools.lru_cache(maxsize=16)
def _key_positions(seq_len: int, device: torch.device) -> Tensor:
    """int32 0..seq_len-1 on ``device``: the gathered keys' positions (one object per length and device)."""
    return torch.arange(seq_len, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=64)
def _dense_blocks(layout: Layout, rank: int) -> tuple[Block, ...] | None:
    """The dense decomposition of this rank's queries against the whole sequence (None: too many blocks)."""
    return decompose(layout.positions(rank), torch.arange(layout.seq_len))


class AllGather:
    """The all-gather schedule (``op.Schedule``), its plan a ``ChunkPlan`` of the local queries against all keys."""

    def __init__(self, group: dist.ProcessGroup | None, layout: Layout, device: torch.device) -> None:
        self.group = group
        self.world_size = layout.world_size
        self.owner, self.local, self.ranked = _global_order(layout, device)

    def gather(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Every rank's (k, v) [B, S/W, Hkv, D] as the whole sequence's [B, S, Hkv, D], in global order."""
        b, n, h, d = k.shape
        buffer = torch.empty((self.world_size * 2, b, n, h, d), dtype=k.dtype, device=k.device)
        _all_gather(buffer, torch.stack((k, v)), group=self.group)
        ranks = buffer.view(self.world_size, 2 * b, n, h * d).transpose(0, 1)  # [2B, W, n, H*D], a view
        ordered = ranks[:, self.owner, self.local].reshape(2, b, self.owner.shape[0], h, d)
        return ordered[0], ordered[1]

    def reduce_scatter(self, dk: Tensor, dv: Tensor) -> tuple[Tensor, Tensor]:
        """This rank's keys' rows of (dk, dv) [B, S, Hkv, D] summed over the ranks, [B, S/W, Hkv, D]."""
        b, s, h, d = dk.shape
        n = s // self.world_size
        rows = torch.stack((dk, dv)).view(2 * b, s, h * d).transpose(0, 1)  # [S, 2B, H*D], a view
        send = rows[self.ranked]  # [W * n, 2B, H*D]: rank r's keys in rows r*n .. r*n + n - 1
        mine = torch.empty((n, 2 * b, h * d), dtype=send.dtype, device=send.device)
        _reduce_scatter(mine, send, group=self.group)
        grads = mine.transpose(0, 1).reshape(2, b, n, h, d)
        return grads[0], grads[1]

    def forward(self, q: Tensor, k: Tensor, v: Tensor, plan: ChunkPlan) -> tuple[Tensor, Tensor]:
        keys, values = self.gather(k, v)
        return plan.forward(q, keys, values, q.dtype)  # one chunk pair: nothing to merge, out in q's dtype

    def backward(
        self, do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, plan: ChunkPlan
    ) -> tuple[Tensor, Tensor, Tensor]:
        keys, values = self.gather(k, v)
        delta = attention_delta(do, out) if plan.dense is None else None
        dq, dk, dv = plan.backward(do, q, keys, values, out, lse, delta, dq_dtype=q.dtype)
        del keys, values
        dk, dv = self.reduce_scatter(dk.to(acc_dtype(q)), dv.to(acc_dtype(q)))
        return dq, dk, dv


def plan_allgather(
    q: Tensor,
    k: Tensor,
    pattern: VerticalSlashPattern | None,
    layout: Layout,
    rank: int,
    scale: float,
    backend: str,
    documents: Documents | None = None,
) -> ChunkPlan:
    """The one chunk pair of an all-gather call of ``rank``: its queries against the whole sequence
    (``backend`` resolved, ``pattern`` global or None, ``documents`` resolved)."""
    lp = layout_plan(layout, rank, q.device)
    k_pos = _key_positions(layout.seq_len, q.device)
    fallback = None
    if pattern is None and backend == "triton":
        fallback = functools.partial(lp.dense_pattern, q.shape[0], q.shape[2])
    blocks, q_bound = functools.partial(_dense_blocks, layout, rank), None
    if documents is not None:
        q_bound = document_plan(documents, layout, rank, q.device).q_bound
        build = functools.partial(document_blocks, documents, layout.positions(rank), torch.arange(layout.seq_len))
        blocks = functools.partial(documents.cached, ("allgather", layout, rank), build)
    return plan_chunk(q, k, pattern, lp.positions[rank], k_pos, scale, backend, blocks, fallback, q_bound)

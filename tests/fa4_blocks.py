"""``TorchBlocks``: an exact plain-PyTorch stand-in for FlashAttention-4's block part (``fa4.BlockPart``), which
lets ``backend="fa4"`` run on the CPU (any float dtype) with ``fa4.FA4`` monkeypatched to
``fa4.SplitBackend(TorchBlocks())``; ``tile_pairs``: the pairs a block-sparse kernel computes on tile lists."""

from __future__ import annotations

import torch
from torch import Tensor

from mtraining.ops.sparse.block_lists import BlockLists, SparseBlocks, dense_mask


def tile_pairs(lists: BlockLists, tile: int, n: int, per_query: bool) -> Tensor:
    """Boolean [B, H, n, n] (rows: queries) of the pairs a block-sparse kernel computes on the tiles of ``lists``
    (per query tile: the forward's; else per key tile): the causal pairs of partial tiles, every pair of full ones."""
    partial, full = dense_mask(lists, tile, n)
    if not per_query:
        partial, full = partial.transpose(-1, -2), full.transpose(-1, -2)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return (partial & causal) | full


class TorchBlocks:
    """A ``fa4.BlockPart`` in plain PyTorch (float64 inside): masked attention on the forward lists' tiles, and its
    backward on the backward lists' tiles given the whole rows' out and lse (dense [S, S] masks: small sizes)."""

    @staticmethod
    def _heads(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        group = q.shape[2] // k.shape[2]
        return (
            q.double().transpose(1, 2),
            k.double().transpose(1, 2).repeat_interleave(group, 1),
            v.double().transpose(1, 2).repeat_interleave(group, 1),
        )

    def forward(self, q: Tensor, k: Tensor, v: Tensor, blocks: SparseBlocks, scale: float) -> tuple[Tensor, Tensor]:
        qh, kh, vh = self._heads(q, k, v)
        allowed = tile_pairs(blocks.forward, blocks.tile, q.shape[1], per_query=True)
        scores = (qh @ kh.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(scores, -1)
        p = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        return (p @ vh).transpose(1, 2).to(q.dtype), lse.float()

    def backward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        do: Tensor,
        lse: Tensor,
        blocks: SparseBlocks,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        qh, kh, vh = self._heads(q, k, v)
        doh, outh = do.double().transpose(1, 2), out.double().transpose(1, 2)
        allowed = tile_pairs(blocks.backward, blocks.tile, q.shape[1], per_query=False)
        scores = qh @ kh.transpose(-1, -2) * scale
        p = torch.where(allowed, torch.exp(scores - lse.double()[..., None]), 0.0)
        delta = (doh * outh).sum(-1, keepdim=True)
        ds = p * (doh @ vh.transpose(-1, -2) - delta)
        group = q.shape[2] // k.shape[2]

        def per_kv_head(t: Tensor) -> Tensor:  # [B, Hq, S, D] -> [B, S, Hkv, D], summed over each group
            return t.unflatten(1, (k.shape[2], group)).sum(2).transpose(1, 2).to(q.dtype)

        dq = (ds @ kh * scale).transpose(1, 2).to(q.dtype)
        return dq, per_kv_head(ds.transpose(-1, -2) @ qh * scale), per_kv_head(p.transpose(-1, -2) @ doh)

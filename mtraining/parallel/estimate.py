"""Estimate the global vertical-slash pattern from sharded q/k: every rank gets the identical pattern.

The single-device estimate (``mtraining.ops.estimate``) is composed across the ranks of a layout:
1. the last ``last_q`` queries (globally last positions; under striped/zigzag they may sit on
   several ranks) reach every rank through one all-reduce of a zero-filled buffer (exact);
2. each rank computes their partial LSE over its keys; a max all-reduce and a sum all-reduce of
   exp(lse - max) give the global row LSE;
3. each rank scores the lines over its keys with that LSE: slash scores (indexed by offset) are
   summed by an all-reduce, vertical scores are all-gathered and placed by global key position;
4. ``select_lines`` runs on identical inputs on every rank, so the patterns are identical.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops.estimate import PatternConfig, last_query_partial_lse, line_scores, select_lines
from ..ops.pattern import VerticalSlashPattern
from .layout import Layout


def _last_queries(q: Tensor, layout: Layout, rank: int, last_q: int, group) -> tuple[Tensor, Tensor]:
    """(q_last [B, last_q, Hq, D], positions) of the globally last queries, on every rank."""
    n = layout.seq_len
    last_pos = torch.arange(n - last_q, n)
    owner, local = layout.owner(last_pos)  # on the CPU: the layout is static, no device sync
    mine = (owner == rank).to(q.device)[None, :, None, None]
    rows = q.index_select(1, local.to(q.device))
    q_last = torch.where(mine, rows, torch.zeros((), dtype=q.dtype, device=q.device)).contiguous()
    dist.all_reduce(q_last, group=group)  # each row is non-zero on its owner only: the sum is exact
    return q_last, last_pos.to(q.device)


def _global_lse(partial: Tensor, group) -> Tensor:
    """logsumexp over ranks of the partial LSEs (float32 [B, Hq, R]), combined in float64."""
    top = partial.double()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    safe = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    total = torch.exp(partial.double() - safe)
    dist.all_reduce(total, group=group)
    return (safe + torch.log(total)).float()


@torch.no_grad()
def estimate_pattern_cp(
    q: Tensor,
    k: Tensor,
    config: PatternConfig,
    group: dist.ProcessGroup | None,
    layout: Layout,
    layer_idx: int = 0,
    softmax_scale: float | None = None,
) -> VerticalSlashPattern:
    """The pattern ``estimate_pattern`` gives on the full sequence, from this rank's shards.

    q [B, S/W, Hq, D], k [B, S/W, Hkv, D] in ``layout`` order. Collective: every rank of ``group``
    must call it with its own shards; all get the same pattern.
    """
    if not isinstance(config, PatternConfig):
        raise ValueError(f"pattern_config must be a PatternConfig, got {type(config).__name__}")
    layout.check_pattern_block(config.block_size)
    n = layout.seq_len
    if config.last_q > n:
        raise ValueError(f"last_q ({config.last_q}) exceeds the sequence length {n}; lower last_q to at most {n}")
    config.head_budgets(layer_idx, q.shape[2], n)  # fail on budgets before any communication
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    q_last, last_pos = _last_queries(q, layout, rank, config.last_q, group)
    k_pos = layout.positions(rank).to(q.device)
    row_lse = _global_lse(last_query_partial_lse(q_last, last_pos, k, k_pos, scale), group)
    vertical_local, slash = line_scores(q_last, last_pos, k, k_pos, scale, row_lse, n)
    slash = slash.contiguous()  # collectives need dense buffers
    dist.all_reduce(slash, group=group)
    gathered = [torch.empty_like(vertical_local) for _ in range(world)]
    dist.all_gather(gathered, vertical_local.contiguous(), group=group)
    all_pos = torch.cat([layout.positions(r) for r in range(world)]).to(q.device)
    vertical = torch.empty_like(slash).index_copy_(-1, all_pos, torch.cat(gathered, dim=-1))
    return select_lines(vertical, slash, config, n, layer_idx)

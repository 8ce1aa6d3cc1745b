"""Estimate the global vertical-slash pattern from sharded q/k: every rank gets the identical pattern.

The single-device estimate (``mtraining.ops.estimate.estimator``) is composed across the ranks of a layout:
0. every rank checks that all make the same call (shapes, layout, config, documents: ``agreement.py``);
1. the last ``last_q`` queries (globally last positions; under striped/zigzag they may sit on
   several ranks) reach every rank through one all-reduce of a zero-filled buffer (exact);
2. each rank computes their partial LSE over its keys; an all-gather and a logsumexp over ranks
   (in float64) give the global row LSE;
3. each rank scores the lines over its keys with that LSE: slash scores (indexed by offset) are
   summed by an all-reduce, vertical scores are all-gathered and placed by global key position;
4. ``select_lines`` runs on identical inputs on every rank, so the patterns are identical.

With packed documents the scoring rows are the last ``last_q`` of every document (``scoring_rows``), found
on the host from the boundaries, gathered the same way, and scored against their own document's keys
(per batch row when the rows' boundaries differ); every document's first sinks are forced.

The positions a rank needs (its keys, the last queries, their owners) and their PositionPlan depend
only on the layout: they are built once per layout, rank and device (with packed documents, the scoring rows
once per documents object: ``document_rows``), so an estimate pays one device sync of its own
(``select_lines``; the agreement check reads its digests too) and copies no positions to the device.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops.checks import resolve_scale
from ..ops.documents import Documents, resolve_documents
from ..ops.estimate.estimator import (
    PatternConfig,
    PositionPlan,
    block_columns_of,
    document_rows,
    document_scores,
    last_query_partial_lse,
    line_scores,
    select_lines,
)
from ..ops.pattern import VerticalSlashPattern
from .agreement import check_ranks_agree, documents_field
from .layout import Layout


@functools.lru_cache(maxsize=16)
def _rank_positions(layout: Layout, rank: int, last_q: int, device: torch.device):
    """What a rank's estimate needs of the (static) layout, on its device, built once per layout and rank.

    Returns (key positions, positions of the last queries, [1, last_q, 1, 1] is this rank their
    owner, their local rows, every rank's key positions in rank order, the PositionPlan of the last
    queries against this rank's keys). Built from CPU tensors: no device sync, no copy per call.
    """
    n = layout.seq_len
    k_pos = layout.positions(rank)
    last_pos = torch.arange(n - last_q, n)
    owner, local = layout.owner(last_pos)
    every = torch.cat([layout.positions(r) for r in range(layout.world_size)])
    plan = PositionPlan.from_positions(last_pos, k_pos)
    mine = (owner == rank)[None, :, None, None]
    return (*(t.to(device) for t in (k_pos, last_pos, mine, local, every)), plan)


def ranks_logsumexp(partial: Tensor, group) -> Tensor:
    """logsumexp over the ranks of ``group`` of per-rank LSEs (any shape; -inf: the rank saw no such key),
    combined in float64 and returned in ``partial``'s dtype; -inf on every rank stays -inf."""
    parts = [torch.empty_like(partial) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, partial, group=group)
    return torch.logsumexp(torch.stack(parts).double(), dim=0).to(partial.dtype)


@torch.no_grad()
def estimate_pattern_cp(
    q: Tensor,
    k: Tensor,
    config: PatternConfig,
    group: dist.ProcessGroup | None,
    layout: Layout,
    layer_idx: int = 0,
    softmax_scale: float | None = None,
    documents: Documents | None = None,
) -> VerticalSlashPattern:
    """The pattern ``estimate_pattern`` gives on the full sequence, from this rank's shards.

    q [B, S/W, Hq, D], k [B, S/W, Hkv, D] in ``layout`` order. Collective: every rank of ``group``
    must call it with its own shards; all get the same pattern. Two device syncs: the agreement check
    and ``select_lines``.
    ``documents``: packed documents of the global sequence (the same on every rank).
    """
    fields = {
        "q shape": tuple(q.shape),
        "k shape": tuple(k.shape),
        "dtype": str(q.dtype),
        "layout": layout,
        "pattern_config": config,
        "layer_idx": layer_idx,
        "softmax_scale": softmax_scale,
        "documents": documents_field(documents),
    }
    check_ranks_agree(group, q.device, "estimate_pattern_cp", fields)  # see Note [ring agreement]
    return estimate_agreed(q, k, config, group, layout, layer_idx, softmax_scale, documents)


@torch.no_grad()
def estimate_agreed(
    q: Tensor,
    k: Tensor,
    config: PatternConfig,
    group: dist.ProcessGroup | None,
    layout: Layout,
    layer_idx: int,
    softmax_scale: float | None,
    documents: Documents | None,
) -> VerticalSlashPattern:
    """``estimate_pattern_cp`` for a caller whose own agreement check covered these arguments (``ring_attention``
    with a ``pattern_config``): the estimate without a second check."""
    if not isinstance(config, PatternConfig):
        raise ValueError(f"pattern_config must be a PatternConfig, got {type(config).__name__}")
    layout.check_pattern_block(config.block_size)
    n = layout.seq_len
    if config.last_q > n:
        raise ValueError(f"last_q ({config.last_q}) exceeds the sequence length {n}; lower last_q to at most {n}")
    config.head_budgets(layer_idx, q.shape[2], n)  # fail on budgets before any communication
    scale = resolve_scale(softmax_scale, q.shape[-1])
    documents = resolve_documents(documents, q.shape[0], n)
    if documents is not None:
        lines = _estimate_documents(q, k, config, group, layout, layer_idx, scale, documents)
    else:
        lines = _estimate_lines(q, k, config, group, layout, layer_idx, scale)
    if not config.block_columns:
        return lines
    return lines.with_block_columns(_block_columns_cp(q, k, lines, config, group, layout, layer_idx, scale, documents))


def _block_columns_cp(
    q: Tensor,
    k: Tensor,
    lines: VerticalSlashPattern,
    config: PatternConfig,
    group,
    layout: Layout,
    layer_idx: int,
    scale: float,
    documents: Documents | None,
) -> Tensor:
    """The per-block columns of the whole sequence: each rank ranks the query blocks of its rows against every
    key (gathered), leaving the others' blocks padding (seq_len), and an all-reduce (min) joins them."""
    q_pos = layout.positions(dist.get_rank(group)).to(q.device)
    columns = block_columns_of(q, layout.all_gather(k, group), lines, config, scale, layer_idx, q_pos, documents)
    dist.all_reduce(columns, op=dist.ReduceOp.MIN, group=group)
    return columns


def _estimate_lines(
    q: Tensor, k: Tensor, config: PatternConfig, group, layout: Layout, layer_idx: int, scale: float
) -> VerticalSlashPattern:
    """``estimate_pattern_cp``'s vertical-slash lines without documents."""
    n = layout.seq_len
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    k_pos, last_pos, mine, local, every, plan = _rank_positions(layout, rank, config.last_q, q.device)
    # the globally last queries on every rank: each row is non-zero on its owner only, so the sum is exact
    q_last = torch.where(mine, q.index_select(1, local), 0.0)
    dist.all_reduce(q_last, group=group)
    row_lse = ranks_logsumexp(last_query_partial_lse(q_last, last_pos, k, k_pos, scale, plan), group)
    vertical_local, slash = line_scores(q_last, last_pos, k, k_pos, scale, row_lse, n, plan)
    slash = slash.contiguous()  # collectives need dense buffers
    dist.all_reduce(slash, group=group)
    gathered = [torch.empty_like(vertical_local) for _ in range(world)]
    dist.all_gather(gathered, vertical_local, group=group)
    vertical = torch.empty_like(slash).index_copy_(-1, every, torch.cat(gathered, dim=-1))
    return select_lines(vertical, slash, config, n, layer_idx)


def _estimate_documents(
    q: Tensor,
    k: Tensor,
    config: PatternConfig,
    group,
    layout: Layout,
    layer_idx: int,
    scale: float,
    documents: Documents,
) -> VerticalSlashPattern:
    """``estimate_pattern_cp`` with packed documents (see the module docstring)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    every = _rank_positions(layout, rank, config.last_q, q.device)[4]

    def positions() -> tuple[Tensor, Tensor]:  # this rank's rows and keys
        pos = layout.positions(rank)
        return pos, pos

    def share_rows(q_last: Tensor) -> Tensor:  # each scoring row is non-zero on its owner only: exact
        dist.all_reduce(q_last, group=group)
        return q_last

    batch = documents.batch if documents.batch > 1 else 1
    parts = []
    for b in range(batch):
        qb, kb = (q, k) if batch == 1 else (q[b : b + 1], k[b : b + 1])
        rows = document_rows(documents, b, config.last_q, positions, ("layout", layout, rank), q.device)
        parts.append(document_scores(qb, kb, scale, rows, share_rows, lambda x: ranks_logsumexp(x, group)))
    vertical_local, slash = (torch.cat(p) for p in zip(*parts))
    slash = slash.contiguous()
    dist.all_reduce(slash, group=group)
    gathered = [torch.empty_like(vertical_local) for _ in range(world)]
    dist.all_gather(gathered, vertical_local.contiguous(), group=group)
    vertical = torch.empty_like(slash).index_copy_(-1, every, torch.cat(gathered, dim=-1))
    return select_lines(vertical, slash, config, layout.seq_len, layer_idx, documents)

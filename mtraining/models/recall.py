"""Pattern recall: the fraction of attention mass a vertical-slash pattern keeps, over all query rows.

The figure is the mean, over every query row of the sequence and every query head, of the exact
softmax probability on the pairs the pattern keeps: the share of the attention the model actually
gets. It is estimated on ``last_q`` rows drawn uniformly at random without replacement from the whole
sequence (``recall_rows``), an unbiased estimate of that mean. The draw is seeded by the caller (the
trainer passes the step), so every context-parallel rank measures the same rows and the global RNG is
untouched. The estimation scores its lines from the last ``last_q`` rows (of each document): measured
there, recall would be in-sample, near 1 by construction; the drawn rows are held out from it except
by chance. With packed documents each row's keys are those of its own document (its left bound), the
attention document masking computes.

One pass of the drawn rows over the keys (scored as the estimation scores them) gives per row the LSE
over all causal keys and the LSE over the kept ones; their difference is the log of the kept mass.
Works on one device or across a context-parallel group (keys sharded in a layout). The trainer
measures it on logging steps only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops.documents import Documents
from ..ops.estimate.estimator import grouped_queries, grouped_scores
from ..ops.numerics import acc_dtype
from ..ops.pattern import VerticalSlashPattern
from ..parallel.estimate import ranks_logsumexp
from ..parallel.layout import Layout

_CHUNK_ELEMENTS = 1 << 22


def recall_rows(seq_len: int, last_q: int, seed: int) -> Tensor:
    """int64 CPU [min(last_q, seq_len)], ascending: the query positions ``pattern_recall`` measures, drawn
    uniformly without replacement from 0..seq_len-1 by a generator of its own seeded with ``seed`` (the
    same rows on every rank for the same seed; the global torch RNG is not touched)."""
    if last_q >= seq_len:
        return torch.arange(seq_len)
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(seq_len, generator=gen)[:last_q].sort().values


def _rows(q: Tensor, pos: Tensor, layout: Layout | None, group) -> Tensor:
    """The query rows at global positions ``pos`` (CPU) [B, R, Hq, D], present on every rank."""
    if layout is None:
        return q[:, pos.to(q.device)]
    owner, local = layout.owner(pos)
    mine = (owner == dist.get_rank(group)).to(q.device)[None, :, None, None]
    rows = torch.where(mine, q.index_select(1, local.to(q.device)), torch.zeros((), dtype=q.dtype, device=q.device))
    dist.all_reduce(rows, group=group)  # each row is non-zero on its owner only: the sum is exact
    return rows


@torch.no_grad()
def pattern_recall(
    q: Tensor,
    k: Tensor,
    pattern: VerticalSlashPattern,
    last_q: int,
    scale: float,
    group: dist.ProcessGroup | None = None,
    layout: Layout | None = None,
    documents: Documents | None = None,
    *,
    seed: int,
) -> float:
    """Mean over ``last_q`` randomly drawn query rows (``recall_rows(seq_len, last_q, seed)``) and all query
    heads of the attention probability the pattern keeps: an estimate of the mean over all rows.

    Single device (no ``layout``): q [B, S, Hq, D], k [B, S, Hkv, D] hold positions 0..S-1.
    Context parallel: q/k are this rank's shards in ``layout`` over ``group``; collective, and every rank
    must pass the same ``seed``. A row's kept probability is exp(LSE over kept keys - LSE over all causal
    keys), both in float32 (float64 for float64 inputs) and merged chunk by chunk, then over ranks. With
    packed ``documents`` each row's keys start at its own document's start (per batch row's boundaries).
    """
    rows = recall_rows(pattern.seq_len, last_q, seed)
    return float(kept_probability(q, k, pattern, rows, scale, group, layout, documents).mean(dtype=torch.float64))


def kept_probability(
    q: Tensor,
    k: Tensor,
    pattern: VerticalSlashPattern,
    rows: Tensor,
    scale: float,
    group: dist.ProcessGroup | None = None,
    layout: Layout | None = None,
    documents: Documents | None = None,
) -> Tensor:
    """[B, Hq, R]: the attention probability the pattern keeps on each query row at global positions ``rows``
    (int64 CPU, ascending), over its causal keys (from its own document's start with packed ``documents``).
    Shapes, context parallelism and precision as ``pattern_recall``, which averages it over drawn rows."""
    bounds = None if documents is None else documents.left_bounds(rows)
    return _kept(q, k, pattern, rows, bounds, scale, group, layout)


def _kept(
    q: Tensor,
    k: Tensor,
    pattern: VerticalSlashPattern,
    pos: Tensor,
    bounds: Tensor | None,
    scale: float,
    group,
    layout: Layout | None,
) -> Tensor:
    """[B, Hq, R]: the probability each row at global positions ``pos`` (CPU, ascending) keeps, over its
    causal keys from ``bounds`` ([B or 1, R] left bounds; None: from 0)."""
    q_last = _rows(q, pos, layout, group)
    host_pos = torch.arange(k.shape[1]) if layout is None else layout.positions(dist.get_rank(group))
    k_pos, q_pos = host_pos.to(k.device), pos.to(q.device)
    first = None if bounds is None else bounds.to(q.device)[:, None, :, None]
    b, r, hq, _ = q_last.shape
    qg = grouped_queries(q_last, k.shape[2])
    lse = torch.full((2, b, hq, r), float("-inf"), dtype=acc_dtype(q), device=q.device)  # all causal keys, kept keys
    step = max(1, _CHUNK_ELEMENTS // (b * hq * r))
    for i in range(0, k.shape[1], step):
        pc = k_pos[i : i + step]
        s = grouped_scores(qg, k[:, i : i + step].permute(0, 2, 3, 1)).mul_(scale).view(b, hq, r, -1)
        if host_pos[i : i + step].max() > int(pos[0]):  # a key some row must not see (pos[0]: the first row)
            s.masked_fill_(pc > q_pos[:, None], float("-inf"))
        if first is not None:  # keys before a row's document
            s.masked_fill_(pc < first, float("-inf"))
        # the chunk's two row LSEs with one exp: top + log(sum of exp(s - top)) over all / kept keys
        top = s.amax(-1, keepdim=True).clamp_(min=torch.finfo(s.dtype).min)  # rows seeing no key here: exp -> 0
        e = s.sub_(top).exp_()
        sums = torch.stack([e.sum(-1), e.masked_fill_(~pattern.pair_mask(q_pos, pc), 0).sum(-1)])
        lse = torch.logaddexp(lse, sums.log_().add_(top.squeeze(-1)))
    if layout is not None:
        lse = ranks_logsumexp(lse, group)
    return torch.exp(lse[1] - lse[0])

"""Pattern recall: the estimated fraction of attention mass a vertical-slash pattern keeps.

Measured like the estimation itself, on the last ``last_q`` queries of the sequence: their exact
softmax over all keys, summed over the pairs the pattern keeps, averaged over rows and heads.
Works on one device or across a context-parallel group (keys sharded in a layout). One pass of
``last_q`` rows over the keys (scored as the estimation scores them) gives per row the LSE over
all causal keys and the LSE over the kept ones; their difference is the log of the kept mass.
The trainer still measures it on logging steps only. With packed documents the rows are the
estimation's (the last ``last_q`` of every document, ``scoring_rows``), each over its own document's
keys, so the figure is the mass kept of the attention that document masking computes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops.documents import Documents
from ..ops.numerics import acc_dtype
from ..ops.pattern import VerticalSlashPattern
from ..ops.pattern.estimate import grouped_queries, grouped_scores, scoring_rows
from ..parallel.estimate import ranks_logsumexp
from ..parallel.layout import Layout

_CHUNK_ELEMENTS = 1 << 22


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
) -> float:
    """Mean over the last ``last_q`` rows and all query heads of the attention probability the pattern keeps.

    Single device (no ``layout``): q [B, S, Hq, D], k [B, S, Hkv, D] hold positions 0..S-1.
    Context parallel: q/k are this rank's shards in ``layout`` over ``group``; collective.
    A row's kept probability is exp(LSE over kept keys - LSE over all causal keys), both in
    float32 (float64 for float64 inputs) and merged chunk by chunk, then over ranks. With packed
    ``documents`` (resolved: None or several documents) the rows are every document's last ``last_q``
    and their keys those of their own document.
    """
    seq_len = pattern.seq_len
    if documents is None:
        r = min(last_q, seq_len)
        parts = [_kept(q, k, pattern, torch.arange(seq_len - r, seq_len), None, scale, group, layout)]
    else:
        each = documents.batch > 1  # rows of their own boundaries: one batch row at a time
        parts = []
        for b in range(q.shape[0] if each else 1):
            rows = slice(b, b + 1) if each else slice(None)
            pos, bound = scoring_rows(documents, b, last_q)
            part = _batch_rows(pattern, rows)
            parts.append(_kept(q[rows], k[rows], part, pos, bound, scale, group, layout))
    return float(torch.cat([p.flatten() for p in parts]).mean(dtype=torch.float64))


def _batch_rows(pattern: VerticalSlashPattern, rows: slice) -> VerticalSlashPattern:
    """The pattern of some batch rows."""
    return VerticalSlashPattern(
        pattern.seq_len,
        pattern.block_size,
        pattern.block_diags[rows],
        pattern.num_diags[rows],
        pattern.vertical_pos[rows],
        pattern.num_verticals[rows],
    )


def _kept(
    q: Tensor,
    k: Tensor,
    pattern: VerticalSlashPattern,
    pos: Tensor,
    bound: Tensor | None,
    scale: float,
    group,
    layout: Layout | None,
) -> Tensor:
    """[B, Hq, R]: the probability each row at global positions ``pos`` (CPU) keeps (keys from ``bound``)."""
    q_last = _rows(q, pos, layout, group)
    host_pos = torch.arange(k.shape[1]) if layout is None else layout.positions(dist.get_rank(group))
    k_pos, q_pos = host_pos.to(k.device), pos.to(q.device)
    first = None if bound is None else bound.to(q.device)
    b, r, hq, _ = q_last.shape
    qg = grouped_queries(q_last, k.shape[2])
    lse = torch.full((2, b, hq, r), float("-inf"), dtype=acc_dtype(q), device=q.device)  # all causal keys, kept keys
    step = max(1, _CHUNK_ELEMENTS // (b * hq * r))
    for i in range(0, k.shape[1], step):
        pc = k_pos[i : i + step]
        s = grouped_scores(qg, k[:, i : i + step].permute(0, 2, 3, 1)).mul_(scale).view(b, hq, r, -1)
        if host_pos[i : i + step].max() > int(pos[0]):  # a key some row must not see (known on the host)
            s.masked_fill_(pc > q_pos[:, None], float("-inf"))
        if first is not None:  # keys before a row's document
            s.masked_fill_(pc < first[:, None], float("-inf"))
        # the chunk's two row LSEs with one exp: top + log(sum of exp(s - top)) over all / kept keys
        top = s.amax(-1, keepdim=True).clamp_(min=torch.finfo(s.dtype).min)  # rows seeing no key here: exp -> 0
        e = s.sub_(top).exp_()
        sums = torch.stack([e.sum(-1), e.masked_fill_(~pattern.pair_mask(q_pos, pc), 0).sum(-1)])
        lse = torch.logaddexp(lse, sums.log_().add_(top.squeeze(-1)))
    if layout is not None:
        lse = ranks_logsumexp(lse, group)
    return torch.exp(lse[1] - lse[0])

"""Pattern recall: the estimated fraction of attention mass a vertical-slash pattern keeps.

Measured like the estimation itself, on the last ``last_q`` queries of the sequence: their exact
softmax over all keys, summed over the pairs the pattern keeps, averaged over rows and heads.
Works on one device or across a context-parallel group (keys sharded in a layout); costs about
two passes of ``last_q`` rows over the keys, so the trainer measures it on logging steps only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops.pattern import VerticalSlashPattern
from ..parallel.layout import Layout

_CHUNK_ELEMENTS = 1 << 22


def _last_rows(q: Tensor, seq_len: int, last_q: int, layout: Layout | None, group) -> tuple[Tensor, Tensor]:
    """(rows [B, last_q, Hq, D], positions) of the globally last queries, present on every rank."""
    pos = torch.arange(seq_len - last_q, seq_len)
    if layout is None:
        return q[:, pos.to(q.device)], pos.to(q.device)
    owner, local = layout.owner(pos)
    mine = (owner == dist.get_rank(group)).to(q.device)[None, :, None, None]
    rows = torch.where(mine, q.index_select(1, local.to(q.device)), torch.zeros((), dtype=q.dtype, device=q.device))
    dist.all_reduce(rows, group=group)  # each row is non-zero on its owner only: the sum is exact
    return rows, pos.to(q.device)


def _chunk_scores(q_last: Tensor, q_pos: Tensor, k: Tensor, k_pos: Tensor, scale: float) -> Tensor:
    """Scaled causal scores [B, Hq, R, C] in float32 or float64 (-inf where not causal); K heads not copied."""
    b, r, hq, d = q_last.shape
    hkv = k.shape[2]
    acc = torch.float64 if q_last.dtype == torch.float64 else torch.float32
    qg = q_last.transpose(1, 2).to(acc).reshape(b, hkv, (hq // hkv) * r, d)
    s = torch.matmul(qg, k.to(acc).permute(0, 2, 3, 1)).mul_(scale).view(b, hq, r, -1)
    return s.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))


@torch.no_grad()
def pattern_recall(
    q: Tensor,
    k: Tensor,
    pattern: VerticalSlashPattern,
    last_q: int,
    scale: float,
    group: dist.ProcessGroup | None = None,
    layout: Layout | None = None,
) -> float:
    """Mean over the last ``last_q`` rows and all query heads of the attention probability the pattern keeps.

    Single device (no ``layout``): q [B, S, Hq, D], k [B, S, Hkv, D] hold positions 0..S-1.
    Context parallel: q/k are this rank's shards in ``layout`` over ``group``; collective.
    """
    seq_len = pattern.seq_len
    q_last, q_pos = _last_rows(q, seq_len, min(last_q, seq_len), layout, group)
    if layout is None:
        k_pos = torch.arange(k.shape[1], device=k.device)
    else:
        k_pos = layout.positions(dist.get_rank(group)).to(k.device)
    b, r, hq, _ = q_last.shape
    step = max(1, _CHUNK_ELEMENTS // (b * hq * r))
    chunks = [(k[:, i : i + step], k_pos[i : i + step]) for i in range(0, k.shape[1], step)]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.full((b, hq, r), float("-inf"), dtype=acc, device=q.device)
    for kc, pc in chunks:
        lse = torch.logaddexp(lse, torch.logsumexp(_chunk_scores(q_last, q_pos, kc, pc, scale), dim=-1))
    if layout is not None:  # global row LSE: max, then sum of exp over ranks
        top = lse.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        total = torch.exp(lse - top)
        dist.all_reduce(total, group=group)
        lse = top + torch.log(total)
    kept = torch.zeros((), dtype=torch.float64, device=q.device)
    for kc, pc in chunks:
        p = torch.exp(_chunk_scores(q_last, q_pos, kc, pc, scale) - lse[..., None])
        kept += (p * pattern.pair_mask(q_pos, pc)).sum(dtype=torch.float64)
    if layout is not None:
        dist.all_reduce(kept, group=group)
    return float(kept) / (b * hq * r)

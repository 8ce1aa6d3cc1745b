"""Exact work accounting of a global pattern under a layout: computed (q, k) pairs per rank and ring step.

In the flat ring, rank r at step t attends its queries to the keys of rank (r - t) mod W, and the
ranks advance in lock step (each waits for its neighbour's K/V), so two numbers matter:
- worker level: max / mean over ranks of each rank's total work;
- step level: per step max / mean over ranks, and the lock-step cost sum_t max_r work[r, t]
  relative to perfect balance (total / W).

Counting is exact and vectorised over the pattern's G-blocks: a selected block diagonal delta
contributes G*G pairs per (query block, key block) pair at distance delta > 0 and G(G+1)/2 at
delta = 0; a vertical j adds, per query block at distance delta of an unselected diagonal, the
rows i >= j of that block (G, or (kb+1)G - j on its own block). Sums are over batch and heads.

With packed documents (``ops.Documents``) only pairs within one document count: per query row i and
key block the keys in [max(block start, start of i's document), min(block end, i)], summed over the
rows of each query block; a vertical adds only the rows of its own document. The ring's skipped
steps (no key of the rows' documents) then count zero.

Internal tool: counts documents as the ring does, through ``mtraining.ops.documents``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mtraining.ops import Documents, VerticalSlashPattern
from mtraining.ops.documents import resolve_documents
from mtraining.parallel import Layout

_CHUNK_ELEMENTS = 1 << 24  # bound on the [heads, verticals, query blocks] temporaries


@dataclass(frozen=True)
class ImbalanceReport:
    """Computed (q, k) pairs of one pattern under one layout.

    Attributes:
        layout: the layout's name.
        pairs: float64 [W, W]; pairs[r, t] = pairs rank r computes at ring step t (keys of rank r - t).
    """

    layout: str
    pairs: Tensor

    @property
    def world_size(self) -> int:
        return self.pairs.shape[0]

    @property
    def rank_totals(self) -> Tensor:
        """float64 [W]: each rank's pairs over all steps."""
        return self.pairs.sum(1)

    @property
    def rank_imbalance(self) -> float:
        """max / mean over ranks of the per-rank totals (1.0 = perfectly even)."""
        totals = self.rank_totals
        return float(totals.max() / totals.mean())

    @property
    def step_imbalance(self) -> Tensor:
        """float64 [W]: per ring step, max / mean over ranks (1.0 where no rank works)."""
        mean = self.pairs.mean(0)
        return torch.where(mean > 0, self.pairs.max(0).values / mean.clamp_min(1e-300), 1.0)

    @property
    def lockstep_imbalance(self) -> float:
        """sum over steps of the slowest rank's pairs, over total / W: the ring's cost vs perfect balance."""
        return float(self.pairs.max(0).values.sum() / (self.pairs.sum() / self.world_size))

    def format(self) -> str:
        """A small table: pairs per rank and step, then the imbalance figures."""
        w = self.world_size
        head = "rank " + "".join(f"{'step ' + str(t):>12}" for t in range(w)) + f"{'total':>14}"
        rows = [
            f"{r:>4} " + "".join(f"{float(x):>12.4g}" for x in self.pairs[r]) + f"{float(self.rank_totals[r]):>14.4g}"
            for r in range(w)
        ]
        steps = " ".join(f"{float(x):.2f}" for x in self.step_imbalance)
        return "\n".join(
            [
                f"layout {self.layout}, {w} ranks: computed (q, k) pairs",
                head,
                *rows,
                f"rank imbalance (max/mean of totals): {self.rank_imbalance:.3f}",
                f"step imbalance (max/mean per step): {steps}",
                f"lock-step imbalance (sum of per-step max / ideal): {self.lockstep_imbalance:.3f}",
            ]
        )


def imbalance_report(
    pattern: VerticalSlashPattern, layout: Layout, documents: Documents | None = None
) -> ImbalanceReport:
    """Exact pairs per (rank, step) of ``pattern`` in the flat ring over ``layout`` (within ``documents``)."""
    if pattern.block_cols is not None:
        raise ValueError(
            "imbalance_report counts verticals and block diagonals only, not per-block columns "
            "(pattern.block_cols): pass the pattern without them"
        )
    if pattern.seq_len != layout.seq_len:
        raise ValueError(
            f"pattern is for seq_len {pattern.seq_len} but the layout for {layout.seq_len}; use the layout "
            "of the sequence the pattern was estimated on"
        )
    layout.check_pattern_block(pattern.block_size)
    documents = resolve_documents(documents, pattern.batch, layout.seq_len)
    if documents is not None:
        return _document_report(pattern, layout, documents)
    g, w = pattern.block_size, layout.world_size
    nb = layout.seq_len // g
    blocks = torch.arange(nb)
    key_owner = layout.owner(blocks * g)[0]  # [nb]: rank holding each key block
    selected = pattern.diag_mask().cpu()
    weight = torch.full((nb,), float(g * g), dtype=torch.float64)
    weight[0] = g * (g + 1) / 2
    diag_pairs = selected.sum((0, 1)).double() * weight  # pairs of one (q block, k block) pair at distance delta
    unselected = (~selected).flatten(0, 1)  # [BH, nb]
    cols = pattern.vertical_pos.cpu().long().flatten(0, 1)  # [BH, V]
    real = torch.arange(cols.shape[-1])[None, :] < pattern.num_verticals.cpu().flatten()[:, None]
    cols = cols.clamp(max=layout.seq_len - 1)
    col_block = cols // g
    own_rows = ((col_block + 1) * g - cols).double()  # rows i >= j on the vertical's own block
    pairs = torch.zeros(w, w, dtype=torch.float64)
    for r in range(w):
        steps = (r - key_owner) % w  # [nb]: the ring step at which rank r meets each key block
        q_blocks = layout.positions(r)[::g] // g  # [Lb]
        delta = q_blocks[:, None] - blocks[None, :]  # [Lb, nb]
        block_work = torch.where(delta >= 0, diag_pairs[delta.clamp(min=0)], 0.0).sum(0)
        pairs[r].index_add_(0, steps, block_work)
        vertical_work = _vertical_work(unselected, col_block, own_rows, real, q_blocks, g)
        pairs[r].index_add_(0, steps[col_block].flatten(), vertical_work.flatten())
    return ImbalanceReport(layout.name, pairs)


def _vertical_work(
    unselected: Tensor,
    col_block: Tensor,
    own_rows: Tensor,
    real: Tensor,
    q_blocks: Tensor,
    g: int,
    ends: Tensor | None = None,
) -> Tensor:
    """float64 [BH, V]: pairs each vertical adds on the query blocks ``q_blocks`` (outside selected diagonals);
    ``ends`` [BH, V]: where each vertical's document ends (its rows stop there; own_rows then counts to it)."""
    bh, v = col_block.shape
    out = torch.zeros(bh, v, dtype=torch.float64)
    chunk = max(1, _CHUNK_ELEMENTS // max(v * q_blocks.numel(), 1))
    nb = unselected.shape[-1]
    for start in range(0, bh, chunk):
        heads = slice(start, start + chunk)
        delta = q_blocks[None, None, :] - col_block[heads, :, None]  # [h, V, Lb]
        open_diag = unselected[heads].gather(-1, delta.clamp(0, nb - 1).flatten(1)).view(delta.shape)
        far = float(g) if ends is None else (ends[heads, :, None] - q_blocks * g).clamp(0, g).double()
        rows = torch.where(delta > 0, far, torch.where(delta == 0, own_rows[heads, :, None], 0.0))
        out[heads] = (rows * open_diag).sum(-1) * real[heads]
    return out


def _document_report(pattern: VerticalSlashPattern, layout: Layout, documents: Documents) -> ImbalanceReport:
    """``imbalance_report`` within packed documents (module docstring), batch row by batch row."""
    g, w, n = pattern.block_size, layout.world_size, layout.seq_len
    nb = n // g
    key_start = torch.arange(nb) * g
    key_owner = layout.owner(key_start)[0]
    selected = pattern.diag_mask().cpu()
    pairs = torch.zeros(w, w, dtype=torch.float64)
    for b in range(pattern.batch):
        row = min(b, documents.batch - 1)
        chosen = selected[b].sum(0).double()  # [nb]: heads selecting each block diagonal
        unselected = ~selected[b]  # [H, nb]
        cols = pattern.vertical_pos[b].cpu().long().clamp(max=n - 1)  # [H, V]
        real = torch.arange(cols.shape[-1])[None, :] < pattern.num_verticals[b].cpu()[:, None]
        ends = documents.ends(cols.flatten())[row].view(cols.shape)
        col_block = cols // g
        own_rows = (torch.minimum((col_block + 1) * g, ends) - cols).double()
        for r in range(w):
            pos = layout.positions(r)
            steps = (r - key_owner) % w
            bound = documents.left_bounds(pos)[row].long()
            q_blocks = pos[::g] // g
            # per query block and key block: pairs with max(key start, bound) <= j <= min(key end, i)
            per_block = torch.zeros(q_blocks.numel(), nb, dtype=torch.float64)
            step_rows = max(g, _CHUNK_ELEMENTS // max(nb, 1) // g * g)
            for lo in range(0, pos.numel(), step_rows):
                p, lb = pos[lo : lo + step_rows, None], bound[lo : lo + step_rows, None]
                span = torch.minimum(key_start + g - 1, p) - torch.maximum(key_start, lb) + 1
                per_block[lo // g : (lo + p.shape[0]) // g] = span.clamp(min=0).double().view(-1, g, nb).sum(1)
            delta = q_blocks[:, None] - torch.arange(nb)[None, :]
            block_work = (torch.where(delta >= 0, chosen[delta.clamp(min=0)], 0.0) * per_block).sum(0)
            pairs[r].index_add_(0, steps, block_work)
            vertical_work = _vertical_work(unselected, col_block, own_rows, real, q_blocks, g, ends)
            pairs[r].index_add_(0, steps[col_block].flatten(), vertical_work.flatten())
    return ImbalanceReport(layout.name, pairs)

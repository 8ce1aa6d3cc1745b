"""Dense causal attention of one chunk pair as a few dense sub-problems (blocks), merged by LSE.

A chunk pair (query rows, key rows, each with its global positions, strictly increasing along the
chunk) is what one ring step or one single-device call computes. With no pattern (dense causal),
every layout's chunk pair splits into a handful of *blocks*, each a plain dense attention problem:

- ``causal``: the block's query and key positions are the same sequence, so position-causal is
  top-left causal by local index (what cuDNN's ``is_causal`` computes);
- not causal: every key of the block precedes every query (all pairs visible).

``decompose`` finds them: it cuts the positions into runs of consecutive positions, refines the
runs at each other's boundaries (so any query segment and key segment are either the same range
or disjoint), then emits one causal block per diagonal stretch and one full block per stretch of
query segments that see the same key prefix. Contiguous and zigzag layouts give one block per
ring step (step 0: the shard against itself, one causal block; later steps: half of q or half of
k, one full block); the single-device case with Sq < Sk gives two. The striped layout's later
steps are a staircase of G-token stripes (one block per stripe): more than ``MAX_BLOCKS`` blocks
returns None and the caller runs the sparse backend's dense path (the Triton kernels) for that step.

Packed documents (``doc_starts``, one set of boundaries for the whole batch): segments are also cut
at every document start, a causal block never spans two documents, and a full block holds only the
keys of its rows' document; so a single-device call gives one causal block per document.

``DenseBlocks`` runs the blocks with a pluggable per-block attention (``BlockOps``: cuDNN, or the
torch backend) and keeps the contract of ``ops.sparse.attention_forward``/``attention_backward``:
out [B, Sq, Hq, D], lse [B, Hq, Sq] float32 natural log, merged exactly by LSE, rows that see no key
out 0 / lse -inf; the backward gets the full-row (merged) out and lse and returns float32 dq/dk/dv of
just this chunk pair's pairs. A FlashAttention-style backward only needs P = exp(S - lse_row) and
delta = rowsum(dO * O_row), so passing the merged out and lse of the whole row gives each block's
exact share.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ..numerics import acc_dtype, merge_partial

MAX_BLOCKS = 4


class Block(NamedTuple):
    """Local rows [q0, q1) against local keys [k0, k1); causal: top-left by local index (q1-q0 == k1-k0)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


# ----------------------------------------------------------------------------- decomposition
def _runs(pos: Tensor) -> list[tuple[int, int, int]] | None:
    """Maximal runs of consecutive positions as (local start, local end, first position); None unless increasing."""
    pos = pos.detach().to("cpu", torch.int64).reshape(-1)
    n = pos.numel()
    if n == 0:
        return []
    step = pos[1:] - pos[:-1]
    if bool((step <= 0).any()):
        return None
    cuts = [0, *((step != 1).nonzero().reshape(-1) + 1).tolist(), n]
    first = pos[torch.tensor(cuts[:-1])].tolist()
    return [(a, b, p) for a, b, p in zip(cuts[:-1], cuts[1:], first)]


def _segments(runs: list[tuple[int, int, int]], bounds: list[int]) -> list[tuple[int, int, int]]:
    """Runs split at every boundary position strictly inside them: (local start, local end, first position)."""
    out = []
    for a, b, p in runs:
        end = p + (b - a)
        i = bisect.bisect_right(bounds, p)
        while i < len(bounds) and bounds[i] < end:
            cut = bounds[i]
            out.append((a, a + cut - p, p))
            a, p = a + cut - p, cut
            i += 1
        out.append((a, b, p))
    return out


def decompose(
    q_pos: Tensor, k_pos: Tensor, max_blocks: int | None = MAX_BLOCKS, doc_starts: Sequence[int] | None = None
) -> tuple[Block, ...] | None:
    """Dense blocks covering exactly the pairs k_pos[j] <= q_pos[i] (of one document, with ``doc_starts``:
    the ascending positions where documents start), each once; None if positions are not strictly
    increasing or more than ``max_blocks`` blocks would be needed (None: no limit).

    Reads the positions on the host (one device sync for device tensors)."""
    q_runs, k_runs = _runs(q_pos), _runs(k_pos)
    if q_runs is None or k_runs is None:
        return None
    return _decompose_runs(q_runs, k_runs, max_blocks, doc_starts)


def _decompose_runs(
    q_runs: list[tuple[int, int, int]],
    k_runs: list[tuple[int, int, int]],
    max_blocks: int | None = MAX_BLOCKS,
    doc_starts: Sequence[int] | None = None,
) -> tuple[Block, ...] | None:
    """``decompose`` of positions given as their runs of consecutive positions (local start, local end, first
    position), increasing: host arithmetic only, no tensor is read."""
    if not q_runs or not k_runs:
        return ()
    starts = sorted(doc_starts or [])
    bounds = sorted({p for a, b, p in q_runs + k_runs} | {p + b - a for a, b, p in q_runs + k_runs} | set(starts))
    qs, ks = _segments(q_runs, bounds), _segments(k_runs, bounds)
    k_starts = [p for _, _, p in ks]
    k_ends = [p + b - a for a, b, p in ks]

    def document(position: int) -> int:
        return bisect.bisect_right(starts, position)

    # per query segment: its keys outside a causal block are the key segments [first[t], seen[t]): from its
    # document's first (0 without documents) to the last entirely before it (positions increase); partner
    # = index of the key segment with the same range, if any (refined segments never overlap partially)
    first, seen, partner = [], [], []
    for a, b, p in qs:
        f = bisect.bisect_right(k_ends, p)
        same = f < len(ks) and k_starts[f] == p
        if same and k_ends[f] != p + b - a:  # cannot happen after refinement
            return None
        first.append(bisect.bisect_left(k_starts, starts[document(p) - 1]) if starts and document(p) else 0)
        seen.append(f)
        partner.append(f if same else None)
    blocks: list[Block] = []
    extra = list(seen)  # key segments each query segment sees outside its causal block
    i = 0
    while i < len(qs):  # causal blocks: stretches of segments paired with consecutive key segments, one document
        if partner[i] is None:
            i += 1
            continue
        j = i
        while j + 1 < len(qs) and partner[j + 1] == partner[j] + 1 and first[j + 1] == first[i]:
            j += 1
        for t in range(i, j + 1):
            extra[t] = partner[i]
        blocks.append(Block(qs[i][0], qs[j][1], ks[partner[i]][0], ks[partner[j]][1], True))
        i = j + 1
    i = 0
    while i < len(qs):  # full blocks: stretches of segments that see the same key segments
        j = i
        while j + 1 < len(qs) and extra[j + 1] == extra[i] and first[j + 1] == first[i]:
            j += 1
        if extra[i] > first[i]:
            blocks.append(Block(qs[i][0], qs[j][1], ks[first[i]][0], ks[extra[i] - 1][1], False))
        i = j + 1
    if max_blocks is not None and len(blocks) > max_blocks:
        return None
    return tuple(sorted(blocks))


def decompose_default(
    sq: int, sk: int, max_blocks: int | None = MAX_BLOCKS, doc_starts: Sequence[int] | None = None
) -> tuple[Block, ...] | None:
    """``decompose`` of the default positions (keys 0..sk-1, queries the last sq of them), from the shape alone:
    host arithmetic, no tensor read and no device sync."""
    q_runs = [(0, sq, sk - sq)] if sq else []
    k_runs = [(0, sk, 0)] if sk else []
    return _decompose_runs(q_runs, k_runs, max_blocks, doc_starts)


@functools.lru_cache(maxsize=64)
def default_blocks(sq: int, sk: int) -> tuple[Block, ...] | None:
    """``decompose_default`` without documents, kept per shape."""
    return decompose_default(sq, sk)


# ----------------------------------------------------------------------------- running the blocks
class BlockOps(NamedTuple):
    """forward(q, k, v, causal, scale) -> (out [B,Sq,Hq,D] in q's dtype, lse [B,Hq,Sq] float32);
    backward(do, q, k, v, out, lse, causal, scale) -> float32 (dq, dk, dv), with out/lse of the whole row."""

    name: str
    forward: Callable
    backward: Callable


class DenseBlocks(NamedTuple):
    """A dense causal chunk pair as ``blocks`` run through ``ops`` (``dense_blocks`` builds it)."""

    ops: BlockOps
    blocks: tuple[Block, ...]

    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(out [B, Sq, Hq, D] in out_dtype, lse [B, Hq, Sq]) of the chunk pair; 0 / -inf for rows seeing no key."""
        b, sq, hq, d = q.shape
        acc = acc_dtype(q)
        blocks, ops = self.blocks, self.ops
        if len(blocks) == 1 and blocks[0].q0 == 0 and blocks[0].q1 == sq:
            blk = blocks[0]
            o, lse = ops.forward(q, k[:, blk.k0 : blk.k1], v[:, blk.k0 : blk.k1], blk.causal, scale)
            return o.to(out_dtype), lse.to(acc)
        out = torch.zeros(b, sq, hq, d, dtype=acc, device=q.device)
        lse = torch.full((b, hq, sq), float("-inf"), dtype=acc, device=q.device)
        written: list[Block] = []
        for blk in blocks:
            rows = slice(blk.q0, blk.q1)
            o, part = ops.forward(q[:, rows], k[:, blk.k0 : blk.k1], v[:, blk.k0 : blk.k1], blk.causal, scale)
            if any(w.q0 < blk.q1 and blk.q0 < w.q1 for w in written):
                merge_partial(out[:, rows], lse[:, :, rows], o, part.to(acc))
            else:  # first block of these rows: a copy, no merge
                out[:, rows] = o
                lse[:, :, rows] = part
            written.append(blk)
        return out.to(out_dtype), lse

    def backward(
        self, do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(dq, dk, dv) float32 (float64 for float64 inputs) of the chunk pair's pairs; out/lse are the whole rows'."""
        acc = acc_dtype(q)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for blk in self.blocks:
            rows, cols = slice(blk.q0, blk.q1), slice(blk.k0, blk.k1)
            gq, gk, gv = self.ops.backward(
                do[:, rows], q[:, rows], k[:, cols], v[:, cols], out[:, rows], lse[:, :, rows], blk.causal, scale
            )
            dq[:, rows] += gq
            dk[:, cols] += gk
            dv[:, cols] += gv
        return dq, dk, dv

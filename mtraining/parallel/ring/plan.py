"""What a ring call needs besides its tensors, and how each of its steps runs.

``LayoutPlan`` holds what a rank needs to know about a (static) layout: every rank's global positions on
the device, which ranks' keys this rank sees at all, the dense-block decomposition of each step. It is
built once per (layout, rank, device) and kept in a small cache keyed by those values (a layout compares
by its name and sizes), so its position tensors are stable objects: kernel indices cache on them across
calls (``VerticalSlashPattern.index_cache``).

``RingPlan`` is built per call by ``plan_ring``: for every source rank, the ``ChunkPlan`` of the step that
visits that rank's keys (``ops.sparse.plan_chunk``: dense blocks or the backend), or None where the step
computes nothing. ``plan_ring`` is the one place where a step decides to skip its compute; the schedules
(flat.py, hierarchical.py) only move K/V and call ``RingPlan.attend`` / ``RingPlan.grads``.

Packed documents (``ops.Documents``): a step computes iff some local query's document holds some key of
its source, decided on the host from the boundaries and the layout's CPU positions (``DocumentPlan``, built
once per documents, layout and rank); skipped steps still pass K/V on. Each computing step gets the local
rows' left bounds, and dense steps the decomposition cut at document starts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ...ops.dense import Block, decompose
from ...ops.documents import Documents
from ...ops.pattern import VerticalSlashPattern
from ...ops.sparse.attention import ChunkPlan, document_blocks, plan_chunk
from ..layout import Layout


@dataclass(frozen=True)
class LayoutPlan:
    """One rank's view of a layout on one device (see the module docstring).

    Attributes:
        layout: the layout.
        rank: this rank (group rank).
        positions: int32 global positions of every rank's shard, on the device.
        visible: per source rank, does this rank's queries see any of its keys (first key <= last query).
    """

    layout: Layout
    rank: int
    positions: tuple[Tensor, ...]
    visible: tuple[bool, ...]
    _blocks: dict[int, tuple[Block, ...] | None] = field(default_factory=dict, repr=False)
    _dense_patterns: dict[tuple[int, int], VerticalSlashPattern] = field(default_factory=dict, repr=False)

    def step_blocks(self, src: int) -> tuple[Block, ...] | None:
        """The dense decomposition of the step that visits ``src``'s keys (None: more than MAX_BLOCKS
        blocks), computed on first use from the layout's CPU positions."""
        if src not in self._blocks:
            self._blocks[src] = decompose(self.layout.positions(self.rank), self.layout.positions(src))
        return self._blocks[src]

    def dense_pattern(self, batch: int, heads: int) -> VerticalSlashPattern:
        """Dense causal on the layout's G-grid, for the Triton kernels (kept: its kernel indices live across calls)."""
        key = (batch, heads)
        if key not in self._dense_patterns:
            device = self.positions[0].device
            layout = self.layout
            self._dense_patterns[key] = VerticalSlashPattern.dense(
                batch, heads, layout.seq_len, layout.block_size, device=device
            )
        return self._dense_patterns[key]


@functools.lru_cache(maxsize=64)
def layout_plan(layout: Layout, rank: int, device: torch.device) -> LayoutPlan:
    """The ``LayoutPlan`` of ``rank`` in ``layout`` on ``device``, built once (from CPU positions: no device sync)."""
    cpu = [layout.positions(r) for r in range(layout.world_size)]
    last_query = int(cpu[rank][-1])
    return LayoutPlan(
        layout,
        rank,
        tuple(p.to(device=device, dtype=torch.int32) for p in cpu),
        tuple(int(p[0]) <= last_query for p in cpu),
    )


@dataclass(frozen=True)
class DocumentPlan:
    """One rank's view of packed documents in a layout: its rows' left bounds and the steps that compute.

    Attributes:
        q_bound: int32 [B or 1, local_len] on the device, the left bound of each local row (``Documents.left_bounds``).
        visible: per source rank, does some local query's document hold some of its keys (and precede it).
        blocks: per source rank, the dense decomposition by document (from CPU positions), built on first use.
    """

    q_bound: Tensor
    visible: tuple[bool, ...]
    documents: Documents
    layout: Layout
    rank: int
    _blocks: dict[int, tuple[Block, ...] | None] = field(default_factory=dict, repr=False)

    def step_blocks(self, src: int) -> tuple[Block, ...] | None:
        if src not in self._blocks:
            cpu = self.layout.positions
            self._blocks[src] = document_blocks(self.documents, cpu(self.rank), cpu(src))
        return self._blocks[src]


def document_plan(documents: Documents, layout: Layout, rank: int, device: torch.device) -> DocumentPlan:
    """The ``DocumentPlan`` of ``rank``, built once per documents object, layout and device (no device sync:
    the boundaries and the layout's positions are on the host)."""

    def build() -> DocumentPlan:
        q_cpu = layout.positions(rank)
        bounds = documents.left_bounds(q_cpu)  # [B or 1, local_len]
        visible = []
        for src in range(layout.world_size):
            k_cpu = layout.positions(src)
            # keys of src in [bound, q] for some row: count of keys <= q minus count of keys < bound
            upto = torch.searchsorted(k_cpu, q_cpu, right=True)
            before = torch.searchsorted(k_cpu, bounds.long())
            visible.append(bool((upto[None, :] > before).any()))
        return DocumentPlan(bounds.to(device), tuple(visible), documents, layout, rank)

    return documents.cached(("ring", layout, rank, device), build)


@dataclass(frozen=True)
class RingPlan:
    """One ring call of one rank: per source rank, how the step visiting its keys runs (None: skipped)."""

    steps: tuple[ChunkPlan | None, ...]

    def attend(
        self,
        src: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out_dtype: torch.dtype,
        out: Tensor | None,
        lse: Tensor | None,
    ) -> tuple[Tensor | None, Tensor | None]:
        """(out, lse) with this rank's attention to ``src``'s keys (k, v) merged in (None, None: nothing yet);
        unchanged where the step is skipped."""
        step = self.steps[src]
        if step is None:
            return out, lse
        return step.forward(q, k, v, out_dtype, merge_into=None if out is None else (out, lse))

    def grads(
        self, src: int, do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, delta: Tensor
    ) -> tuple[Tensor, Tensor, Tensor] | None:
        """(dq, dk, dv) of this rank's pairs with ``src``'s keys, given the whole rows' out, lse and delta;
        None where the step is skipped."""
        step = self.steps[src]
        return None if step is None else step.backward(do, q, k, v, out, lse, delta)


# Note [skipped steps]
# plan_ring is the one place where a ring step decides to skip its compute: RingPlan.steps[src] is None
# when no local query sees a key of rank src (with documents: of its own document). A skipped step still
# passes its K/V (and in the backward its partial dK/dV) on, so every rank runs the same number of
# transfers and the ring keeps moving. The schedules (flat.py, hierarchical.py, passes.py) never decide;
# they call RingPlan.attend and RingPlan.grads, which return what they were given for a skipped step.
def plan_ring(
    q: Tensor,
    k: Tensor,
    pattern: VerticalSlashPattern | None,
    layout: Layout,
    rank: int,
    scale: float,
    backend: str,
    documents: Documents | None = None,
) -> RingPlan:
    """Plan every step of one ring call of ``rank`` (``backend`` resolved, ``pattern`` global or None,
    ``documents`` resolved: None or packed documents of the layout's sequence).

    A step computes iff this rank's queries see any key of its source (with documents: of their own
    document); dense steps (no pattern) run as dense blocks where ``plan_chunk`` takes them, else on the
    Triton kernels with the layout's dense pattern.
    """
    lp = layout_plan(layout, rank, q.device)
    q_pos = lp.positions[rank]
    fallback = None
    if pattern is None and backend == "triton":
        fallback = functools.partial(lp.dense_pattern, q.shape[0], q.shape[2])
    visible, blocks, q_bound = lp.visible, lp.step_blocks, None
    if documents is not None:
        dp = document_plan(documents, layout, rank, q.device)
        visible, blocks, q_bound = dp.visible, dp.step_blocks, dp.q_bound
    steps = tuple(
        plan_chunk(q, k, pattern, q_pos, k_pos, scale, backend, functools.partial(blocks, src), fallback, q_bound)
        if seen
        else None
        for src, (k_pos, seen) in enumerate(zip(lp.positions, visible))
    )
    return RingPlan(steps)

"""``ring_attention``: context-parallel causal attention over a process group, in any layout.

A call checks that every rank makes the same call (``agreement.py``, on every call), validates
its inputs (validation.py), estimates the global pattern if asked (``parallel/estimate.py``), plans every
ring step (plan.py: which steps compute, dense blocks or the backend) and runs a schedule under the
autograd op (op.py): the flat ring (flat.py) or the hierarchical ring of inner rings inside nodes and an
outer ring across nodes (hierarchical.py, process groups from ``parallel/topology.py``), or no ring at all:
K/V all-gathered once and the local queries computed as one chunk pair (allgather.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import Tensor

from ...ops.checks import check_reuse, resolve_scale
from ...ops.documents import Documents, resolve_documents
from ...ops.estimate import PatternConfig
from ...ops.pattern import VerticalSlashPattern
from ...ops.sparse.attention import Backend, resolve_backend
from ..agreement import check_ranks_agree
from ..estimate import estimate_agreed
from ..layout import Layout
from ..topology import ring_groups
from .allgather import AllGather, plan_allgather
from .comm import Comm, RingComm
from .flat import FlatRing
from .hierarchical import HierarchicalRing
from .op import RingAttention, Schedule
from .plan import plan_ring
from .validation import call_fields, check_arguments, check_ring_inputs

RINGS = ("flat", "hierarchical", "allgather")


def _schedule(
    group: dist.ProcessGroup | None,
    layout: Layout,
    ring: str,
    inner_size: int | None,
    q: Tensor,
    outer_comm: Callable[[Comm], Comm] | None,
) -> Schedule:
    """The schedule of this call, with its communicators (built per call: nothing cached on groups)."""
    world = dist.get_world_size(group)
    if ring in ("flat", "allgather"):
        if inner_size is not None and inner_size != world:
            raise ValueError(f"inner_size={inner_size} needs ring='hierarchical' (ring={ring!r} has no inner rings)")
        if outer_comm is not None:
            raise ValueError(f"outer_comm wraps the outer ring of ring='hierarchical'; ring={ring!r} has none")
    if ring == "allgather":
        return AllGather(group, layout, q.device)
    if ring == "flat":
        return FlatRing(RingComm(group, q.device), dist.get_rank(group), world)
    groups = ring_groups(group, inner_size)  # validates inner_size; creates the groups on first use
    inner = RingComm(groups.inner, q.device) if groups.inner is not None else None
    outer = RingComm(groups.outer, q.device) if groups.outer is not None else None
    if outer is not None and outer_comm is not None:
        outer = outer_comm(outer)
    return HierarchicalRing(groups.topology, inner, outer)


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup | None,
    layout: Layout,
    pattern: VerticalSlashPattern | None = None,
    pattern_config: PatternConfig | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: Backend = "auto",
    layer_idx: int = 0,
    ring: str = "flat",
    inner_size: int | None = None,
    reuse: tuple[Tensor, Tensor] | None = None,
    outer_comm: Callable[[Comm], Comm] | None = None,
    documents: Documents | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Context-parallel causal attention (vertical-slash sparse with a pattern) over ``group``.

    Collective: every rank of ``group`` calls it with its own shard, in the same order.

    Args:
        q: [B, S/W, Hq, D] this rank's queries, in ``layout`` order; k, v: [B, S/W, Hkv, D].
        group: the context-parallel process group (None: the default group).
        layout: how the global sequence of S tokens is split over the W ranks (``make_layout``).
        pattern: the global pattern, identical on every rank; pattern_config: a ``PatternConfig`` to
            estimate it from these q/k across the group first; neither: dense causal.
        softmax_scale: default 1/sqrt(D).
        return_lse: also return the LSE.
        backend: "auto" (Triton on CUDA, plain PyTorch elsewhere), "triton" or "torch".
        layer_idx: the layer, for per-layer budgets of ``pattern_config``.
        ring: "flat", or "hierarchical": an inner ring of ``inner_size`` ranks per node (default
            LOCAL_WORLD_SIZE) inside an outer ring across nodes; inner_size = W is the flat schedule; or
            "allgather": no ring, K/V of every rank gathered once and the local queries computed against
            them (allgather.py: no overlap, the whole sequence's K/V in memory).
        reuse: (out, lse) that an earlier call with the same inputs returned: the forward ring is skipped
            and the backward uses them (for the forward that activation checkpointing recomputes).
        outer_comm: benchmarks and tests only: wraps the hierarchical ring's outer-ring communicator
            (``bench/links.py`` makes it as slow as an emulated inter-node link).
        documents: packed documents of the global sequence (``mtraining.ops.Documents``, the same on every
            rank): a query sees only keys of its own document; ring steps whose keys no local query's
            document holds skip their compute. None (or one document per row): as before.

    Returns:
        out [B, S/W, Hq, D] in q's dtype, differentiable in q, k, v; with ``return_lse`` also lse
        [B, Hq, S/W] (float32, float64 for float64 inputs).

    Raises:
        ValueError naming the fix, on every rank alike: ranks that make different calls (shapes, dtype,
        layout, pattern grid, ...), shards that do not fit the layout, a pattern of another sequence.
    """
    check_arguments(q, k, v, layout)
    fields = call_fields(
        q,
        k,
        v,
        layout,
        pattern,
        pattern_config,
        softmax_scale,
        backend,
        layer_idx,
        ring,
        inner_size,
        reuse is not None,
        documents,
    )
    check_ranks_agree(group, q.device, "ring_attention", fields)  # see Note [ring agreement]
    if ring not in RINGS:
        raise ValueError(f"ring must be 'flat', 'hierarchical' or 'allgather', got {ring!r}")
    name = resolve_backend(backend, q.device)
    check_ring_inputs(q, k, v, dist.get_world_size(group), layout, pattern, pattern_config, name)
    check_reuse(reuse, q)
    documents = resolve_documents(documents, q.shape[0], layout.seq_len)
    schedule = _schedule(group, layout, ring, inner_size, q, outer_comm)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    if pattern_config is not None:
        pattern = estimate_agreed(q.detach(), k.detach(), pattern_config, group, layout, layer_idx, scale, documents)
    plan_call = plan_allgather if ring == "allgather" else plan_ring
    plan = plan_call(q, k, pattern, layout, dist.get_rank(group), scale, name, documents)
    out, lse = RingAttention.apply(q, k, v, plan, schedule, reuse)
    return (out, lse) if return_lse else out

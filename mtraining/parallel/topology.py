"""Two-level topology of a context-parallel group: inner rings inside a node, outer rings across nodes.

The ``W`` ranks of the group (group ranks, in layout order) are cut into ``O = W / I`` nodes of
``I`` ranks: node ``n`` holds group ranks ``n*I .. n*I + I - 1`` (torchrun numbers ranks node by
node, so with ``I = LOCAL_WORLD_SIZE`` these are the GPUs of one host). Two kinds of ring:

- inner ring of node n: its I ranks in order (fast links: NVLink);
- outer ring of local rank l: group ranks l, l + I, ..., l + (O - 1) I (one GPU per node, the
  slow inter-node link; each GPU has its own NIC on the clusters we target).

An 8-GPU host can be run as 2 "nodes" of 4 (``inner_size=4``) to exercise the hierarchy.

Process groups: ``dist.new_group`` is collective over all ranks, called in the same order
everywhere, so the groups are created once per (context-parallel ranks, inner size) and kept:
by the first ring call when the context-parallel group is the whole world, else by
``init_ring_groups`` called on every rank with every context-parallel group's ranks. They are kept
per default process group (a weak reference to it), so a re-initialised world starts afresh. (Local
synchronisation is no way out: torch names such groups by a hash that includes how many groups
each rank already has.) A ring of one rank has no group (None); a ring spanning the whole
context-parallel group is that group itself.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    """Shape of the hierarchy and this rank's place in it (all ranks are group ranks)."""

    world_size: int
    inner_size: int
    rank: int

    def __post_init__(self) -> None:
        check_shape(self.world_size, self.inner_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside [0, {self.world_size})")

    @property
    def outer_size(self) -> int:
        """Number of nodes O."""
        return self.world_size // self.inner_size

    @property
    def node(self) -> int:
        return self.rank // self.inner_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.inner_size

    def group_rank(self, node: int, local: int) -> int:
        """Group rank of (node, local), both taken modulo the ring sizes."""
        return (node % self.outer_size) * self.inner_size + local % self.inner_size

    def inner_ranks(self, node: int | None = None) -> list[int]:
        """Group ranks of the inner ring of ``node`` (default: this rank's node)."""
        n = self.node if node is None else node
        return [n * self.inner_size + i for i in range(self.inner_size)]

    def outer_ranks(self, local: int | None = None) -> list[int]:
        """Group ranks of the outer ring of local rank ``local`` (default: this rank's)."""
        l_ = self.local_rank if local is None else local
        return [o * self.inner_size + l_ for o in range(self.outer_size)]


def check_shape(world_size: int, inner_size: int) -> None:
    """ValueError naming the fix unless ``inner_size`` ranks per node tile ``world_size`` ranks."""
    if not isinstance(inner_size, int) or isinstance(inner_size, bool) or inner_size <= 0:
        raise ValueError(f"inner_size must be a positive int (GPUs per node), got {inner_size!r}")
    if world_size % inner_size != 0:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"inner_size {inner_size} does not divide the context-parallel world size {world_size}: every node "
            f"must hold the same number of ranks; pass inner_size= one of {divisors} (or launch a world size that "
            f"is a multiple of {inner_size}, e.g. {-(-world_size // inner_size) * inner_size})"
        )


def resolve_inner_size(world_size: int, inner_size: int | None = None) -> int:
    """``inner_size`` if given, else torchrun's LOCAL_WORLD_SIZE (capped at the group size); validated."""
    if inner_size is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            raise ValueError(
                "the hierarchical ring needs the number of GPUs per node: launch with torchrun (it sets "
                "LOCAL_WORLD_SIZE) or pass inner_size= explicitly"
            )
        try:
            local = int(env)
        except ValueError:
            raise ValueError(
                f"LOCAL_WORLD_SIZE={env!r} is not an int; fix the environment or pass inner_size="
            ) from None
        inner_size = min(local, world_size)
    check_shape(world_size, inner_size)
    return inner_size


@dataclass(frozen=True)
class RingGroups:
    """This rank's topology and its two ring groups (None for a ring of one rank)."""

    topology: Topology
    inner: dist.ProcessGroup | None
    outer: dist.ProcessGroup | None


_WHOLE = "whole"  # a ring spanning the whole context-parallel group: the group itself
_CREATED: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple[tuple[int, ...], int], tuple]] = (
    weakref.WeakKeyDictionary()
)


def _created() -> dict[tuple[tuple[int, ...], int], tuple]:
    """(topology, inner, outer) by (context-parallel global ranks, inner size), created in the current world."""
    return _CREATED.setdefault(dist.group.WORLD, {})


def _ring_group(cp_ranks: list[int], ring: list[int], me: int):
    """Create the group of global ranks ``[cp_ranks[r] for r in ring]`` (collective over WORLD)."""
    if len(ring) == len(cp_ranks):
        return _WHOLE
    if len(ring) == 1:
        return None
    members = [cp_ranks[r] for r in ring]
    group = dist.new_group(members)  # every rank of WORLD calls, in the same order
    return group if me in members else None


def init_ring_groups(inner_size: int, cp_ranks: list[list[int]] | None = None) -> None:
    """Create the inner and outer rings of every context-parallel group; collective over WORLD.

    ``cp_ranks``: the global ranks of each context-parallel group in group-rank order (e.g. the
    rows of a data x context mesh); default one group of all ranks. Every rank must call this with
    the same arguments (``dist.new_group`` is called by all ranks in the same order). Needed only
    when the context-parallel group is not the whole world; ``ring_groups`` does it otherwise.
    """
    world = dist.get_world_size()
    cp_ranks = [list(range(world))] if cp_ranks is None else [list(r) for r in cp_ranks]
    me = dist.get_rank()
    for ranks in cp_ranks:
        check_shape(len(ranks), inner_size)
        key = (tuple(ranks), inner_size)
        shape = Topology(len(ranks), inner_size, 0)
        inner = [_ring_group(ranks, shape.inner_ranks(n), me) for n in range(shape.outer_size)]
        outer = [_ring_group(ranks, shape.outer_ranks(lr), me) for lr in range(inner_size)]
        if me in ranks and key not in _created():
            topo = Topology(len(ranks), inner_size, ranks.index(me))
            _created()[key] = (topo, inner[topo.node], outer[topo.local_rank])


def ring_groups(group: dist.ProcessGroup | None, inner_size: int | None = None) -> RingGroups:
    """The inner and outer ring groups of this rank in ``group`` (default: WORLD), created once.

    For the whole world the first call creates them (collective: every rank calls it, as every
    rank calls the ring). For a smaller group call ``init_ring_groups`` on all ranks first.
    """
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    inner_size = resolve_inner_size(world, inner_size)
    ranks = tuple(dist.get_global_rank(group, r) for r in range(world))
    key = (ranks, inner_size)
    created = _created()
    if key not in created and inner_size in (1, world):  # one ring is the group, the others are single ranks
        topo = Topology(world, inner_size, dist.get_rank(group))
        created[key] = (topo, _WHOLE if inner_size == world else None, _WHOLE if inner_size == 1 else None)
    if key not in created:
        if world != dist.get_world_size():
            raise ValueError(
                f"the ring groups of context-parallel group {list(ranks)} (inner_size {inner_size}) do not exist yet: "
                f"call mtraining.parallel.topology.init_ring_groups({inner_size}, cp_ranks=[...every context-parallel "
                "group's global ranks...]) on every rank first (new_group is collective over all ranks)"
            )
        init_ring_groups(inner_size)
    topo, inner, outer = created[key]
    return RingGroups(topo, group if inner is _WHOLE else inner, group if outer is _WHOLE else outer)

"""Topology arithmetic (no processes): node/local ranks, ring membership, shape errors."""

from __future__ import annotations

import pytest

from mtraining.parallel.topology import Topology, resolve_inner_size


def test_two_nodes_of_two():
    tops = [Topology(4, 2, r) for r in range(4)]
    assert [(t.node, t.local_rank) for t in tops] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert tops[3].inner_ranks() == [2, 3] and tops[3].outer_ranks() == [1, 3]
    assert tops[0].outer_size == 2
    assert tops[1].group_rank(-1, 0) == 2  # node and local wrap around


@pytest.mark.parametrize("world,inner", [(4, 4), (4, 1), (6, 3), (6, 2), (32, 8)])
def test_rings_tile_the_world(world, inner):
    t = Topology(world, inner, 0)
    inner_rings = [t.inner_ranks(n) for n in range(t.outer_size)]
    outer_rings = [t.outer_ranks(lr) for lr in range(inner)]
    assert sorted(sum(inner_rings, [])) == list(range(world))
    assert sorted(sum(outer_rings, [])) == list(range(world))
    for ring in inner_rings:  # an inner ring is one node
        assert len({Topology(world, inner, r).node for r in ring}) == 1
    for ring in outer_rings:  # an outer ring has one rank per node, same local rank
        assert len({Topology(world, inner, r).local_rank for r in ring}) == 1


def test_indivisible_world_names_the_fix():
    with pytest.raises(
        ValueError, match=r"inner_size 4 does not divide the context-parallel world size 6.*\[1, 2, 3, 6\]"
    ):
        Topology(6, 4, 0)
    with pytest.raises(ValueError, match="positive int"):
        resolve_inner_size(4, 0)


def test_inner_size_from_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert resolve_inner_size(32) == 8
    assert resolve_inner_size(4) == 4  # the group fits in one node
    assert resolve_inner_size(32, 4) == 4  # explicit wins
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="does not divide"):
        resolve_inner_size(4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ValueError, match="torchrun.*LOCAL_WORLD_SIZE.*inner_size="):
        resolve_inner_size(4)

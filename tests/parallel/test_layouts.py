"""Context-parallel layouts: exact positions, round trips, owner maps, block alignment, errors."""

from __future__ import annotations

import pytest
import torch

from mtraining.ops.sparse.index import check_aligned_positions
from mtraining.parallel import ContiguousLayout, StripedLayout, ZigzagLayout, make_layout

NAMES = ["contiguous", "zigzag", "striped"]
SHAPES = [(64, 2, 8), (96, 3, 16), (256, 4, 16), (128, 1, 32), (512, 8, 32)]


def _valid(name: str, n: int, w: int, g: int) -> bool:
    return n % ((2 if name == "zigzag" else 1) * w * g) == 0


CASES = [(name, *shape) for name in NAMES for shape in SHAPES if _valid(name, *shape)]


def test_explicit_positions():
    assert make_layout("contiguous", 16, 2, 4).positions(1).tolist() == list(range(8, 16))
    assert make_layout("zigzag", 16, 2, 4).positions(0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert make_layout("zigzag", 16, 2, 4).positions(1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert make_layout("striped", 24, 3, 2).positions(1).tolist() == [2, 3, 8, 9, 14, 15, 20, 21]
    assert isinstance(make_layout("striped", 24, 3, 2), StripedLayout)
    assert isinstance(make_layout("zigzag", 16, 2, 4), ZigzagLayout)
    assert isinstance(make_layout("contiguous", 16, 2, 4), ContiguousLayout)


@pytest.mark.parametrize("name,n,w,g", CASES)
def test_positions_partition_and_alignment(name, n, w, g):
    layout = make_layout(name, n, w, g)
    assert layout.name == name and layout.local_len == n // w
    held = []
    for r in range(w):
        pos = layout.positions(r)
        assert pos.dtype == torch.int64 and pos.shape == (layout.local_len,)
        assert bool((pos[1:] > pos[:-1]).all()), "local order must be ascending"
        check_aligned_positions(pos, g, "positions")  # runs of G on the global G-grid
        held.append(pos)
    assert torch.equal(torch.cat(held).sort().values, torch.arange(n))


@pytest.mark.parametrize("name,n,w,g", CASES)
def test_owner_inverts_positions(name, n, w, g):
    layout = make_layout(name, n, w, g)
    for r in range(w):
        rank, local = layout.owner(layout.positions(r))
        assert torch.equal(rank, torch.full((layout.local_len,), r))
        assert torch.equal(local, torch.arange(layout.local_len))
    rank, local = layout.owner(torch.arange(n).view(2, -1))  # any shape
    assert rank.shape == (2, n // 2) and int(rank.max()) == w - 1 and int(local.max()) == layout.local_len - 1


@pytest.mark.parametrize("name,n,w,g", CASES)
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_shard_gather_round_trip(name, n, w, g, dim):
    layout = make_layout(name, n, w, g)
    shape = [3, 2, 5]
    shape[dim] = n
    x = torch.randn(*shape, dtype=torch.float64)
    shards = [layout.shard(x, r, dim=dim) for r in range(w)]
    for r, s in enumerate(shards):
        assert s.shape[dim] == layout.local_len
        assert torch.equal(s, x.index_select(dim, layout.positions(r)))
    assert torch.equal(layout.gather(shards, dim=dim), x)


def test_zigzag_balances_dense_causal_work():
    n, w = 256, 4
    for name, balanced in (("zigzag", True), ("striped", False), ("contiguous", False)):
        layout = make_layout(name, n, w, 8)
        work = torch.stack([(layout.positions(r) + 1).sum() for r in range(w)])
        assert (int(work.max()) == int(work.min())) == balanced, name


@pytest.mark.parametrize(
    "name,n,w,g,fix",
    [
        ("striped", 1000, 4, 128, "use a multiple of 512, e.g. 1024"),
        ("contiguous", 48, 4, 16, "use a multiple of 64, e.g. 64"),
        ("zigzag", 192, 4, 16, "use a multiple of 128, e.g. 256"),
    ],
)
def test_unsplittable_length_names_fix(name, n, w, g, fix):
    with pytest.raises(
        ValueError, match=f"seq_len {n} cannot be split by the {name} layout over {w} ranks with block {g}: {fix}"
    ):
        make_layout(name, n, w, g)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown layout 'ring'; use one of: contiguous, zigzag, striped"):
        make_layout("ring", 64, 2, 8)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        make_layout("striped", 64, 0, 8)
    layout = make_layout("striped", 64, 2, 8)
    with pytest.raises(ValueError, match=r"rank 2 is outside \[0, 2\)"):
        layout.positions(2)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 64\)"):
        layout.owner(torch.tensor([64]))
    with pytest.raises(ValueError, match="must have 64 rows"):
        layout.shard(torch.zeros(1, 63), 0)
    with pytest.raises(ValueError, match="one shard per rank"):
        layout.gather([torch.zeros(1, 32)])
    with pytest.raises(ValueError, match="must have 32 rows"):
        layout.gather([torch.zeros(1, 32), torch.zeros(1, 31)])


def test_equality_and_hash():
    a, b = make_layout("striped", 64, 2, 8), make_layout("striped", 64, 2, 8)
    assert a == b and hash(a) == hash(b) and a != make_layout("zigzag", 64, 2, 8)

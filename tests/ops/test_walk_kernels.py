"""The Triton walk builders (ops/sparse/index_kernels.py, the CUDA path) equal the torch builders exactly.

On the CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py); the
torch builders of ops/sparse/index.py are the oracle: every tensor of the chunk pair and of both
walks must match in dtype, shape and every entry (padding included), on random patterns, partial
last blocks, empty and dense patterns, verticals only, and the chunk pairs of ring steps.
"""

from __future__ import annotations

import pickle
import weakref

import pytest
import torch

from mtraining.ops import VerticalSlashPattern
from mtraining.ops.sparse import index as ki
from mtraining.ops.sparse import index_kernels as wk
from mtraining.ops.sparse import launch
from mtraining.parallel.layout import ContiguousLayout, StripedLayout, ZigzagLayout
from tests.factories import DOCUMENT_KINDS, make_documents, make_pattern

V_CHUNKS = (1, 3, 16)  # vertical chunk sizes of the key walk (the dK/dV kernels' block_v)
SMALL_BLOCKS = dict(nb=16, verts=16, rows=4, diags=8)  # every loop of the builders runs several steps


def assert_same(got, want, what: str) -> None:
    for name in getattr(want, "_fields", None) or want.__dataclass_fields__:  # a walk, or the chunk pair
        a, b = getattr(got, name), getattr(want, name)
        if b is None:  # the document part of a walk without documents
            assert a is None, f"{what}.{name}: {a}, want None"
            continue
        if isinstance(b, int):  # a walk's stride
            assert a == b, f"{what}.{name}: {a}, want {b}"
            continue
        assert a.dtype == b.dtype, f"{what}.{name}: dtype {a.dtype}, want {b.dtype}"
        assert a.shape == b.shape, f"{what}.{name}: shape {tuple(a.shape)}, want {tuple(b.shape)}"
        assert torch.equal(a, b), f"{what}.{name} differs:\n{a}\nwant\n{b}"


def check_builders(
    pattern: VerticalSlashPattern, q_pos: torch.Tensor, k_pos: torch.Tensor, q_bound: torch.Tensor | None = None
) -> None:
    want = ki.chunk_pair_torch(pattern, q_pos, k_pos)
    pair = wk.chunk_pair_triton(pattern, q_pos, k_pos)
    assert_same(pair, want, "chunk_pair")
    assert_same(wk.query_walk_triton(pattern, pair, q_bound), ki.query_walk_torch(pattern, want, q_bound), "query walk")
    for v_chunk in V_CHUNKS:
        got = wk.key_walk_triton(pattern, pair, v_chunk, q_bound)
        assert_same(got, ki.key_walk_torch(pattern, want, v_chunk, q_bound), "key walk")


@pytest.fixture(params=["launch_blocks", "small_blocks"])
def blocks(request, monkeypatch):
    """The builders' vector widths as launched, and small ones (loops over several steps)."""
    if request.param == "small_blocks":
        monkeypatch.setattr(wk, "BLOCKS", SMALL_BLOCKS)


@pytest.mark.slow
@pytest.mark.parametrize(
    "g,n,heads,kind",
    [
        (16, 16 * 9 + 5, (2, 4), "random_heads"),  # partial last block, 8 heads (a GQA model's query heads)
        (16, 16 * 6, (1, 3), "dense"),
        (32, 32 * 4 + 31, (1, 2), "verticals"),
        (32, 32 * 5 - 7, (2, 1), "empty"),
        (64, 64 * 3 + 1, (1, 4), "random_heads"),  # last block of one row
        (64, 64 * 2, (1, 2), "local_sinks"),
        (16, 5, (1, 2), "random_heads"),  # one partial block
    ],
)
def test_single_chunk(blocks, g, n, heads, kind):
    gen = torch.Generator().manual_seed(g * 1000 + n)
    pattern = make_pattern(kind, *heads, n, g, gen)
    pos = torch.arange(n, dtype=torch.int32)
    check_builders(pattern, pos, pos)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["random_heads", "verticals", "empty", "dense"])
def test_key_chunk_is_a_prefix(kind):
    """Fewer keys than queries (the earlier part of the sequence), int64 positions."""
    gen = torch.Generator().manual_seed(5)
    n, g = 16 * 10 + 3, 16
    pattern = make_pattern(kind, 1, 4, n, g, gen)
    pos = torch.arange(n)
    check_builders(pattern, pos, pos[: 16 * 4])
    check_builders(pattern, pos[16 * 3 :], pos[: 16 * 7])


@pytest.mark.slow
@pytest.mark.parametrize("layout", [ContiguousLayout, ZigzagLayout, StripedLayout])
@pytest.mark.parametrize("world,steps", [(2, [(0, 1), (1, 0)]), (4, [(3, 1), (1, 2), (2, 2), (0, 3)])])
def test_ring_steps(layout, world, steps):
    """The chunk pairs of ring steps: rank q's queries against rank k's keys of a layout."""
    g = 16
    lay = layout(2 * world * g * 3, world, g)
    gen = torch.Generator().manual_seed(world * 7 + len(layout.__name__))
    pattern = make_pattern("random_heads", 1, 3, lay.seq_len, g, gen)
    for q_rank, k_rank in steps:
        check_builders(pattern, lay.positions(q_rank).to(torch.int32), lay.positions(k_rank).to(torch.int32))


@pytest.mark.slow
def test_ring_step_small_blocks(monkeypatch):
    """A striped ring step with every loop of the builders running several steps."""
    monkeypatch.setattr(wk, "BLOCKS", SMALL_BLOCKS)
    g, world = 16, 4
    lay = StripedLayout(2 * world * g * 3, world, g)
    pattern = make_pattern("random_heads", 2, 2, lay.seq_len, g, torch.Generator().manual_seed(3))
    check_builders(pattern, lay.positions(1).to(torch.int32), lay.positions(3).to(torch.int32))


@pytest.mark.slow
@pytest.mark.parametrize("docs_kind", DOCUMENT_KINDS)
def test_documents(docs_kind):
    """Packed documents: the walks' document part, on one chunk (per-row documents, a partial last block)
    and on a striped ring step (one row of boundaries for the batch)."""
    g = 16
    gen = torch.Generator().manual_seed(len(docs_kind))
    n = 16 * 6 + 5
    pattern = make_pattern("random_heads", 2, 2, n, g, gen)
    pos = torch.arange(n, dtype=torch.int32)
    check_builders(pattern, pos, pos, make_documents(docs_kind, n, g, gen, batch=2).left_bounds(pos))
    lay = StripedLayout(2 * 4 * g * 2, 4, g)
    q_pos, k_pos = (lay.positions(r).to(torch.int32) for r in (3, 1))
    pattern = make_pattern("random_heads", 2, 2, lay.seq_len, g, gen)
    check_builders(pattern, q_pos, k_pos, make_documents(docs_kind, lay.seq_len, g, gen).left_bounds(q_pos))


@pytest.mark.slow
def test_documents_small_blocks(monkeypatch):
    """Packed documents with every loop of the builders running several steps."""
    monkeypatch.setattr(wk, "BLOCKS", SMALL_BLOCKS)
    g = 16
    gen = torch.Generator().manual_seed(9)
    lay = StripedLayout(2 * 4 * g * 2, 4, g)
    q_pos, k_pos = (lay.positions(r).to(torch.int32) for r in (2, 1))
    pattern = make_pattern("random_heads", 2, 2, lay.seq_len, g, gen)
    check_builders(pattern, q_pos, k_pos, make_documents("mixed", lay.seq_len, g, gen, batch=2).left_bounds(q_pos))


def test_dispatch_by_device(monkeypatch):
    """CPU tensors take the torch builders (the Triton ones only where the positions live on CUDA)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a Triton builder ran for CPU tensors")

    for name in ("chunk_pair_triton", "query_walk_triton", "key_walk_triton"):
        monkeypatch.setattr(launch, name, refuse)
    pattern = make_pattern("random_heads", 1, 2, 64, 16, torch.Generator().manual_seed(2))
    pos = torch.arange(64, dtype=torch.int32)
    pair = launch.chunk_pair(pattern, pos, pos)
    assert_same(launch.query_walk(pattern, pos, pos), ki.query_walk_torch(pattern, pair), "query walk")
    assert_same(launch.key_walk(pattern, pos, pos, 16), ki.key_walk_torch(pattern, pair, 16), "key walk")


@pytest.mark.cuda
@pytest.mark.parametrize("layout", [None, StripedLayout])
def test_builders_agree_on_gpu(layout):
    """Compiled on the GPU at a realistic size (128-blocks, 32K tokens, 16 heads), against the torch
    builders run on the same CUDA tensors."""
    gen = torch.Generator().manual_seed(0)
    n, g = 32768, 128
    nb = n // g
    diag = torch.rand(1, 16, nb, generator=gen) < 0.1
    diag[..., :2] = True
    vert = torch.rand(1, 16, n, generator=gen) < 0.02
    pattern = VerticalSlashPattern.from_masks(diag, vert, g).to("cuda")
    if layout is None:
        q_pos = k_pos = torch.arange(n, dtype=torch.int32, device="cuda")
    else:
        lay = layout(n, 4, g)
        q_pos, k_pos = (lay.positions(r).to("cuda", torch.int32) for r in (2, 1))
    want = ki.chunk_pair_torch(pattern, q_pos, k_pos)
    pair = launch.chunk_pair(pattern, q_pos, k_pos)
    assert_same(pair, want, "chunk_pair")
    assert_same(launch.query_walk(pattern, q_pos, k_pos), ki.query_walk_torch(pattern, want), "query walk")
    for v_chunk in (64, 128):
        assert_same(
            launch.key_walk(pattern, q_pos, k_pos, v_chunk), ki.key_walk_torch(pattern, want, v_chunk), "key walk"
        )


def test_walks_are_cached_per_chunk_pair(monkeypatch):
    """A walk is built once per pattern and chunk pair: the very same position tensors, unmodified;
    the cache holds them (no freed tensor's id can alias an entry) and pickles empty."""
    builds = []

    def counted(pattern, pair, q_bound=None):
        builds.append(1)
        return ki.query_walk_torch(pattern, pair, q_bound)

    monkeypatch.setattr(launch, "query_walk_torch", counted)
    pattern = make_pattern("random_heads", 1, 2, 64, 16, torch.Generator().manual_seed(4))
    pos = torch.arange(64, dtype=torch.int32)
    walk = launch.query_walk(pattern, pos, pos)
    assert launch.query_walk(pattern, pos, pos) is walk and len(builds) == 1
    other = pos.clone()  # equal positions, another chunk pair as far as the cache knows
    assert launch.query_walk(pattern, other, other) is not walk and len(builds) == 2
    held = weakref.ref(other)
    del other
    assert held() is not None  # its id stays taken while the entry lives
    pos.add_(0)  # modified in place: built again
    assert launch.query_walk(pattern, pos, pos) is not walk and len(builds) == 3
    assert len(pickle.loads(pickle.dumps(pattern)).index_cache) == 0

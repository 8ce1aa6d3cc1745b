"""All-gather context parallelism (``ring_attention(..., ring="allgather")``) on gloo ranks against the
float64 oracle, forward and backward: every layout, sparse and dense, packed documents, the kernels."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from mtraining.parallel import make_layout, ring_attention
from mtraining.parallel.ring.allgather import AllGather
from tests.factories import make_documents, make_pattern
from tests.rings import LAYOUTS, SEQ, G, check_ring, make_inputs, ring_case

ALLGATHER = dict(ring="allgather")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("kind", ["causal", "random", "local_sinks", "topk"])
def test_allgather_float64_matches_oracle(pool, world, layout_name, kind):
    ref = check_ring(pool, world, layout_name, kind, torch.float64, seed=world, ring=ALLGATHER)
    if kind == "random":  # rows that see no key are exercised
        assert torch.isneginf(ref[1]).any()


@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("kind", ["causal", "threshold"])
def test_allgather_float32_gqa_batch_strided(pool, layout_name, kind):
    """float32 (estimated pattern for 'threshold'), a batch of two, GQA 6:2, heads-major inputs."""
    check_ring(pool, 3, layout_name, kind, torch.float32, b=2, hq=6, hkv=2, seed=5, strided=True, ring=ALLGATHER)


@pytest.mark.parametrize("layout_name", ["contiguous", "zigzag"])
def test_allgather_dense_blocks_match_oracle(pool, layout_name):
    """Dense attention as dense blocks (the cuDNN path's decomposition, run by the reference ops): the local
    queries against the whole sequence are 2 blocks (contiguous) or 4 (zigzag)."""
    check_ring(pool, 2, layout_name, "causal", torch.float64, seed=3, ring=ALLGATHER, dense="reference")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("kind,docs_kind", [("random", "mixed"), ("causal", "spanning")])
def test_allgather_with_documents_matches_oracle(pool, world, layout_name, kind, docs_kind):
    docs = make_documents(docs_kind, SEQ[world], G, torch.Generator().manual_seed(world), 1)
    check_ring(pool, world, layout_name, kind, torch.float64, seed=7, ring=ALLGATHER, documents=docs)


def test_allgather_dense_blocks_with_documents(pool):
    docs = make_documents("quarters", SEQ[2], G, torch.Generator().manual_seed(2), 1)
    check_ring(pool, 2, "zigzag", "causal", torch.float64, seed=4, ring=ALLGATHER, dense="reference", documents=docs)


@pytest.mark.parametrize("layout_name,kind", [("zigzag", "causal"), ("striped", "random")])
def test_allgather_triton_interpreter(pool, layout_name, kind):
    check_ring(pool, 2, layout_name, kind, torch.float32, seed=3, backend="triton", tol=2e-5, n=128, ring=ALLGATHER)


def test_allgather_equals_the_flat_ring(pool):
    n, b, hq = SEQ[4], 1, 4
    inputs = make_inputs(9, b, n, hq, 2, torch.float32)
    pattern = make_pattern("local_sinks", b, hq, n, G, 9)
    gathered = pool.run(ring_case, 4, "striped", inputs, pattern, None, ALLGATHER)
    flat = pool.run(ring_case, 4, "striped", inputs, pattern)
    for a, f in zip(gathered, flat):
        for x, y in zip(a, f):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def gather_case(group, layout_name, full):
    """Worker: the gathered K/V of every rank's shard of ``full`` (k and v alike), and the reduce-scatter of
    the same tensor as gradients, from ``AllGather`` itself."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = make_layout(layout_name, full.shape[1], world, G)
    schedule = AllGather(group, layout, full.device)
    mine = layout.shard(full, rank)
    k, v = schedule.gather(mine, 2 * mine)
    dk, dv = schedule.reduce_scatter(full * (rank + 1), -full)
    return k, v, dk, dv


@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_gather_orders_keys_globally_and_reduce_scatter_returns_each_shard(pool, layout_name):
    full = torch.randn(2, SEQ[3], 2, 4, dtype=torch.float64)
    results = pool.run(gather_case, 3, layout_name, full)
    layout = make_layout(layout_name, full.shape[1], 3, G)
    for rank, (k, v, dk, dv) in enumerate(results):
        assert torch.equal(k, full) and torch.equal(v, 2 * full)
        torch.testing.assert_close(dk, 6 * layout.shard(full, rank))  # (1 + 2 + 3) x its own rows
        torch.testing.assert_close(dv, -3 * layout.shard(full, rank))


def _unchanged(comm):
    return comm


def error_case(group, kwargs):
    world = dist.get_world_size(group)
    layout = make_layout("striped", 128, world, G)
    q, k, v = (torch.zeros(1, 128 // world, h, 16, dtype=torch.float64) for h in (4, 2, 2))
    try:
        ring_attention(q, k, v, group, layout, backend="torch", ring="allgather", **kwargs)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(inner_size=1), r"inner_size=1 needs ring='hierarchical' \(ring='allgather' has no inner rings\)"),
        (dict(outer_comm=_unchanged), "ring='allgather' has none"),
    ],
)
def test_allgather_errors_name_the_fix(pool, kwargs, message):
    for got in pool.run(error_case, 2, kwargs):
        assert re.search(message, got), got

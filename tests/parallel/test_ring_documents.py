"""Packed documents through the rings (flat and hierarchical, every layout) against the float64 oracle."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mtraining.ops import Documents, estimate_pattern
from mtraining.parallel import make_layout
from mtraining.parallel.estimate import estimate_pattern_cp
from mtraining.parallel.ring.plan import document_plan, plan_ring
from tests.factories import make_documents, make_pattern
from tests.rings import (
    CONFIGS,
    LAYOUTS,
    SEQ,
    TOL,
    G,
    assert_gathered_close,
    check_ring,
    make_inputs,
    reference,
    ring_case,
)


def documents(kind: str, world: int, seed: int, batch: int = 1) -> Documents:
    return make_documents(kind, SEQ[world], G, torch.Generator().manual_seed(seed), batch)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize(
    "kind,docs_kind", [("random", "mixed"), ("causal", "quarters"), ("local_sinks", "spanning"), ("random", "short")]
)
def test_ring_with_documents_matches_oracle(pool, world, layout_name, kind, docs_kind):
    docs = documents(docs_kind, world, world + len(kind))
    check_ring(pool, world, layout_name, kind, torch.float64, seed=world, documents=docs)


@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("docs_kind", ["mixed", "quarters"])
def test_hierarchical_ring_with_documents(pool, layout_name, docs_kind):
    ring = dict(ring="hierarchical", inner_size=2)
    check_ring(pool, 4, layout_name, "random", seed=3, ring=ring, documents=documents(docs_kind, 4, 5))


def test_ring_documents_gqa_batch_rows_float32(pool):
    """Per-row documents for a batch of two, GQA 6:2, float32, strided inputs."""
    docs = documents("mixed", 3, 8, batch=2)
    check_ring(pool, 3, "striped", "local_sinks", torch.float32, b=2, hq=6, hkv=2, seed=4, strided=True, documents=docs)


@pytest.mark.slow
@pytest.mark.parametrize("layout_name,kind", [("zigzag", "causal"), ("striped", "random")])
def test_ring_documents_triton_interpreter(pool, layout_name, kind):
    docs = make_documents("mixed", 128, G, torch.Generator().manual_seed(6))
    check_ring(pool, 2, layout_name, kind, torch.float32, seed=3, backend="triton", tol=2e-5, n=128, documents=docs)


def test_steps_without_keys_of_the_rows_documents_are_skipped():
    """Contiguous layout, four documents of one rank each: a rank's only computing step is its own; the
    striped layout with one document spanning all ranks computes every visible step."""
    n, world = SEQ[4], 4
    q = k = torch.zeros(1, n // world, 2, 16)
    quarters = Documents.from_lengths([n // 4] * 4)
    layout = make_layout("contiguous", n, world, G)
    for rank in range(world):
        plan = plan_ring(q, k, None, layout, rank, 1.0, "torch", quarters)
        assert [step is not None for step in plan.steps] == [src == rank for src in range(world)]
        assert plan_ring(q, k, None, layout, rank, 1.0, "torch").steps[0] is not None  # causal: rank 0's keys
    striped = make_layout("striped", n, world, G)
    spanning = Documents.from_lengths([3, n - 3])
    for rank in range(world):
        assert document_plan(spanning, striped, rank, q.device).visible == (True,) * world


def estimate_case(group, layout_name, q, k, config, docs):
    """Worker: the distributed estimate with documents from this rank's shards, as plain tensors."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = make_layout(layout_name, q.shape[1], world, G)
    p = estimate_pattern_cp(layout.shard(q, rank), layout.shard(k, rank), config, group, layout, documents=docs)
    return p.block_diags, p.num_diags, p.vertical_pos, p.num_verticals


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("docs_kind,batch", [("mixed", 2), ("spanning", 1), ("short", 1)])
def test_distributed_estimate_with_documents_equals_single_device(pool, world, layout_name, docs_kind, batch):
    n, config = SEQ[world], CONFIGS["topk"]
    q, k, _, _ = make_inputs(world, batch, n, 4, 2, torch.float64, rope=True)
    docs = documents(docs_kind, world, 11, batch)
    ref = estimate_pattern(q, k, config, documents=docs)
    expected = (ref.block_diags, ref.num_diags, ref.vertical_pos, ref.num_verticals)
    for rank_result in pool.run(estimate_case, world, layout_name, q, k, config, docs):
        for got, want in zip(rank_result, expected):
            assert torch.equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_ring_estimated_with_documents_matches_oracle(pool, layout_name):
    """The ring estimates the pattern with documents and runs it: the oracle of the single-device estimate."""
    check_ring(pool, 4, layout_name, "threshold", torch.float32, seed=2, documents=documents("mixed", 4, 3))
    check_ring(pool, 2, layout_name, "topk", torch.float64, seed=1, ring=dict(ring="hierarchical", inner_size=1),
               documents=documents("spanning", 2, 4))  # fmt: skip


def unbounded_ring_case(group, *args):
    """Worker: ``ring_case`` with the documents' left bounds dropped (every row bounded by position 0)."""
    real = Documents.left_bounds
    Documents.left_bounds = lambda self, pos: torch.zeros(1, pos.numel(), dtype=torch.int32, device=pos.device)
    try:
        return ring_case(group, *args)
    finally:
        Documents.left_bounds = real


@pytest.mark.parametrize("layout_name", ["contiguous", "striped"])
def test_dropping_the_bound_fails_in_the_ring(pool, layout_name):
    """The ring checks can fail: without the left bounds the ring computes across documents."""
    docs = documents("mixed", 4, 1)
    inputs = make_inputs(1, 1, SEQ[4], 4, 2, torch.float64)
    pattern = make_pattern("random", 1, 4, SEQ[4], G, 2)
    results = pool.run(unbounded_ring_case, 4, layout_name, inputs, pattern, None, None, "torch", False, None, docs)
    with pytest.raises(AssertionError):
        assert_gathered_close(results, layout_name, reference(inputs, pattern, None, docs), TOL[torch.float64])

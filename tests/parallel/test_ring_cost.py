"""Cost model of context-parallel attention (mtraining/parallel/ring_cost.py): limiting cases."""

from __future__ import annotations

import pytest

from mtraining.parallel.ring_cost import (
    AttentionShape,
    Cluster,
    Link,
    StepWork,
    allgather_time,
    flat_ring_time,
    hierarchical_ring_time,
    step_work,
)

FAST = Link(1e18)


def test_compute_bound_is_the_sum_of_compute():
    cluster = Cluster(4, 8, FAST, FAST)
    work = StepWork(fwd=1e-3, bwd=3e-3, kv_bytes=0, grad_bytes=0)
    for predict in (flat_ring_time, hierarchical_ring_time):
        p = predict(cluster, work)
        assert p.fwd == pytest.approx(32e-3)
        assert p.bwd == pytest.approx(96e-3)
        assert p.total == pytest.approx(128e-3)


def test_outer_link_bound_flat_pays_every_step_hierarchical_hides_it():
    slow = Link(1e9, 0.0)  # 1 GB/s between nodes
    cluster = Cluster(2, 4, FAST, slow)
    kv = 1e6  # 1 ms per outer hop; compute 0.5 ms per step: an inner cycle (2 ms) hides the hop
    work = StepWork(fwd=0.5e-3, bwd=0.5e-3, kv_bytes=kv, grad_bytes=0)
    flat = flat_ring_time(cluster, work)
    hier = hierarchical_ring_time(cluster, work)
    assert flat.fwd == pytest.approx(7 * 1e-3 + 0.5e-3)  # W - 1 slow hops
    assert hier.fwd == pytest.approx(8 * 0.5e-3)  # pure compute
    # with no compute at all the hierarchy still pays only O - 1 outer hops, the flat ring W - 1
    idle = StepWork(fwd=0.0, bwd=0.0, kv_bytes=kv, grad_bytes=2 * kv)
    assert hierarchical_ring_time(cluster, idle).fwd == pytest.approx(1e-3)
    assert flat_ring_time(cluster, idle).fwd == pytest.approx(7e-3)
    # backward: K/V then accumulator hops share the link; the last accumulator hop is exposed
    assert hierarchical_ring_time(cluster, idle).bwd == pytest.approx(1e-3 + 2e-3 + 2e-3)
    assert flat_ring_time(cluster, idle).bwd == pytest.approx(1e-3 + 6 * 3e-3 + 2e-3 + 2e-3)


def test_one_node_is_the_flat_ring_and_latency_counts():
    cluster = Cluster(1, 4, Link(1e9, 1e-3), Link(1.0))
    work = StepWork(fwd=0.0, bwd=0.0, kv_bytes=1e6, grad_bytes=0)
    assert hierarchical_ring_time(cluster, work) == flat_ring_time(cluster, work)
    assert flat_ring_time(cluster, work).fwd == pytest.approx(3 * 2e-3)


def test_step_work_for_qwen_shape():
    shape = AttentionShape(16, 2, 128)
    assert shape.kv_bytes_per_token == 2 * 2 * 128 * 2
    w = step_work(shape, 1024, 4, 1.0, 1e9, 5e8)
    assert w.kv_bytes == 256 * 1024 and w.grad_bytes == 2 * w.kv_bytes
    assert w.fwd == pytest.approx(1024 * 1025 / 2 * 16 / 16 / 1e9)
    assert w.bwd == pytest.approx(2 * w.fwd)
    with pytest.raises(ValueError, match="multiple of the 3 GPUs"):
        step_work(shape, 1024, 3, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="bandwidth > 0"):
        Link(0.0)


def test_allgather_overlaps_nothing():
    """W - 1 shards each way per collective, never hidden: it wins where ring steps wait for their hop."""
    link = Link(1e9)
    one_node = Cluster(1, 4, link, FAST)
    work = StepWork(fwd=1e-3, bwd=2e-3, kv_bytes=1e6, grad_bytes=2e6)  # 1 ms per K/V hop, as long as a step
    p = allgather_time(one_node, work)
    assert p.fwd == pytest.approx(3e-3 + 4e-3)
    assert p.bwd == pytest.approx(3e-3 + 8e-3 + 6e-3)
    slow_steps = StepWork(fwd=0.1e-3, bwd=0.2e-3, kv_bytes=1e6, grad_bytes=2e6)  # hops 10x a step's compute
    assert allgather_time(one_node, slow_steps).total < flat_ring_time(one_node, slow_steps).total
    assert allgather_time(one_node, work).total > flat_ring_time(one_node, work).total

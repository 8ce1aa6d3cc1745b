"""bench/links.py: the link model, and its emulation of a slow outer ring in a real hierarchical ring."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from bench.links import EmulatedComm, emulated
from mtraining.parallel.ring.comm import RingComm
from mtraining.parallel.ring_cost import Link
from mtraining.parallel.topology import ring_groups
from tests.factories import make_pattern
from tests.rings import SEQ, G, make_inputs, ring_case


def emulated_case(group, latency):
    """Worker: time of one outer-ring exchange without and with emulation."""
    groups = ring_groups(group, 2)
    comm = RingComm(groups.outer, torch.device("cpu"))
    buf = torch.ones(1000)
    times = []
    for c in (comm, EmulatedComm(comm, Link(1e6, latency))):
        recv = torch.empty(1000)
        dist.barrier()
        t0 = time.perf_counter()
        c.start([buf], [recv]).wait()
        times.append(time.perf_counter() - t0)
        assert torch.equal(recv, buf)
    return times


@pytest.mark.slow
def test_emulation_adds_the_modelled_delay(pool):
    latency = 0.1
    modelled = latency + 4000 / 1e6  # 4000 bytes at 1 MB/s
    for real, slow in pool.run(emulated_case, 4, latency):
        assert slow >= modelled - 1e-3
        assert slow < modelled + 0.5 + real


def test_emulated_hierarchical_ring_is_exact_and_slower(pool):
    n, b, hq = SEQ[4], 1, 4
    inputs = make_inputs(3, b, n, hq, 2, torch.float64)
    pattern = make_pattern("sinks", b, hq, n, G, 3)
    ring = dict(ring="hierarchical", inner_size=2)
    t0 = time.perf_counter()
    slow = pool.run(ring_case, 4, "striped", inputs, pattern, None, dict(ring, outer_comm=emulated(Link(1e12, 0.05))))
    seconds = time.perf_counter() - t0
    plain = pool.run(ring_case, 4, "striped", inputs, pattern, None, ring)
    for e, p in zip(slow, plain):
        for x, y in zip(e, p):
            assert torch.equal(x, y)
    # 2 nodes, each outer hop >= 50 ms: forward 1 K/V hop; backward 1 K/V hop overlapping the first
    # gradient hop, then the gradient hop home
    assert seconds >= 3 * 0.05


def test_link_model():
    link = Link(25e9, 5e-6)
    assert link.label == "emulated 25 GB/s, 5 us"
    assert link.seconds(25e9) == pytest.approx(1 + 5e-6)
    assert link.seconds(0) == 0.0
    with pytest.raises(ValueError, match="bandwidth > 0"):
        Link(0.0)
    with pytest.raises(ValueError, match="latency >= 0"):
        Link(1e9, -1.0)

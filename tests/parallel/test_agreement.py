"""Ranks that make different ring calls (issue 15.5) get the same clear ValueError on every rank, before any
ring transfer; the check runs once per call shape and layout, not on every call."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from mtraining.ops import PatternConfig
from mtraining.parallel import make_layout, ring_attention
from mtraining.parallel.estimate import estimate_pattern_cp
from tests.factories import make_pattern
from tests.rings import CONFIGS, G

N, B, HQ, HKV, D = 128, 1, 4, 2, 16

# (case, what rank 1 passes differently from rank 0, the message every rank must raise)
DISAGREEMENTS = [
    ("layout", dict(layout="contiguous"), r"layout: rank 0 StripedLayout\(.*\), rank 1 ContiguousLayout\("),
    ("query heads", dict(hq=2 * HQ), r"q shape: rank 0 \(1, 64, 4, 16\), rank 1 \(1, 64, 8, 16\)"),
    ("key/value heads", dict(hkv=1), r"k shape: .*v shape: rank 0 \(1, 64, 2, 16\), rank 1 \(1, 64, 1, 16\)"),
    ("head dim", dict(d=32), r"q shape: .*rank 1 \(1, 64, 4, 32\)"),
    ("dtype", dict(dtype=torch.float32), r"dtype: rank 0 'torch.float64', rank 1 'torch.float32'"),
    ("sequence length", dict(n=2 * N), r"q shape: rank 0 \(1, 64, 4, 16\), rank 1 \(1, 128, 4, 16\).*layout:"),
    ("pattern or none", dict(pattern="sinks"), r"pattern \(seq_len, block, batch, heads\): rank 0 None, rank 1 \(128"),
    ("pattern config", dict(config="threshold"), r"pattern_config: rank 0 .*v_size=16.*rank 1 .*threshold=0.8"),
    ("softmax scale", dict(scale=0.5), r"softmax_scale: rank 0 None, rank 1 0.5"),
    ("schedule", dict(ring=dict(ring="hierarchical", inner_size=1)), r"ring: rank 0 'flat', rank 1 'hierarchical'"),
    ("backend", dict(backend="triton"), r"backend: rank 0 'torch', rank 1 'triton'"),
    ("gradients or none", dict(grad=False), r"gradients: rank 0 True, rank 1 False"),
]


def ring_call(group, case: dict, everywhere: bool = False):
    """Worker: a ring call whose arguments are the defaults, changed by ``case`` on group rank 1 (on every
    rank with ``everywhere``)."""
    args = dict(layout="striped", n=N, hq=HQ, hkv=HKV, d=D, dtype=torch.float64, pattern=None, config="topk")
    args.update(scale=None, ring={}, backend="torch", grad=True)
    if everywhere or dist.get_rank(group) == 1:
        args.update(case)
    world = dist.get_world_size(group)
    layout = make_layout(args["layout"], args["n"], world, G)
    q, k, v = (
        torch.randn(B, args["n"] // world, h, args["d"], dtype=args["dtype"]).requires_grad_(args["grad"])
        for h in (args["hq"], args["hkv"], args["hkv"])
    )
    pattern = make_pattern(args["pattern"], B, args["hq"], args["n"], G, 0) if args["pattern"] else None
    config = CONFIGS[args["config"]] if pattern is None else None
    return ring_attention(
        q, k, v, group, layout, pattern, config, args["scale"], backend=args["backend"], **args["ring"]
    )


def disagreement_case(group, case: dict) -> str:
    try:
        ring_call(group, case)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
@pytest.mark.parametrize("case,change,message", DISAGREEMENTS, ids=[c[0] for c in DISAGREEMENTS])
def test_ranks_that_disagree_raise_the_same_error(pool, case, change, message):
    got = pool.run(disagreement_case, 2, change)
    assert got[0] == got[1], got  # the same message on every rank
    assert re.search(r"the 2 ranks disagree on the ring_attention call \(", got[0]), got[0]
    assert re.search(message, got[0]), got[0]


def estimate_case(group, last_q: int) -> str:
    """Worker: the distributed estimate with a config that differs on group rank 1."""
    world = dist.get_world_size(group)
    layout = make_layout("striped", N, world, G)
    q, k = (torch.randn(B, N // world, h, D, dtype=torch.float64) for h in (HQ, HKV))
    last_q = last_q if dist.get_rank(group) else 32
    config = PatternConfig(v_size=16, s_size=12, last_q=last_q, block_size=G, sink_tokens=4, local_window=8)
    try:
        estimate_pattern_cp(q, k, config, group, layout)
    except ValueError as e:
        return str(e)
    return "no error"


def test_estimate_checks_agreement(pool):
    got = pool.run(estimate_case, 2, 16)
    assert got[0] == got[1] and re.search(r"disagree on the estimate_pattern_cp call \(pattern_config:", got[0])
    assert pool.run(estimate_case, 2, 32) == ["no error"] * 2


def cached_case(group) -> list[bool]:
    """Worker: does each call all-gather? A ring call with a given pattern has no other collective."""
    calls = []
    gather = dist.all_gather

    def counting(*args, **kwargs):
        calls.append(1)
        return gather(*args, **kwargs)

    seen = []
    dist.all_gather = counting
    try:
        for change in (
            dict(pattern="sinks"),
            dict(pattern="sinks"),
            dict(pattern="sinks"),
            dict(pattern="sinks", n=2 * N),
        ):
            calls.clear()
            ring_call(group, change, everywhere=True)
            seen.append(bool(calls))
    finally:
        dist.all_gather = gather
    return seen


def test_the_check_runs_once_per_shape(pool):
    assert pool.run(cached_case, 2) == [[True, False, False, True]] * 2  # the fourth call: a new length

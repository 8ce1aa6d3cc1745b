"""Ranks that make different ring calls (issue 15.5), on the first call or a later one (issue 34.6), get the same
clear ValueError on every rank before any ring transfer: the check runs on every call (one all-gather of one
digest). The pool's time-out (45 s) is below gloo's (60 s), so a ring that hangs fails its test."""

from __future__ import annotations

import dataclasses
import re
import time

import pytest
import torch
import torch.distributed as dist

from mtraining.ops import Documents, PatternConfig
from mtraining.parallel import make_layout, ring_attention
from mtraining.parallel.estimate import estimate_pattern_cp
from tests.distributed import ProcessPool
from tests.factories import make_pattern
from tests.rings import CONFIGS, G

N, B, HQ, HKV, D = 128, 1, 4, 2, 16
NL = 96  # later calls and mixed calls: a multiple of W * G for 2 and 3 ranks


@pytest.fixture(scope="module")
def pool():
    """The gloo pool with a time-out below gloo's own: a hanging ring fails the test instead of waiting for gloo."""
    p = ProcessPool(timeout=45)
    yield p
    p.close()


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


def collectives_case(group) -> list[int]:
    """Worker: the all-gathers of each call. A ring call with a given pattern has no other collective."""
    calls = []
    gather = dist.all_gather

    def counting(*args, **kwargs):
        calls.append(1)
        return gather(*args, **kwargs)

    seen = []
    dist.all_gather = counting
    try:
        for change in (dict(pattern="sinks"), dict(pattern="sinks"), dict(pattern="sinks", n=2 * N)):
            calls.clear()
            ring_call(group, change, everywhere=True)
            seen.append(len(calls))
    finally:
        dist.all_gather = gather
    return seen


def test_the_check_runs_on_every_call(pool):
    assert pool.run(collectives_case, 2) == [[1, 1, 1]] * 2  # one all-gather of one digest per call


# --------------------------------------------------------------------------- later calls that differ
# (case, what the last rank changes in its second call, the field the message names)
LATER = [
    ("dtype", dict(dtype=torch.float32), r"dtype: rank 0 'torch.float64', .*rank {last} 'torch.float32'"),
    ("length", dict(n=2 * NL), r"q shape: rank 0 \(1, \d+, 4, 16\), .*rank {last} \(1, \d+, 4, 16\)"),
    (
        "pattern budget",
        dict(config="wider"),
        r"pattern_config: rank 0 PatternConfig\(v_size=16.*rank {last} .*v_size=24",
    ),
    (
        "documents",
        dict(documents=[NL // 4, 3 * NL // 4]),
        r"documents: rank 0 '[0-9a-f]{{16}}', .*rank {last} '[0-9a-f]",
    ),
    ("no documents", dict(documents=None), r"documents: rank 0 '[0-9a-f]{{16}}', .*rank {last} None"),
]


def later_call_case(group, change: dict) -> list:
    """Worker: two ring calls with packed documents (estimating the pattern), the second changed by ``change``
    on the group's last rank, then a third equal on every rank. Returns (the second call's error, seconds it
    took, whether the third call ran)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    configs = {**CONFIGS, "wider": dataclasses.replace(CONFIGS["topk"], v_size=24)}

    def call(args: dict):
        n = args.get("n", NL)
        layout = make_layout("striped", n, world, G)
        lengths = args.get("documents", [NL // 2, NL // 2])
        documents = None if lengths is None else Documents.from_lengths([*lengths[:-1], lengths[-1] + n - NL])
        dtype = args.get("dtype", torch.float64)
        q, k, v = (torch.randn(B, n // world, h, D, dtype=dtype, requires_grad=True) for h in (HQ, HKV, HKV))
        out = ring_attention(
            q,
            k,
            v,
            group,
            layout,
            pattern_config=configs[args.get("config", "topk")],
            backend="torch",
            documents=documents,
        )
        out.sum().backward()

    call({})
    start = time.monotonic()
    try:
        call(change if rank == world - 1 else {})
        error = "no error"
    except ValueError as e:
        error = str(e)
    took = time.monotonic() - start
    call({})
    return [error, took, True]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case,change,message", LATER, ids=[c[0] for c in LATER])
def test_a_later_call_that_differs_fails_on_every_rank(pool, world, case, change, message):
    """Issue 34.6: ranks that agreed on a call and then change it on one rank get the clear error on every
    rank at once (the pool's time-out, below gloo's, fails a hang), and the ring works again after it."""
    got = pool.run(later_call_case, world, change)
    errors = {r[0] for r in got}
    assert len(errors) == 1, errors  # the same message on every rank
    error = errors.pop()
    assert re.search(rf"the {world} ranks disagree on the ring_attention call \(", error), error
    assert re.search(message.format(last=world - 1), error), error
    assert all(r[1] < 20 and r[2] for r in got), got


def mixed_calls_case(group) -> str:
    """Worker: the last rank estimates a pattern while the others run the ring."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = make_layout("striped", NL, world, G)
    q, k = (torch.randn(B, NL // world, h, D, dtype=torch.float64) for h in (HQ, HKV))
    try:
        if rank == world - 1:
            estimate_pattern_cp(q, k, CONFIGS["topk"], group, layout)
        else:
            ring_attention(q, k, k, group, layout, backend="torch")
    except ValueError as e:
        return str(e)
    return "no error"


def test_ranks_in_different_calls_fail_clearly(pool):
    got = pool.run(mixed_calls_case, 3)
    assert len(set(got)) == 1, got
    assert re.search(r"rank 0 ring_attention, rank 1 ring_attention, rank 2 estimate_pattern_cp", got[0]), got[0]


def test_without_a_process_group_names_the_fix():
    """Issue 34.8: a ring call with no process group initialised is a ValueError, not a TypeError."""
    assert not dist.is_initialized()
    layout = make_layout("striped", N, 2, G)
    q = torch.randn(B, N // 2, HQ, D, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"ring_attention is collective .*init_process_group"):
        ring_attention(q, q[:, :, :HKV], q[:, :, :HKV], None, layout)
    with pytest.raises(ValueError, match=r"estimate_pattern_cp is collective .*init_process_group"):
        estimate_pattern_cp(q, q[:, :, :HKV], CONFIGS["topk"], None, layout)

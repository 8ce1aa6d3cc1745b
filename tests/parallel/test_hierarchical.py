"""Hierarchical ring attention on gloo ranks against the float64 oracle and the flat ring."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from mtraining.parallel import make_layout, ring_attention
from mtraining.parallel.topology import ring_groups
from tests.factories import make_pattern
from tests.rings import LAYOUTS, SEQ, TOL, G, assert_gathered_close, check_ring, make_inputs, reference, ring_case


def hier(inner_size, **more):
    """ring_attention arguments of the hierarchical ring with ``inner_size`` ranks per node."""
    return dict(ring="hierarchical", inner_size=inner_size, **more)


@pytest.mark.slow
@pytest.mark.parametrize("inner", [2, 1, 4])  # 2 nodes x 2, 4 nodes x 1, 1 node x 4 (the flat ring)
@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("kind", ["causal", "random", "topk"])
def test_hierarchical_float64_matches_oracle(pool, inner, layout_name, kind):
    ref = check_ring(pool, 4, layout_name, kind, seed=inner, ring=hier(inner))
    if kind == "random":
        assert torch.isneginf(ref[1]).any()  # rows that see no key are exercised


@pytest.mark.parametrize("world,inner", [(2, 1), (3, 1)])  # subgroups [1, 3] and [0, 1, 2] of the 4 workers
def test_hierarchical_on_subgroups(pool, world, inner):
    check_ring(pool, world, "striped", "local_sinks", seed=world, b=2, hq=6, hkv=2, ring=hier(inner))


def test_hierarchical_float32_sparse_estimated(pool):
    check_ring(pool, 4, "striped", "threshold", dtype=torch.float32, seed=5, ring=hier(2))


@pytest.mark.parametrize("layout_name,kind", [("striped", "local_sinks"), ("zigzag", "causal")])
def test_hierarchical_equals_flat(pool, layout_name, kind):
    n, b, hq = SEQ[4], 1, 4
    inputs = make_inputs(9, b, n, hq, 2, torch.float32)
    pattern = make_pattern(kind, b, hq, n, G, 9)
    two_level = pool.run(ring_case, 4, layout_name, inputs, pattern, None, hier(2))
    flat = pool.run(ring_case, 4, layout_name, inputs, pattern)
    for h, f in zip(two_level, flat):
        for x, y in zip(h, f):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def topology_case(group, inner):
    groups = ring_groups(group, inner)
    t = groups.topology
    sizes = tuple(dist.get_world_size(g) if g is not None else 1 for g in (groups.inner, groups.outer))
    return t.node, t.local_rank, sizes, ring_groups(group, inner) == groups


def test_ring_groups_on_gloo(pool):
    got = pool.run(topology_case, 4, 2)
    assert [r[:2] for r in got] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r[2] == (2, 2) and r[3] for r in got)
    assert [r[2] for r in pool.run(topology_case, 4, 4)] == [(4, 1)] * 4
    assert [r[2] for r in pool.run(topology_case, 4, 1)] == [(1, 4)] * 4


def error_case(group, kwargs, env=None):
    import os

    world = dist.get_world_size(group)
    n = 128
    layout = make_layout("striped", n, world, G)
    q, k, v = (torch.zeros(1, n // world, h, 16, dtype=torch.float64) for h in (4, 2, 2))
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    if env is not None:
        os.environ["LOCAL_WORLD_SIZE"] = env
    try:
        ring_attention(q, k, v, group, layout, backend="torch", **kwargs)
    except ValueError as e:
        return str(e)
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    return "no error"


@pytest.mark.parametrize(
    "kwargs,env,message",
    [
        ({"ring": "hierarchical", "inner_size": 3}, None, r"inner_size 3 does not divide .* world size 4.*\[1, 2, 4\]"),
        ({"ring": "hierarchical"}, None, "LOCAL_WORLD_SIZE.*or pass inner_size="),
        ({"ring": "hierarchical"}, "3", r"inner_size 3 does not divide"),
        ({"ring": "tree"}, None, "ring must be 'flat', 'hierarchical' or 'allgather'"),
        ({"inner_size": 2}, None, "needs ring='hierarchical'"),
    ],
)
def test_hierarchical_errors_name_the_fix(pool, kwargs, env, message):
    for got in pool.run(error_case, 4, kwargs, env):
        assert re.search(message, got), got


def env_case(group):
    import os

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        return ring_groups(group).topology.inner_size
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE")


def test_inner_size_from_torchrun_env(pool):
    assert pool.run(env_case, 4) == [2] * 4


# ----------------------------------------------------------------------------- six ranks: 3 x 2 and 2 x 3
SIX_CASES = [(2, "striped", "local_sinks"), (3, "zigzag", "random"), (2, "contiguous", "causal")]


def _six_worker(rank: int, store_path: str, cases, inputs, patterns, out_dir: str) -> None:
    import datetime
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, 6), rank=rank, world_size=6, timeout=datetime.timedelta(seconds=60)
    )
    results = [
        tuple(t.clone() for t in ring_case(None, layout_name, inputs, pattern, None, hier(inner)))
        for (inner, layout_name, _), pattern in zip(cases, patterns)
    ]
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_hierarchical_six_ranks_three_nodes_and_two_nodes(tmp_path):
    n, b, hq, hkv = 384, 1, 4, 2  # a multiple of 2 * 6 * G
    inputs = make_inputs(21, b, n, hq, hkv, torch.float64)
    patterns = [make_pattern(kind, b, hq, n, G, 21) for _, _, kind in SIX_CASES]
    torch.multiprocessing.spawn(
        _six_worker, args=(str(tmp_path / "store"), SIX_CASES, inputs, patterns, str(tmp_path)), nprocs=6
    )
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(6)]
    for c, ((inner, layout_name, kind), pattern) in enumerate(zip(SIX_CASES, patterns)):
        ref = reference(inputs, pattern)
        where = f" (6 ranks, inner {inner}, {layout_name}, {kind})"
        assert_gathered_close([results[r][c] for r in range(6)], layout_name, ref, TOL[torch.float64], where)


def reuse_case(group, inputs, pattern, ring):
    """Worker: a ring call, then the same call with reuse=(out, lse): no forward pass, the same gradients."""
    args = dict(ring=ring, inner_size=2 if ring == "hierarchical" else None)
    first = ring_case(group, "striped", inputs, pattern, ring=args)
    again = ring_case(group, "striped", inputs, pattern, ring=args | {"reuse": first[:2]})
    return all(torch.equal(a, b) for a, b in zip(first[2:], again[2:]))


@pytest.mark.parametrize("ring", ["flat", "hierarchical"])
def test_ring_reuse_gives_the_same_gradients(pool, ring):
    n = SEQ[4]
    inputs = make_inputs(3, 1, n, 4, 2, torch.float64)
    assert all(pool.run(reuse_case, 4, inputs, make_pattern("local_sinks", 1, 4, n, G, 3), ring))

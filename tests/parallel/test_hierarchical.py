"""Hierarchical ring attention on gloo ranks against the float64 oracle and the flat ring; emulation."""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist

from mtraining.parallel import emulation, make_layout, ring_attention
from mtraining.parallel.ring.hierarchical import hierarchical_ring_attention
from mtraining.parallel.topology import ring_groups
from tests.parallel.test_ring import CONFIGS, SEQ, TOL, G, assert_close, make_inputs, make_pattern, reference

LAYOUTS = ["contiguous", "zigzag", "striped"]


def hier_case(group, layout_name, inputs, pattern, inner_size, config=None, ring="hierarchical", link=None):
    """Worker: shard the full inputs, run the ring forward and backward, return this rank's results."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    q, k, v, dout = inputs
    layout = make_layout(layout_name, q.shape[1], world, G)
    ql, kl, vl = (layout.shard(t, rank).requires_grad_() for t in (q, k, v))
    kwargs = dict(pattern=pattern, pattern_config=config, return_lse=True, backend="torch")
    if link is not None:
        out, lse = hierarchical_ring_attention(
            ql, kl, vl, group, layout, inner_size=inner_size, outer_link=link, **kwargs
        )
    else:
        out, lse = ring_attention(ql, kl, vl, group, layout, ring=ring, inner_size=inner_size, **kwargs)
    out.backward(layout.shard(dout, rank))
    return out.detach(), lse, ql.grad, kl.grad, vl.grad


def check_hier(pool, world, inner, layout_name, kind, dtype=torch.float64, seed=0, b=1, hq=4, hkv=2):
    n = SEQ[world]
    config = CONFIGS.get(kind)
    pattern = None if config else make_pattern(kind, b, hq, n, seed)
    inputs = make_inputs(seed, b, n, hq, hkv, dtype, rope=config is not None)
    results = pool.run(hier_case, world, layout_name, inputs, pattern, inner, config)
    layout = make_layout(layout_name, n, world, G)
    ref = reference(inputs, pattern, config)
    for i, name in enumerate(["out", "lse", "dq", "dk", "dv"]):
        got = layout.gather([r[i] for r in results], dim=2 if name == "lse" else 1)
        tol = 5e-5 if config is not None and dtype == torch.float32 else TOL[dtype]
        assert_close(f"{name} ({world} ranks, inner {inner})", got, ref[i], tol)
    return ref


@pytest.mark.parametrize("inner", [2, 1, 4])  # 2 nodes x 2, 4 nodes x 1, 1 node x 4 (the flat ring)
@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("kind", ["causal", "random", "topk"])
def test_hierarchical_float64_matches_oracle(pool, inner, layout_name, kind):
    ref = check_hier(pool, 4, inner, layout_name, kind, seed=inner)
    if kind == "random":
        assert torch.isneginf(ref[1]).any()  # rows that see no key are exercised


@pytest.mark.parametrize("world,inner", [(2, 1), (3, 1)])  # subgroups [1, 3] and [0, 1, 2] of the 4 workers
def test_hierarchical_on_subgroups(pool, world, inner):
    check_hier(pool, world, inner, "striped", "local_sinks", seed=world, b=2, hq=6, hkv=2)


def test_hierarchical_float32_sparse_estimated(pool):
    check_hier(pool, 4, 2, "striped", "threshold", dtype=torch.float32, seed=5)


@pytest.mark.parametrize("layout_name,kind", [("striped", "local_sinks"), ("zigzag", "causal")])
def test_hierarchical_equals_flat(pool, layout_name, kind):
    n, b, hq = SEQ[4], 1, 4
    inputs = make_inputs(9, b, n, hq, 2, torch.float32)
    pattern = make_pattern(kind, b, hq, n, 9)
    hier = pool.run(hier_case, 4, layout_name, inputs, pattern, 2)
    flat = pool.run(hier_case, 4, layout_name, inputs, pattern, None, None, "flat")
    for h, f in zip(hier, flat):
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
        ({"ring": "tree"}, None, "ring must be 'flat' or 'hierarchical'"),
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


# ----------------------------------------------------------------------------- emulation
def emulated_case(group, latency):
    """Worker: time of one outer-ring exchange with and without emulation (and the defaults)."""
    from mtraining.parallel.ring.attention import _ring_comm

    groups = ring_groups(group, 2)
    comm = _ring_comm(groups.outer, torch.device("cpu"))
    assert emulation.active_outer_link() is None and emulation.outer_link_label() == "real"
    buf = torch.ones(1000)
    times = []
    for c in (comm, emulation.EmulatedComm(comm, emulation.LinkModel(1e6, latency))):
        recv = torch.empty(1000)
        dist.barrier()
        t0 = time.perf_counter()
        c.start([buf], [recv]).wait()
        times.append(time.perf_counter() - t0)
        assert torch.equal(recv, buf)
    return times


def test_emulation_adds_the_modelled_delay(pool):
    latency = 0.1
    modelled = latency + 4000 / 1e6  # 4000 bytes at 1 MB/s
    for real, emulated in pool.run(emulated_case, 4, latency):
        assert emulated >= modelled - 1e-3
        assert emulated < modelled + 0.5 + real


def test_emulated_hierarchical_ring_is_exact_and_slower(pool):
    n, b, hq = SEQ[4], 1, 4
    inputs = make_inputs(3, b, n, hq, 2, torch.float64)
    pattern = make_pattern("sinks", b, hq, n, 3)
    link = emulation.LinkModel(1e12, 0.05)
    t0 = time.perf_counter()
    emulated = pool.run(hier_case, 4, "striped", inputs, pattern, 2, None, "hierarchical", link)
    slow = time.perf_counter() - t0
    plain = pool.run(hier_case, 4, "striped", inputs, pattern, 2)
    for e, p in zip(emulated, plain):
        for x, y in zip(e, p):
            assert torch.equal(x, y)
    # 2 nodes, each outer hop >= 50 ms: forward 1 K/V hop; backward 1 K/V hop overlapping the first
    # gradient hop, then the gradient hop home
    assert slow >= 3 * 0.05


def test_link_model_label_and_context():
    assert emulation.active_outer_link() is None
    with emulation.emulate_outer_link(25e9, 5e-6) as link:
        assert emulation.active_outer_link() is link
        assert emulation.outer_link_label() == "emulated 25 GB/s, 5 us"
        assert link.seconds(25e9) == pytest.approx(1 + 5e-6)
    assert emulation.outer_link_label() == "real"
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        emulation.LinkModel(0.0)


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
        tuple(t.clone() for t in hier_case(None, layout_name, inputs, pattern, inner))
        for (inner, layout_name, _), pattern in zip(cases, patterns)
    ]
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_hierarchical_six_ranks_three_nodes_and_two_nodes(tmp_path):
    n, b, hq, hkv = 384, 1, 4, 2  # a multiple of 2 * 6 * G
    inputs = make_inputs(21, b, n, hq, hkv, torch.float64)
    patterns = [make_pattern(kind, b, hq, n, 21) for _, _, kind in SIX_CASES]
    torch.multiprocessing.spawn(
        _six_worker, args=(str(tmp_path / "store"), SIX_CASES, inputs, patterns, str(tmp_path)), nprocs=6
    )
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(6)]
    for c, ((inner, layout_name, kind), pattern) in enumerate(zip(SIX_CASES, patterns)):
        layout = make_layout(layout_name, n, 6, G)
        ref = reference([t.clone() for t in inputs], pattern)  # float64 .double() is the same tensor: fresh grads
        for i, name in enumerate(["out", "lse", "dq", "dk", "dv"]):
            got = layout.gather([results[r][c][i] for r in range(6)], dim=2 if name == "lse" else 1)
            assert_close(f"{name} (6 ranks, inner {inner}, {layout_name}, {kind})", got, ref[i], TOL[torch.float64])


def reuse_case(group, inputs, pattern, ring):
    """Worker: a ring call, then the same call with reuse=(out, lse): no forward pass, the same gradients."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    q, k, v, dout = inputs
    layout = make_layout("striped", q.shape[1], world, G)
    grads = []
    reuse = None
    for _ in range(2):
        ql, kl, vl = (layout.shard(t, rank).requires_grad_() for t in (q, k, v))
        out, lse = ring_attention(
            ql,
            kl,
            vl,
            group,
            layout,
            pattern=pattern,
            return_lse=True,
            backend="torch",
            ring=ring,
            inner_size=2 if ring == "hierarchical" else None,
            reuse=reuse,
        )
        out.backward(layout.shard(dout, rank))
        grads.append((ql.grad, kl.grad, vl.grad))
        reuse = (out.detach(), lse)
    return all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("ring", ["flat", "hierarchical"])
def test_ring_reuse_gives_the_same_gradients(pool, ring):
    n = SEQ[4]
    inputs = make_inputs(3, 1, n, 4, 2, torch.float64)
    assert all(pool.run(reuse_case, 4, inputs, make_pattern("local_sinks", 1, 4, n, 3), ring))

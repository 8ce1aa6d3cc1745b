"""Ring attention on gloo ranks against the single-device float64 oracle, forward and backward."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from bench.links import emulated
from bench.synthetic import rope_structured_qkv
from mtraining.ops import PatternConfig, VerticalSlashPattern, estimate_pattern
from mtraining.parallel import make_layout, ring_attention
from mtraining.parallel.estimate import estimate_pattern_cp
from mtraining.parallel.ring_cost import Link
from tests.factories import make_pattern
from tests.numerics import rel_err
from tests.rings import CONFIGS, LAYOUTS, SEQ, G, check_ring, make_inputs, ring_case


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("kind", ["causal", "random", "sinks", "local_sinks", "topk"])
def test_ring_float64_matches_oracle(pool, world, layout_name, kind):
    ref = check_ring(pool, world, layout_name, kind, torch.float64, seed=world)
    if kind == "random":  # the case must exercise rows that see no key
        assert torch.isneginf(ref[1]).any()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("kind", ["causal", "random", "threshold"])
def test_ring_float32_matches_oracle(pool, world, layout_name, kind):
    check_ring(pool, world, layout_name, kind, torch.float32, seed=10 + world)


@pytest.mark.parametrize("hq,hkv", [(4, 1), (4, 4), (6, 2)])
def test_ring_gqa_ratios_batch_and_strided_inputs(pool, hq, hkv):
    check_ring(pool, 3, "striped", "local_sinks", torch.float64, b=2, hq=hq, hkv=hkv, seed=hq * hkv, strided=True)


@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_dense_pattern_ring_equals_dense_attention(pool, layout_name):
    n, world, seed = SEQ[4], 4, 7
    inputs = make_inputs(seed, 1, n, 4, 2, torch.float64)
    dense = pool.run(ring_case, world, layout_name, inputs, make_pattern("dense", 1, 4, n, G, 0))
    causal = pool.run(ring_case, world, layout_name, inputs, None)
    for a, c in zip(dense, causal):
        for x, y in zip(a, c):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    q, k, v, _ = inputs
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    layout = make_layout(layout_name, n, world, G)
    torch.testing.assert_close(layout.gather([r[0] for r in dense]), sdpa, rtol=1e-10, atol=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("layout_name,kind", [("zigzag", "causal"), ("striped", "random")])
def test_ring_triton_interpreter(pool, layout_name, kind):
    check_ring(pool, 2, layout_name, kind, torch.float32, seed=3, backend="triton", tol=2e-5, n=128)


def estimate_case(group, layout_name, q, k, config):
    """Worker: the distributed estimate from this rank's shards of the full q, k, as plain tensors."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = make_layout(layout_name, q.shape[1], world, G)
    p = estimate_pattern_cp(layout.shard(q, rank), layout.shard(k, rank), config, group, layout)
    return p.block_diags, p.num_diags, p.vertical_pos, p.num_verticals


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("config_name", ["topk", "threshold"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_distributed_estimate_equals_single_device(pool, world, layout_name, config_name, dtype):
    n, config = SEQ[world], CONFIGS[config_name]
    b, hq, hkv = 2, 4, 2
    q, k, _, _ = make_inputs(world, b, n, hq, hkv, dtype, rope=True)
    results = pool.run(estimate_case, world, layout_name, q, k, config)
    ref = estimate_pattern(q, k, config)
    expected = (ref.block_diags, ref.num_diags, ref.vertical_pos, ref.num_verticals)
    assert float(ref.density().mean()) < 0.8  # a real, sparse pattern
    for rank_result in results:
        for got, want in zip(rank_result, expected):
            assert torch.equal(got, want)


def error_case(group, case):
    """Worker: the ValueError message ring_attention raises for a bad call (before any communication)."""
    world = dist.get_world_size(group)
    n, b, hq, hkv = 128, 1, 4, 2
    layout = make_layout("striped", n, world, G)
    q, k, v = (torch.zeros(b, n // world, h, 16, dtype=torch.float64) for h in (hq, hkv, hkv))
    kwargs = {}
    if case == "world":
        layout = make_layout("striped", n, 2 * world, G)
    elif case == "length":
        q = q[:, :-1]
    elif case == "kv_length":
        k, v = k[:, 1:], v[:, 1:]
    elif case == "seq_len":
        kwargs["pattern"] = make_pattern("sinks", b, hq, 2 * n, G, 0)
    elif case == "block":
        kwargs["pattern"] = VerticalSlashPattern.dense(b, hq, n, 2 * G)
    elif case == "heads":
        kwargs["pattern"] = make_pattern("sinks", b, 2 * hq, n, G, 0)
    elif case == "both":
        kwargs.update(pattern=make_pattern("sinks", b, hq, n, G, 0), pattern_config=CONFIGS["topk"])
    elif case == "config_type":
        kwargs["pattern_config"] = {"v_size": 16}
    elif case == "config_block":
        kwargs["pattern_config"] = PatternConfig(v_size=16, s_size=16, last_q=16, block_size=2 * G, local_window=8)
    try:
        ring_attention(q, k, v, group, layout, backend="torch", **kwargs)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "case,message",
    [
        (
            "world",
            r"layout is for 4 ranks but the process group has 2; build it with make_layout\('striped', 128, 2, 16\)",
        ),
        ("length", "q holds 63 tokens per rank but the striped layout of seq_len 128 over 2 ranks gives 64"),
        ("kv_length", "k holds 63 tokens per rank"),
        ("seq_len", "pattern is for seq_len 256 but the layout for 128"),
        ("block", "pattern block_size 32 must divide the layout's block_size 16.*block_size=32"),
        ("heads", "pattern is for batch 1 x 8 heads, but q has batch 1 x 4 heads"),
        ("both", "pass either pattern .* or pattern_config"),
        ("config_type", "pattern_config must be a PatternConfig, got dict"),
        ("config_block", "pattern block_size 32 must divide the layout's block_size 16"),
    ],
)
def test_ring_errors_name_the_fix(pool, case, message):
    for got in pool.run(error_case, 2, case):
        assert re.search(message, got), got


# ----------------------------------------------------------------------------- NCCL on GPUs
def _nccl_worker(rank: int, world: int, store_path: str) -> None:
    """bf16 rings (flat, hierarchical) with the Triton kernels on NCCL vs the float32 torch backend."""
    from mtraining.ops.sparse import attention_backward, attention_delta, attention_forward

    torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    n, b, hq, hkv, d, g = 8192, 1, 8, 2, 64, 128
    config = PatternConfig(v_size=256, s_size=1024, last_q=64, block_size=g, sink_tokens=4, local_window=128)
    q, k, v = rope_structured_qkv(b, n, hq, hkv, d, dtype=torch.bfloat16, device="cuda", seed=5)
    dout = torch.randn(b, n, hq, d, generator=torch.Generator().manual_seed(6)).to("cuda", torch.bfloat16)
    pos = torch.arange(n, device="cuda", dtype=torch.int32)
    for name in LAYOUTS:
        layout = make_layout(name, n, world, g)
        shards = [layout.shard(t, rank) for t in (q, k, v)]
        for estimated in (False, True):
            pattern = estimate_pattern_cp(shards[0], shards[1], config, None, layout) if estimated else None
            if estimated:
                full = estimate_pattern(q, k, config)
                assert torch.equal(pattern.block_diags, full.block_diags), name
                assert torch.equal(pattern.vertical_pos, full.vertical_pos), name
            qf, kf, vf, df = (t.float() for t in (q, k, v, dout))
            ref_out, ref_lse = attention_forward(qf, kf, vf, pattern, pos, pos, d**-0.5, backend="torch")
            delta = attention_delta(df, ref_out)
            grads = attention_backward(df, qf, kf, vf, ref_lse, delta, pattern, pos, pos, d**-0.5, backend="torch")
            mine = layout.positions(rank).cuda()
            # flat; all-gather; hierarchical as world/2 "nodes" over a real link and over an emulated slow one
            rings = [dict(ring="flat"), dict(ring="allgather")]
            if world % 2 == 0:
                hier = dict(ring="hierarchical", inner_size=world // 2)
                rings += [hier, dict(hier, outer_comm=emulated(Link(25e9, 5e-6)))]
            for ring in rings:
                ql, kl, vl = (t.detach().clone().requires_grad_() for t in shards)
                where = f"{name} {ring}"
                out, lse = ring_attention(
                    ql, kl, vl, None, layout, pattern=pattern, return_lse=True, backend="triton", **ring
                )
                out.backward(layout.shard(dout, rank))
                assert rel_err(out, ref_out[:, mine]) < 1e-2, where
                assert (lse - ref_lse[:, :, mine]).abs().max().item() < 5e-2, where
                assert rel_err(ql.grad, grads[0][:, mine]) < 2e-2, where
                assert rel_err(kl.grad, grads[1][:, mine]) < 2e-2, where
                assert rel_err(vl.grad, grads[2][:, mine]) < 2e-2, where
    dist.destroy_process_group()


@pytest.mark.cuda(gpus=2)
def test_ring_nccl_bf16_matches_reference(tmp_path):
    world = min(torch.cuda.device_count(), 4)
    torch.multiprocessing.spawn(_nccl_worker, args=(world, str(tmp_path / "store")), nprocs=world)

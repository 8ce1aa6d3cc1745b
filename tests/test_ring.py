"""Ring attention on gloo ranks against the single-device float64 oracle, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import ProcessPool

from mtraining.ops import VerticalSlashPattern, attention_oracle
from mtraining.parallel import make_layout, ring_attention

LAYOUTS = ["contiguous", "zigzag", "striped"]
G, D = 16, 16
SEQ = {1: 256, 2: 256, 3: 192, 4: 256}  # multiples of 2 * W * G (zigzag)
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


@pytest.fixture(scope="module")
def pool():
    p = ProcessPool()
    yield p
    p.close()


def make_inputs(seed: int, b: int, n: int, hq: int, hkv: int, dtype: torch.dtype):
    """q, k, v, dout on the full sequence (identical in every process for one seed)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(b, n, hq, D), (b, n, hkv, D), (b, n, hkv, D), (b, n, hq, D)]
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


def make_pattern(kind: str, b: int, h: int, n: int, seed: int) -> VerticalSlashPattern | None:
    """Test patterns on the global grid; 'random' has rows that see no key at all."""
    gen = torch.Generator().manual_seed(seed + 1)
    nb = n // G
    diag = torch.zeros(b, h, nb, dtype=torch.bool)
    vert = torch.zeros(b, h, n, dtype=torch.bool)
    if kind == "causal":
        return None
    if kind == "dense":
        return VerticalSlashPattern.dense(b, h, n, G)
    if kind == "random":
        diag = torch.rand(b, h, nb, generator=gen) < 0.3
        diag[:, 0, 0] = False  # head 0: no local block, verticals only late -> empty early rows
        vert = torch.rand(b, h, n, generator=gen) < 0.05
        vert[:, 0, : n // 2] = False
    elif kind == "sinks":
        vert[..., :4] = True
    elif kind == "local_sinks":
        diag[..., :2] = True
        vert[..., :4] = True
        vert[..., n // 3] = True
    return VerticalSlashPattern.from_masks(diag, vert, G)


def ring_case(group, layout_name, n, b, hq, hkv, dtype, pattern, seed, backend="torch"):
    """Worker: shard the inputs, run the ring forward and backward, return this rank's results."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = make_layout(layout_name, n, world, G)
    q, k, v, dout = make_inputs(seed, b, n, hq, hkv, dtype)
    ql, kl, vl = (layout.shard(t, rank).requires_grad_() for t in (q, k, v))
    out, lse = ring_attention(ql, kl, vl, group, layout, pattern=pattern, return_lse=True, backend=backend)
    out.backward(layout.shard(dout, rank))
    return out.detach(), lse, ql.grad, kl.grad, vl.grad


def reference(n, b, hq, hkv, dtype, pattern, seed):
    """Oracle (out, lse, dq, dk, dv) in float64 on the full sequence."""
    q, k, v, dout = (t.double().requires_grad_() for t in make_inputs(seed, b, n, hq, hkv, dtype))
    out, lse = attention_oracle(q, k, v, pattern)
    out.backward(dout.detach())
    return out.detach(), lse, q.grad, k.grad, v.grad


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Max error relative to the reference's scale; -inf (rows with no key) must match exactly."""
    got, ref = got.double(), ref.double()
    ref_inf = torch.isneginf(ref)
    assert torch.equal(torch.isneginf(got), ref_inf), f"{name}: rows with no key must have lse -inf"
    assert not torch.isnan(got).any(), f"{name}: NaN"
    err = (got - ref)[~ref_inf].abs().max().item()
    scale = max(ref[~ref_inf].abs().max().item(), 1.0)
    assert err <= tol * scale, f"{name}: max error {err:.3e} > {tol:.0e} x {scale:.2f}"


def check_ring(pool, world, layout_name, kind, dtype, b=1, hq=4, hkv=2, seed=0, backend="torch", tol=None):
    n = SEQ[world]
    pattern = make_pattern(kind, b, hq, n, seed)
    results = pool.run(ring_case, world, layout_name, n, b, hq, hkv, dtype, pattern, seed, backend)
    layout = make_layout(layout_name, n, world, G)
    ref = reference(n, b, hq, hkv, dtype, pattern, seed)
    for i, name in enumerate(["out", "lse", "dq", "dk", "dv"]):
        got = layout.gather([r[i] for r in results], dim=2 if name == "lse" else 1)
        assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32 if name == "lse" else dtype)
        assert_close(name, got, ref[i], tol or TOL[dtype])
    return ref


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("kind", ["causal", "random", "sinks", "local_sinks"])
def test_ring_float64_matches_oracle(pool, world, layout_name, kind):
    ref = check_ring(pool, world, layout_name, kind, torch.float64, seed=world)
    if kind == "random":  # the case must exercise rows that see no key
        assert torch.isneginf(ref[1]).any()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("kind", ["causal", "random"])
def test_ring_float32_matches_oracle(pool, world, layout_name, kind):
    check_ring(pool, world, layout_name, kind, torch.float32, seed=10 + world)


@pytest.mark.parametrize("hq,hkv", [(4, 1), (4, 4), (6, 2)])
def test_ring_gqa_ratios_and_batch(pool, hq, hkv):
    check_ring(pool, 3, "striped", "local_sinks", torch.float64, b=2, hq=hq, hkv=hkv, seed=hq * hkv)


@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_dense_pattern_ring_equals_dense_attention(pool, layout_name):
    n, world, seed = SEQ[4], 4, 7
    dense = pool.run(ring_case, world, layout_name, n, 1, 4, 2, torch.float64, make_pattern("dense", 1, 4, n, 0), seed)
    causal = pool.run(ring_case, world, layout_name, n, 1, 4, 2, torch.float64, None, seed)
    for a, c in zip(dense, causal):
        for x, y in zip(a, c):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    q, k, v, _ = make_inputs(seed, 1, n, 4, 2, torch.float64)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    layout = make_layout(layout_name, n, world, G)
    torch.testing.assert_close(layout.gather([r[0] for r in dense]), sdpa, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("layout_name,kind", [("zigzag", "causal"), ("striped", "random")])
def test_ring_triton_interpreter(pool, layout_name, kind):
    check_ring(pool, 2, layout_name, kind, torch.float32, seed=3, backend="triton", tol=2e-5)

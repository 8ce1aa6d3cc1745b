"""Triton kernels (under TRITON_INTERPRET=1 on the CPU) against the float64 oracle, fwd and bwd."""

from __future__ import annotations

import pytest
import torch

from mtraining.ops import VerticalSlashPattern, attention_oracle
from mtraining.ops.sparse import attention_backward, attention_delta, attention_forward, sparse_attention
from tests.factories import make_pattern, make_qkv, striped_positions
from tests.numerics import assert_close, rel_err

CPU_TOL = {torch.float32: 2e-5, torch.float16: 3e-3}


def check_against_oracle(q, k, v, pattern, q_pos=None, k_pos=None, gen=None):
    tol = CPU_TOL[q.dtype]
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out_ref, lse_ref = attention_oracle(q64, k64, v64, pattern, q_pos, k_pos)
    grad = torch.randn(out_ref.shape, generator=gen, dtype=torch.float64)
    refs = torch.autograd.grad(out_ref, (q64, k64, v64), grad)
    out, lse = sparse_attention(q, k, v, pattern, q_pos, k_pos, return_lse=True, backend="triton")
    grads = torch.autograd.grad(out, (q, k, v), grad.to(q.dtype))
    assert not torch.isnan(out).any()
    assert rel_err(out, out_ref) < tol
    assert_close("lse", lse, lse_ref, 50 * tol)
    for name, got, ref in zip("qkv", grads, refs):
        assert not torch.isnan(got).any(), f"d{name} has unwritten (NaN) entries"
        assert rel_err(got, ref) < 2 * tol, f"d{name}"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "seq,block,heads,head_dim,kind",
    [
        (64, 16, (2, 1), 16, "random"),
        (77, 16, (4, 2), 16, "random"),
        (100, 32, (2, 2), 32, "local_plus_verticals"),
        (96, 32, (4, 1), 16, "dense"),
        (70, 16, (2, 1), 16, "sinks"),
        (64, 16, (2, 2), 16, "empty_rows"),
        (83, 16, (2, 1), 16, "causal"),
        (64, 16, (2, 1), 64, "random"),
    ],
)
def test_kernel_matches_oracle(dtype, seq, block, heads, head_dim, kind):
    gen = torch.Generator().manual_seed(seq * 131 + block + head_dim)
    hq, hkv = heads
    q, k, v, _ = make_qkv(2, seq, seq, hq, hkv, head_dim, dtype, gen)
    pattern = make_pattern(kind, 2, hq, seq, block, gen)
    check_against_oracle(q, k, v, pattern, gen=gen)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("q_rank,k_rank", [(1, 0), (0, 1), (2, 2), (3, 1)])
def test_ring_step_offsets(dtype, q_rank, k_rank):
    """A query chunk against a key chunk from another rank of a striped layout (a ring step)."""
    gen = torch.Generator().manual_seed(7 + q_rank * 10 + k_rank)
    n, g, world = 256, 16, 4
    q_pos, k_pos = striped_positions(n, g, world, q_rank), striped_positions(n, g, world, k_rank)
    pattern = make_pattern("random", 1, 4, n, g, gen)
    q, k, v, _ = make_qkv(1, q_pos.numel(), k_pos.numel(), 4, 2, 16, dtype, gen)
    check_against_oracle(q, k, v, pattern, q_pos, k_pos, gen)


def test_backward_primitive_with_external_lse():
    """attention_backward on one key chunk, with the full row's lse/delta, equals the torch backend."""
    gen = torch.Generator().manual_seed(3)
    n, g = 128, 16
    pattern = make_pattern("random", 1, 2, n, g, gen)
    q, k, v, _ = make_qkv(1, n, n, 2, 1, 16, torch.float32, gen)
    pos = torch.arange(n)
    out, lse = attention_forward(q.double(), k.double(), v.double(), pattern, pos, pos, 0.25, backend="torch")
    do = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    delta = attention_delta(do, out)
    k_pos = pos[32:96]
    args = (q, k[:, 32:96], v[:, 32:96], lse.float(), delta.float(), pattern, pos, k_pos, 0.25)
    got = attention_backward(do.float(), *args, backend="triton")
    ref = attention_backward(
        do,
        q.double(),
        k[:, 32:96].double(),
        v[:, 32:96].double(),
        lse,
        delta,
        pattern,
        pos,
        k_pos,
        0.25,
        backend="torch",
    )
    for a, b in zip(got, ref):
        assert rel_err(a, b) < 2e-5


def test_dense_pattern_equals_dense_attention():
    gen = torch.Generator().manual_seed(11)
    q, k, v, _ = make_qkv(1, 96, 96, 4, 2, 32, torch.float32, gen)
    dense = sparse_attention(q, k, v, VerticalSlashPattern.dense(1, 4, 96, 32), backend="triton")
    causal = sparse_attention(q, k, v, None, backend="triton")
    ref, _ = attention_oracle(q.double(), k.double(), v.double())
    assert rel_err(dense, ref) < 2e-5 and rel_err(causal, ref) < 2e-5


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(q=torch.randn(1, 8, 2, 16)[0]), "4 dims"),
        (dict(k=torch.randn(1, 32, 3, 16), v=torch.randn(1, 32, 3, 16)), "multiple of key/value heads"),
        (dict(q=torch.randn(1, 32, 2, 24), k=torch.randn(1, 32, 1, 24), v=torch.randn(1, 32, 1, 24)), "head_dim 24"),
        (dict(q=torch.randn(1, 32, 2, 16).double()), "share a dtype"),
        (dict(q_pos=torch.arange(1, 33)), "runs of 16"),
        (dict(q_pos=torch.cat([torch.arange(16, 32), torch.arange(16)])), "ascending runs of 16"),
        (dict(k_pos=torch.arange(31)), "k_pos must be 1-D with 32"),
    ],
)
def test_bad_input_names_the_fix(kwargs, match):
    args = dict(q=torch.randn(1, 32, 2, 16), k=torch.randn(1, 32, 1, 16), v=torch.randn(1, 32, 1, 16))
    args.update(kwargs)
    pattern = VerticalSlashPattern.dense(1, 2, 32, 16)
    with pytest.raises(ValueError, match=match):
        sparse_attention(
            args["q"], args["k"], args["v"], pattern, args.get("q_pos"), args.get("k_pos"), backend="triton"
        )


def test_pattern_for_other_heads_rejected():
    q, k, v = torch.randn(1, 32, 4, 16), torch.randn(1, 32, 2, 16), torch.randn(1, 32, 2, 16)
    with pytest.raises(ValueError, match="pattern is for batch 1 x 2 heads"):
        sparse_attention(q, k, v, VerticalSlashPattern.dense(1, 2, 32, 16), backend="triton")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_dq_backward_matches_oracle(monkeypatch, dtype):
    """The backward variant that adds dQ atomically inside the dK/dV kernels."""
    from mtraining.ops.sparse import launch as tb

    def fused_config(block_size, head_dim, device, dtype):
        t = min(block_size, 32)
        plain = tb.Tiles(t, t, t, 4, 1)
        return tb.TileConfig(plain, plain, tb.Tiles(t, t, t, 4, 1, dq_mode="atomic"))

    monkeypatch.setattr(tb, "tile_config", fused_config)
    gen = torch.Generator().manual_seed(5)
    q, k, v, _ = make_qkv(2, 77, 77, 4, 2, 16, dtype, gen)
    check_against_oracle(q, k, v, make_pattern("random", 2, 4, 77, 16, gen), gen=gen)
    n, g, world = 256, 16, 4
    q_pos, k_pos = striped_positions(n, g, world, 2), striped_positions(n, g, world, 1)
    q, k, v, _ = make_qkv(1, q_pos.numel(), k_pos.numel(), 4, 2, 16, dtype, gen)
    check_against_oracle(q, k, v, make_pattern("local_plus_verticals", 1, 4, n, g, gen), q_pos, k_pos, gen)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tiles_smaller_than_the_block(monkeypatch, dtype):
    """Kernel tiles of 16 and 32 inside G = 64 blocks (each tile walks its block's list in steps),
    different per kernel, with a partial last block and a striped ring step."""
    from mtraining.ops.sparse import launch as tb

    def small_tiles(block_size, head_dim, device, dtype):
        return tb.TileConfig(
            tb.Tiles(32, 16, 16, 4, 1), tb.Tiles(16, 32, 32, 4, 1), tb.Tiles(16, 32, 16, 4, 1, v_split=3)
        )

    monkeypatch.setattr(tb, "tile_config", small_tiles)
    gen = torch.Generator().manual_seed(23)
    q, k, v, _ = make_qkv(1, 230, 230, 4, 2, 16, dtype, gen)
    check_against_oracle(q, k, v, make_pattern("random", 1, 4, 230, 64, gen), gen=gen)
    n, g, world = 512, 64, 2
    q_pos, k_pos = striped_positions(n, g, world, 1), striped_positions(n, g, world, 0)
    q, k, v, _ = make_qkv(1, q_pos.numel(), k_pos.numel(), 4, 2, 16, dtype, gen)
    check_against_oracle(q, k, v, make_pattern("local_plus_verticals", 1, 4, n, g, gen), q_pos, k_pos, gen)


def test_strided_inputs_and_expanded_gradient():
    """A gradient with stride 0 (that of out.sum()) and inputs whose head_dim is not contiguous."""
    gen = torch.Generator().manual_seed(11)
    base = torch.randn(1, 16, 64, 2 + 1 + 1, generator=gen)  # [B, D, S, heads]: head_dim strided
    q = base[..., :2].permute(0, 2, 3, 1).detach().requires_grad_()
    k = base[..., 2:3].permute(0, 2, 3, 1).detach().requires_grad_()
    v = base[..., 3:].permute(0, 2, 3, 1).detach().requires_grad_()
    assert q.stride(-1) != 1
    out = sparse_attention(q, k, v, backend="triton")
    out.sum().backward()
    ref, _ = attention_oracle(q.double(), k.double(), v.double())
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    assert (out.double() - ref).abs().max() < 1e-5
    for got, want in zip((q.grad, k.grad, v.grad), ref_grads):
        assert (got.double() - want).abs().max() < 1e-4


def test_row_delta_kernel_matches_torch():
    """The one-pass Triton delta (used on CUDA) against the float64 rowsum, with strided inputs."""
    from mtraining.ops.sparse.launch import row_delta as one_pass

    gen = torch.Generator().manual_seed(12)
    do = torch.randn(2, 37, 3, 16, generator=gen)
    out = torch.randn(2, 3, 37, 16, generator=gen).transpose(1, 2)  # not contiguous
    want = (do.double() * out.double()).sum(-1).transpose(1, 2)
    assert (one_pass(do, out).double() - want).abs().max() < 1e-5


def test_keys_at_unaligned_addresses():
    """Key tiles are read through tensor descriptors, which need 16-byte aligned bases and strides:
    keys and values that start 4 bytes into their storage must still give the oracle's answer."""
    gen = torch.Generator().manual_seed(13)
    n, h, d = 80, 2, 16
    q = torch.randn(1, n, h, d, generator=gen)
    storage = torch.randn(2 * n * h * d + 1, generator=gen, requires_grad=True)
    k, v = (storage[1 + i * n * h * d : 1 + (i + 1) * n * h * d].view(1, n, h, d) for i in range(2))
    assert k.data_ptr() % 16 and v.data_ptr() % 16
    pattern = make_pattern("local_plus_verticals", 1, h, n, 16, gen)
    out = sparse_attention(q, k, v, pattern, backend="triton")
    ref, _ = attention_oracle(q.double(), k.double(), v.double(), pattern)
    grad = torch.randn(out.shape, generator=gen)
    (got,) = torch.autograd.grad(out, storage, grad)
    (want,) = torch.autograd.grad(ref, storage, grad.double())
    assert (out.double() - ref).abs().max() < 1e-5
    assert (got.double() - want).abs().max() < 1e-4


@pytest.mark.parametrize("pattern_kind", ["local_plus_verticals", "causal"])
def test_reuse_skips_the_forward_and_gives_the_same_gradients(monkeypatch, pattern_kind):
    """sparse_attention(reuse=(out, lse)) runs no forward kernel and backpropagates exactly as the call it reuses."""
    import mtraining.ops.sparse.attention as attention

    gen = torch.Generator().manual_seed(14)
    q, k, v, _ = make_qkv(1, 48, 48, 4, 2, 16, torch.float32, gen)
    pattern = make_pattern(pattern_kind, 1, 4, 48, 16, gen)
    grad = torch.randn(q.shape, generator=gen)
    first = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = sparse_attention(*first, pattern, return_lse=True, backend="triton")
    out.backward(grad)
    calls = []
    monkeypatch.setattr(attention, "attention_forward", lambda *a, **kw: calls.append(1))
    again = [t.clone().requires_grad_() for t in (q, k, v)]
    out2 = sparse_attention(*again, pattern, backend="triton", reuse=(out.detach(), lse))
    out2.backward(grad)
    assert not calls and torch.equal(out2, out)
    for a, b in zip(first, again):
        assert torch.equal(a.grad, b.grad)
    with pytest.raises(ValueError, match="return_lse=True"):
        sparse_attention(q, k, v, pattern, backend="triton", reuse=(out.detach(), lse[:, :2]))

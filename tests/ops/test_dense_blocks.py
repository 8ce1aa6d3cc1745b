"""Dense blocks (ops/dense/): the decomposition covers exactly the causal pairs, and forward,
merge and backward through per-block attention equal the float64 oracle, alone and inside the rings."""

from __future__ import annotations

import pytest
import torch

from mtraining.ops import Documents, attention_oracle, sparse_attention
from mtraining.ops.dense import (
    CUDNN,
    ENV_VAR,
    MAX_BLOCKS,
    REFERENCE,
    Block,
    cudnn,
    decompose,
    dense_backend,
    dense_setting,
    select_ops,
)
from mtraining.ops.dense import blocks as blocks_module
from mtraining.ops.sparse.attention import default_document_blocks, document_blocks
from mtraining.parallel import make_layout
from tests.factories import make_qkv
from tests.numerics import assert_close
from tests.rings import LAYOUTS, OUTPUTS, SEQ, G, check_ring, dense_ring_in_one_process, reference


def pair_count(blocks, sq: int, sk: int) -> torch.Tensor:
    """How many times the blocks compute each (query row, key row) pair."""
    count = torch.zeros(sq, sk, dtype=torch.int32)
    for b in blocks:
        assert 0 <= b.q0 < b.q1 <= sq and 0 <= b.k0 < b.k1 <= sk, b
        ones = torch.ones(b.q1 - b.q0, b.k1 - b.k0, dtype=torch.int32)
        if b.causal:
            assert b.q1 - b.q0 == b.k1 - b.k0, b
            ones = torch.tril(ones)
        count[b.q0 : b.q1, b.k0 : b.k1] += ones
    return count


def assert_exact_cover(q_pos, k_pos, blocks) -> None:
    count = pair_count(blocks, len(q_pos), len(k_pos))
    assert count.numel() == 0 or int(count.max()) <= 1, "a pair is computed twice"
    assert torch.equal(count.bool(), k_pos[None, :] <= q_pos[:, None]), "pairs differ from k_pos <= q_pos"


@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_decomposition_covers_causal_pairs_every_step(layout_name, world):
    for n in (SEQ[world], 4 * SEQ[world]):
        layout = make_layout(layout_name, n, world, G)
        for rank in range(world):
            for step in range(world):
                src = (rank - step) % world
                q_pos, k_pos = layout.positions(rank), layout.positions(src)
                blocks = decompose(q_pos, k_pos, max_blocks=None)
                assert_exact_cover(q_pos, k_pos, blocks)
                if step == 0:  # the shard against itself: one causal block
                    assert blocks == (Block(0, len(q_pos), 0, len(k_pos), True),)
                elif layout_name != "striped" or world == 1:
                    assert len(blocks) <= 1, blocks  # contiguous/zigzag: one call per step (or none)
                limited = decompose(q_pos, k_pos)
                assert limited == (blocks if len(blocks) <= MAX_BLOCKS else None)


def test_zigzag_steps_are_half_of_q_or_half_of_k():
    world, n = 4, 512
    layout = make_layout("zigzag", n, world, G)
    half = n // world // 2
    for rank in range(world):
        for step in range(1, world):
            src = (rank - step) % world
            (b,) = decompose(layout.positions(rank), layout.positions(src))
            assert not b.causal
            if src < rank:
                assert (b.q0, b.q1, b.k0, b.k1) == (0, 2 * half, 0, half)
            else:
                assert (b.q0, b.q1, b.k0, b.k1) == (half, 2 * half, 0, 2 * half)


def test_decomposition_of_single_device_and_arbitrary_positions():
    # last Sq of Sk keys: a full block and a causal block
    assert decompose(torch.arange(10, 20), torch.arange(20)) == (
        Block(0, 10, 0, 10, False),
        Block(0, 10, 10, 20, True),
    )
    assert decompose(torch.arange(5), torch.arange(5, 9)) == ()  # no key visible
    assert decompose(torch.tensor([3, 2]), torch.arange(4)) is None  # not increasing
    assert decompose(torch.tensor([1, 1]), torch.arange(4)) is None
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):  # random increasing position sets made of runs, partially overlapping
        picks = [
            torch.sort(torch.randperm(64, generator=gen)[: int(torch.randint(1, 40, (1,), generator=gen))])[0]
            for _ in range(2)
        ]
        blocks = decompose(picks[0], picks[1], max_blocks=None)
        assert_exact_cover(picks[0], picks[1], blocks)


@pytest.mark.slow
@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("hq,hkv", [(4, 2), (6, 1), (2, 2)])
def test_ring_steps_through_blocks_equal_oracle(layout_name, hq, hkv):
    """One process plays a whole ring: every step through the blocks, merged by LSE; backward with the
    merged out/lse per step; out, lse, dq, dk, dv equal the oracle on the full sequence."""
    world, n, b, d = 3, 192, 2, 16
    q, k, v, dout = make_qkv(b, n, n, hq, hkv, d, torch.float64, hq * 10 + hkv)
    ref = reference([q, k, v, dout], None)
    layout = make_layout(layout_name, n, world, G)
    got = dense_ring_in_one_process(REFERENCE, layout, q, k, v, dout, d**-0.5, torch.float64)
    for i, name in enumerate(OUTPUTS):
        assert_close(name, got[i], ref[i], 1e-10)


@pytest.mark.parametrize("sq,sk", [(48, 48), (32, 80), (16, 16)])
def test_single_device_dense_through_blocks_equals_oracle(sq, sk):
    q, k, v, dout = make_qkv(2, sq, sk, 6, 2, 16, torch.float64, sq + sk)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with dense_backend("reference"):
        out, lse = sparse_attention(*leaves, return_lse=True, backend="torch")
    out.backward(dout)
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention_oracle(*refs)
    ref_out.backward(dout)
    assert_close("out", out.detach(), ref_out.detach(), 1e-10)
    assert_close("lse", lse, ref_lse, 1e-10)
    for name, a, r in zip(["dq", "dk", "dv"], leaves, refs):
        assert_close(name, a.grad, r.grad, 1e-10)


def test_default_document_blocks_are_the_positional_ones_built_once_on_the_host(monkeypatch):
    """One device, default positions: the documents' blocks equal ``document_blocks`` of the positions, are built
    once per documents and shape, and a forward through them reads no positions on the host (every layer of an
    evaluation prefill would repeat that read: under a busy host, seconds at 64K)."""
    gen = torch.Generator().manual_seed(1)
    for sq, sk in [(40, 40), (24, 64), (64, 64)]:
        cuts = sorted(set(torch.randint(1, sk, (3,), generator=gen).tolist()))
        documents = Documents([[0, *cuts]], sk)
        built = default_document_blocks(documents, sq, sk)
        assert built == document_blocks(documents, torch.arange(sk - sq, sk), torch.arange(sk))
        assert default_document_blocks(documents, sq, sk) is built
    q, k, v, dout = make_qkv(1, 48, 48, 4, 2, 16, torch.float64, 3)
    documents = Documents([[0, 20, 33]], 48)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def no_host_read(pos):
        raise AssertionError("positions read on the host")

    monkeypatch.setattr(blocks_module, "_runs", no_host_read)
    with dense_backend("reference"):
        out = sparse_attention(*leaves, backend="torch", documents=documents)
    out.backward(dout)
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attention_oracle(*refs, documents=documents)[0]
    ref.backward(dout)
    assert_close("out", out.detach(), ref.detach(), 1e-10)
    for name, a, r in zip(["dq", "dk", "dv"], leaves, refs):
        assert_close(name, a.grad, r.grad, 1e-10)


def test_dense_backend_setting(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    q = torch.zeros(1, 4, 2, 16)
    assert dense_setting() == "auto"
    assert select_ops(q, q, "torch") is None  # CPU: the backend's own dense path
    monkeypatch.setenv(ENV_VAR, "cudnn")
    with pytest.raises(ValueError, match="MTRAINING_DENSE_BACKEND=cudnn cannot run these inputs .*inputs on cpu"):
        select_ops(q, q, "torch")
    with dense_backend("triton"):
        assert select_ops(q, q, "torch") is None
        with dense_backend("reference"):
            assert select_ops(q, q, "torch") is REFERENCE
        assert dense_setting() == "triton"
    monkeypatch.setenv(ENV_VAR, "bogus")
    with pytest.raises(ValueError, match="dense backend must be one of"):
        dense_setting()


# ----------------------------------------------------------------------------- the cuDNN wrapper, on a fake op
def _fake_cudnn_forward(q, k, v, attn_bias, compute_lse, dropout_p, is_causal, debug, *, scale):
    """The aten op's contract in plain PyTorch: [B, H, S, D] in, lse [B, H, Sq, 1]; no GQA shapes."""
    assert attn_bias is None and compute_lse and dropout_p == 0.0 and not debug
    assert q.shape[1] == k.shape[1] == v.shape[1], "the dense cuDNN path is not given GQA shapes"
    out, lse = REFERENCE.forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal, scale)
    seed = torch.empty((), dtype=torch.int64)
    return out.transpose(1, 2), lse.unsqueeze(-1).float(), None, None, q.shape[2], k.shape[2], seed, seed, None


def _fake_cudnn_backward(
    do, q, k, v, out, lse, seed, offset, attn_bias, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, *, scale
):
    """Backward from the out/lse it is given (delta = rowsum(dO * O)), as cuDNN does; dense only."""
    assert cum_q is None and cum_k is None and attn_bias is None and dropout_p == 0.0
    assert lse.shape == (*q.shape[:3], 1) and (max_q, max_k) == (q.shape[2], k.shape[2])
    assert do.stride() == out.stride()
    grads = REFERENCE.backward(*(t.transpose(1, 2) for t in (do, q, k, v, out)), lse.squeeze(-1), is_causal, scale)
    return tuple(g.to(q.dtype).transpose(1, 2) for g in grads)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 4)])
def test_cudnn_wrapper_on_fake_op(monkeypatch, causal, hq, hkv):
    """Head expansion for GQA, dK/dV group sums, layouts and LSE shapes of the cuDNN wrapper."""
    fakes = {
        "_scaled_dot_product_cudnn_attention": _fake_cudnn_forward,
        "_scaled_dot_product_cudnn_attention_backward": _fake_cudnn_backward,
    }
    monkeypatch.setattr(cudnn, "_aten", fakes.__getitem__)
    sq, sk = 32, 32 if causal else 48
    q, k, v, do = make_qkv(2, sq, sk, hq, hkv, 16, torch.float64, hq + causal)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # heads-major q, as Hugging Face gives
    out, lse = CUDNN.forward(q, k, v, causal, 0.25)
    ref_out, ref_lse = REFERENCE.forward(q, k, v, causal, 0.25)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert_close("out", out, ref_out, 1e-10)
    assert_close("lse", lse, ref_lse, 1e-6)
    grads = CUDNN.backward(do, q, k, v, ref_out, ref_lse, causal, 0.25)
    for name, got, ref in zip(
        ["dq", "dk", "dv"], grads, REFERENCE.backward(do, q, k, v, ref_out, ref_lse, causal, 0.25)
    ):
        assert got.shape == ref.shape and got.dtype == torch.float32, name
        assert_close(name, got, ref, 1e-6)


# ----------------------------------------------------------------------------- rings on gloo
@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_dense_ring_through_blocks_matches_oracle(pool, world, layout_name):
    n = SEQ[world] if layout_name != "striped" else 2 * SEQ[world]  # striped: some steps exceed MAX_BLOCKS
    check_ring(pool, world, layout_name, "causal", seed=world + 20, n=n, dense="reference")


@pytest.mark.parametrize("layout_name", ["zigzag", "striped"])
def test_hierarchical_dense_ring_through_blocks_matches_oracle(pool, layout_name):
    ring = dict(ring="hierarchical", inner_size=2)
    check_ring(pool, 4, layout_name, "causal", b=2, seed=31, ring=ring, dense="reference")

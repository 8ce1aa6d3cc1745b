"""Dense blocks through cuDNN in bf16 on a GPU against the plain-PyTorch path in float32.

Run on a lent GPU: ``python -m pytest -q -m cuda tests/ops/test_dense_blocks_cuda.py`` (the 2-GPU ring
test needs 2 or more GPUs).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mtraining.ops.dense import CUDNN, REFERENCE, cudnn, dense_backend, select_ops
from mtraining.ops.sparse import attention_backward, attention_delta, attention_forward, sparse_attention
from mtraining.parallel import make_layout, ring_attention
from tests.numerics import rel_err
from tests.rings import dense_ring_in_one_process

pytestmark = pytest.mark.cuda


def randn(gen, *shape):
    return torch.randn(*shape, generator=gen).cuda()


def check_block(causal, hq, hkv, d, sq, sk, ops=CUDNN):
    gen = torch.Generator().manual_seed(hq * 100 + d + sq + causal)
    q, k, v, do = (
        randn(gen, 1, sq, hq, d),
        randn(gen, 1, sk, hkv, d),
        randn(gen, 1, sk, hkv, d),
        randn(gen, 1, sq, hq, d),
    )
    scale = d**-0.5
    ref_out, ref_lse = REFERENCE.forward(q, k, v, causal, scale)
    ref_grads = REFERENCE.backward(do, q, k, v, ref_out, ref_lse, causal, scale)
    qb, kb, vb, dob = (t.bfloat16() for t in (q, k, v, do))
    out, lse = ops.forward(qb, kb, vb, causal, scale)
    assert out.shape == (1, sq, hq, d) and lse.shape == (1, hq, sq) and lse.dtype == torch.float32
    assert rel_err(out, ref_out) < 1e-2
    assert (lse - ref_lse).abs().max().item() < 5e-2
    grads = ops.backward(dob, qb, kb, vb, out, lse, causal, scale)
    for got, ref, shape in zip(grads, ref_grads, [q.shape, k.shape, v.shape]):
        assert got.shape == shape and got.dtype == torch.float32
        assert not torch.isnan(got).any()
        assert rel_err(got, ref) < 2e-2


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4)])
def test_cudnn_block_matches_fp32(causal, head_dim, hq, hkv):
    check_block(causal, hq, hkv, head_dim, 2048, 2048 if causal else 3072)


def test_cudnn_native_gqa_probe(monkeypatch):
    """Does cuDNN's dense path take Hq != Hkv directly? (informs MTRAINING_CUDNN_NATIVE_GQA; skip if not)"""
    monkeypatch.setattr(cudnn, "NATIVE_GQA", True)
    try:
        check_block(True, 8, 2, 128, 1024, 1024)
    except RuntimeError as exc:
        pytest.skip(f"cuDNN refuses GQA shapes here: {str(exc)[:200]}")


@pytest.mark.parametrize("layout_name,world", [("zigzag", 4), ("contiguous", 2), ("striped", 2)])
def test_ring_steps_through_cudnn_blocks(layout_name, world):
    """One GPU plays a whole ring: each step's blocks through cuDNN, merged by LSE, backward with the merged
    out/lse (ring-step position offsets, GQA); against the float32 torch path on the full sequence."""
    n, hq, hkv, d, g = 8192, 8, 2, 128, 128
    gen = torch.Generator().manual_seed(world)
    q, k, v, do = randn(gen, 1, n, hq, d), randn(gen, 1, n, hkv, d), randn(gen, 1, n, hkv, d), randn(gen, 1, n, hq, d)
    scale = d**-0.5
    pos = torch.arange(n, device="cuda")
    ref_out, ref_lse = attention_forward(q, k, v, None, pos, pos, scale, backend="torch")
    ref = (
        ref_out,
        ref_lse,
        *attention_backward(do, q, k, v, ref_lse, attention_delta(do, ref_out), None, pos, pos, scale, backend="torch"),
    )
    layout = make_layout(layout_name, n, world, g)
    qb, kb, vb, dob = (t.bfloat16() for t in (q, k, v, do))
    got = dense_ring_in_one_process(CUDNN, layout, qb, kb, vb, dob, scale, torch.float32)
    assert rel_err(got[0], ref[0]) < 1e-2
    assert (got[1] - ref[1]).abs().max().item() < 5e-2
    for g_, r_ in zip(got[2:], ref[2:]):
        assert rel_err(g_, r_) < 2e-2


@pytest.mark.parametrize("sq,sk", [(8192, 8192), (4096, 8192), (8192 - 77, 8192 - 77)])
def test_sparse_attention_dense_goes_through_cudnn(sq, sk):
    gen = torch.Generator().manual_seed(sq)
    b, hq, hkv, d = 2, 8, 2, 128
    q, k, v, do = (
        randn(gen, b, sq, hq, d),
        randn(gen, b, sk, hkv, d),
        randn(gen, b, sk, hkv, d),
        randn(gen, b, sq, hq, d),
    )
    q_pos, k_pos = torch.arange(sk - sq, sk, device="cuda"), torch.arange(sk, device="cuda")
    scale = d**-0.5
    ref_out, ref_lse = attention_forward(q, k, v, None, q_pos, k_pos, scale, backend="torch")
    ref_grads = attention_backward(
        do, q, k, v, ref_lse, attention_delta(do, ref_out), None, q_pos, k_pos, scale, backend="torch"
    )
    qb, kb, vb = (t.bfloat16().requires_grad_() for t in (q, k, v))
    assert select_ops(qb, kb, "triton") is CUDNN
    with dense_backend("cudnn"):
        out, lse = sparse_attention(qb, kb, vb, return_lse=True)
    grads = torch.autograd.grad(out, (qb, kb, vb), do.bfloat16())
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref_out) < 1e-2
    assert (lse - ref_lse).abs().max().item() < 5e-2
    for got, ref in zip(grads, ref_grads):
        assert rel_err(got, ref) < 2e-2
    with dense_backend("triton"):  # the old path still agrees
        out_t = sparse_attention(qb.detach(), kb.detach(), vb.detach())
    assert rel_err(out_t, out) < 1e-2


# ----------------------------------------------------------------------------- NCCL, 2+ GPUs
def _nccl_dense_worker(rank: int, world: int, store_path: str) -> None:
    torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    n, b, hq, hkv, d, g = 16384, 1, 8, 2, 128, 128
    gen = torch.Generator().manual_seed(9)
    q, k, v, do = (torch.randn(b, n, h, d, generator=gen).cuda() for h in (hq, hkv, hkv, hq))
    pos = torch.arange(n, device="cuda")
    scale = d**-0.5
    ref_out, ref_lse = attention_forward(q, k, v, None, pos, pos, scale, backend="torch")
    ref_grads = attention_backward(
        do, q, k, v, ref_lse, attention_delta(do, ref_out), None, pos, pos, scale, backend="torch"
    )
    for name in ("zigzag", "contiguous", "striped"):
        layout = make_layout(name, n, world, g)
        mine = layout.positions(rank).cuda()
        for setting in ("cudnn", "triton"):
            ql, kl, vl = (layout.shard(t, rank).bfloat16().requires_grad_() for t in (q, k, v))
            with dense_backend(setting):
                out, lse = ring_attention(ql, kl, vl, None, layout, return_lse=True)
            out.backward(layout.shard(do, rank).bfloat16())
            tag = f"{name}/{setting}"
            assert rel_err(out, ref_out[:, mine]) < 1e-2, tag
            assert (lse - ref_lse[:, :, mine]).abs().max().item() < 5e-2, tag
            for got, ref in zip((ql.grad, kl.grad, vl.grad), ref_grads):
                assert rel_err(got, ref[:, mine]) < 2e-2, tag
    dist.destroy_process_group()


@pytest.mark.cuda(gpus=2)
def test_dense_ring_nccl_cudnn_and_triton_match_reference(tmp_path):
    world = min(torch.cuda.device_count(), 4)
    torch.multiprocessing.spawn(_nccl_dense_worker, args=(world, str(tmp_path / "store")), nprocs=world)

"""Kernels in bf16 on a GPU up to 32K tokens, against the plain-PyTorch backend in float32.

The torch backend is itself checked against the float64 oracle (tests/ops/test_kernels.py and the ring
tests), and is exact math in float32, so it is the reference at lengths the oracle cannot hold.
Run on a lent GPU: ``python -m pytest -q -m cuda``.
"""

from __future__ import annotations

import pytest
import torch

from mtraining.ops import Documents, VerticalSlashPattern
from mtraining.ops.sparse import attention_backward, attention_delta, attention_forward, sparse_attention
from tests.factories import make_documents, make_pattern
from tests.numerics import rel_err

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("seq", [4096 - 45, 16384, 32768 - 77])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_matches_fp32_reference(seq, head_dim, dq_mode):
    gen = torch.Generator().manual_seed(seq + head_dim)
    b, hq, hkv, g = 2 if seq < 8192 else 1, 4, 2, 128  # batch 2 with an odd length: dQ tiles straddle batches
    q = torch.randn(b, seq, hq, head_dim, generator=gen).cuda()
    k = torch.randn(b, seq, hkv, head_dim, generator=gen).cuda()
    v = torch.randn(b, seq, hkv, head_dim, generator=gen).cuda()
    pattern = make_pattern("local_far", b, hq, seq, g, gen, diags=8, verticals=256).to("cuda")
    _check_triton_bf16_against_torch_fp32(q, k, v, pattern, gen)


def _check_triton_bf16_against_torch_fp32(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: VerticalSlashPattern,
    gen: torch.Generator,
    documents: Documents | None = None,
) -> None:
    """sparse_attention on the Triton backend in bf16 (out, lse, dq, dk, dv) against the torch backend in
    float32 on the same float32 q, k, v [B, S, H, D], pattern and documents."""
    seq = q.shape[1]
    pos = torch.arange(seq, device="cuda", dtype=torch.int32)
    bound = documents.left_bounds(pos) if documents is not None else None
    scale = q.shape[-1] ** -0.5
    out_ref, lse_ref = attention_forward(q, k, v, pattern, pos, pos, scale, backend="torch", q_bound=bound)
    do = torch.randn(out_ref.shape, generator=gen).cuda()
    delta = attention_delta(do, out_ref)
    grads_ref = attention_backward(
        do, q, k, v, lse_ref, delta, pattern, pos, pos, scale, backend="torch", q_bound=bound
    )
    qb, kb, vb = (t.bfloat16().requires_grad_() for t in (q, k, v))
    out, lse = sparse_attention(qb, kb, vb, pattern, return_lse=True, backend="triton", documents=documents)
    grads = torch.autograd.grad(out, (qb, kb, vb), do.bfloat16())
    assert rel_err(out, out_ref) < 1e-2
    assert (lse - lse_ref).abs().max().item() < 5e-2
    for got, ref in zip(grads, grads_ref):
        assert not torch.isnan(got).any()
        assert rel_err(got, ref) < 2e-2


def test_dense_equals_cudnn_sdpa():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(0)
    b, s, hq, hkv, d = 1, 8192, 8, 2, 128
    q = torch.randn(b, s, hq, d, generator=gen).cuda().bfloat16()
    k = torch.randn(b, s, hkv, d, generator=gen).cuda().bfloat16()
    v = torch.randn(b, s, hkv, d, generator=gen).cuda().bfloat16()
    out = sparse_attention(q, k, v, VerticalSlashPattern.dense(b, hq, s, 128, device="cuda"))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2).repeat_interleave(4, 1),
            v.transpose(1, 2).repeat_interleave(4, 1),
            is_causal=True,
        ).transpose(1, 2)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("head_dim", [64, 128])
def test_float32_inputs_run_on_the_gpu(head_dim):
    """float32 q/k/v take smaller tiles (the half-precision tiles need more shared memory than a GPU has)."""
    gen = torch.Generator().manual_seed(head_dim)
    b, seq, hq, hkv, g = 1, 2048 + 33, 4, 2, 128
    q = torch.randn(b, seq, hq, head_dim, generator=gen).cuda()
    k = torch.randn(b, seq, hkv, head_dim, generator=gen).cuda()
    v = torch.randn(b, seq, hkv, head_dim, generator=gen).cuda()
    pattern = make_pattern("local_far", b, hq, seq, g, gen, diags=4, verticals=64).to("cuda")
    do = torch.randn(b, seq, hq, head_dim, generator=gen).cuda()
    results = []
    for backend in ("triton", "torch"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = sparse_attention(*leaves, pattern, backend=backend)
        results.append((out, *torch.autograd.grad(out, leaves, do)))
    for got, ref in zip(*results):
        assert not torch.isnan(got).any()
        assert rel_err(got, ref) < 1e-2  # the kernels' float32 products may run as TF32


@pytest.mark.parametrize("seq,batch", [(8192 - 45, 2), (32768, 1)])
def test_documents_bf16_match_fp32_reference(seq, batch, dq_mode):
    """Packed documents (mixed lengths, per-row boundaries, blocks straddling documents) through the
    Triton walk builders and kernels in bf16 against the torch backend in float32 with the same documents."""
    gen = torch.Generator().manual_seed(seq)
    hq, hkv, d, g = 4, 2, 128, 128
    q, k, v = (torch.randn(batch, seq, h, d, generator=gen).cuda() for h in (hq, hkv, hkv))
    pattern = make_pattern("local_far", batch, hq, seq, g, gen, diags=8, verticals=256).to("cuda")
    docs = make_documents("mixed", seq, g, gen, batch)
    _check_triton_bf16_against_torch_fp32(q, k, v, pattern, gen, docs)


def test_dense_with_documents_equals_sdpa_per_document():
    """No pattern: cuDNN blocks cut at document starts equal one cuDNN SDPA call per document."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(1)
    b, hq, hkv, d = 1, 8, 2, 128
    lengths = [1000, 3096, 37, 4059]
    s = sum(lengths)
    q, k, v = (torch.randn(b, s, h, d, generator=gen).cuda().bfloat16() for h in (hq, hkv, hkv))
    out = sparse_attention(q, k, v, None, documents=Documents.from_lengths(lengths))
    start, refs = 0, []
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for n in lengths:
            qh, kh, vh = (t[:, start : start + n].transpose(1, 2) for t in (q, k, v))
            kh, vh = (t.repeat_interleave(hq // hkv, 1) for t in (kh, vh))
            refs.append(torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(1, 2))
            start += n
    assert rel_err(out, torch.cat(refs, 1)) < 1e-2


def random_block_columns(b: int, h: int, seq: int, g: int, per_block: int, gen: torch.Generator) -> torch.Tensor:
    """int64 [b, h, num_blocks, per_block] on CUDA: per query block r, random distinct columns < r * g
    (padding >= seq where fewer exist)."""
    nb = -(-seq // g)
    scores = torch.rand(b, h, nb, seq, generator=gen).cuda()
    before = torch.arange(seq, device="cuda")[None, :] < (torch.arange(nb, device="cuda") * g)[:, None]
    top = scores.masked_fill(~before, -1.0).topk(per_block, dim=-1)
    return torch.where(top.values >= 0, top.indices, seq)


@pytest.mark.parametrize("seq,batch,documents", [(8192 - 45, 2, False), (32768, 1, False), (16384, 1, True)])
def test_block_columns_bf16_match_fp32_reference(seq, batch, documents, dq_mode):
    """Per-block columns (512 per 128-row block) on top of lines: the column stage of the forward and dQ
    kernels and the column dK/dV kernel in bf16 against the torch backend in float32."""
    gen = torch.Generator().manual_seed(seq + documents)
    hq, hkv, d, g = 4, 2, 128, 128
    q, k, v = (torch.randn(batch, seq, h, d, generator=gen).cuda() for h in (hq, hkv, hkv))
    lines = make_pattern("local_far", batch, hq, seq, g, gen, diags=8, verticals=256).to("cuda")
    pattern = lines.with_block_columns(random_block_columns(batch, hq, seq, g, 512, gen))
    assert float(pattern.density().mean()) > float(lines.density().mean()) + 0.01
    docs = make_documents("mixed", seq, g, gen, batch) if documents else None
    _check_triton_bf16_against_torch_fp32(q, k, v, pattern, gen, docs)


@pytest.mark.parametrize("scorer,seq", [("dense", 4096), ("sorted", 4096), ("sorted", 16384)])
@pytest.mark.parametrize("documents", [False, True])
def test_column_scorer_matches_the_reference_on_cuda(documents, scorer, seq):
    """The Triton column scorers (dense, sorted) in bf16 pick the torch reference's columns (float32 scores of
    the same bf16 inputs; the rows' LSE from the bf16 sparse forward) at G = 128, GQA; at 16K the sorted
    kernel runs its 64-row tiles."""
    from mtraining.ops.estimate.block_columns import select_block_columns

    gen = torch.Generator().manual_seed(11 + documents)
    b, hq, hkv, d, g = 1, 4, 2, 64, 128
    q, k = (torch.randn(b, seq, h, d, generator=gen).cuda().bfloat16() for h in (hq, hkv))
    lines = make_pattern("local_far", b, hq, seq, g, gen, diags=4, verticals=64).to("cuda")
    docs = make_documents("mixed", seq, g, gen, b) if documents else None
    picks = [
        select_block_columns(q, k, lines, 256, d**-0.5, documents=docs, scorer=how, backend=backend)
        for how, backend in (("dense", "torch"), (scorer, "triton"))
    ]
    chosen = [torch.zeros(*p.shape[:-1], seq + 1, device="cuda").scatter_(-1, p.long(), 1.0)[..., :seq] for p in picks]
    assert chosen[0].sum() > 1000  # the case ranks many keys
    assert (chosen[0] * chosen[1]).sum() / chosen[0].sum() > 0.98  # near-ties at the cut may differ by rounding

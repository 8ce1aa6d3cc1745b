"""The chunked cross-entropy equals the plain one (value and gradients); the LR schedule's shape."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mtraining.train.loss import IGNORE_INDEX, linear_cross_entropy, token_scores
from mtraining.train.optim import lr_at


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_cross_entropy_matches_full_logits(chunk):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(61, 24, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(97, 24, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = torch.randint(0, 97, (61,), generator=gen)
    labels[[0, 5, 60]] = IGNORE_INDEX
    loss = linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk)
    (3.0 * loss).backward()
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    ref = F.cross_entropy(h2 @ w2.T, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    (3.0 * ref).backward()
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(hidden.grad, h2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(weight.grad, w2.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_token_scores_are_the_loss_per_token_and_the_argmax(chunk):
    """Evaluation's per-token losses: the plain CE of each row (0 where ignored), float32 from float32; and
    each row's greedy next token."""
    gen = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(61, 24, generator=gen), torch.randn(97, 24, generator=gen)
    labels = torch.randint(0, 97, (61,), generator=gen)
    labels[[0, 5, 60]] = IGNORE_INDEX
    got, greedy = token_scores(hidden, weight, labels, chunk_tokens=chunk)
    logits = hidden.double() @ weight.double().T
    ref = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
    assert torch.equal(greedy, logits.argmax(-1))
    assert got.dtype == torch.float32 and got.shape == (61,)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    assert got[[0, 5, 60]].eq(0).all()
    torch.testing.assert_close(got.sum(), linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk))
    with pytest.raises(ValueError, match="labels must lie in"):
        token_scores(hidden, weight, labels.clamp(min=0) + 97)


@pytest.mark.cuda
def test_chunked_cross_entropy_half_precision_on_gpu():
    """bf16 on CUDA (tensor-core products with float32 results) against float64 on the same values."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(3000, 256, device="cuda", generator=gen).bfloat16().requires_grad_()
    weight = (0.1 * torch.randn(5000, 256, device="cuda", generator=gen)).bfloat16().requires_grad_()
    labels = torch.randint(0, 5000, (3000,), device="cuda", generator=gen)
    loss = linear_cross_entropy(hidden, weight, labels, chunk_tokens=1024)
    loss.backward()
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    ref = F.cross_entropy(h64 @ w64.T, labels, reduction="sum")
    ref.backward()

    def rel(got, want):
        return ((got.double() - want).norm() / want.norm()).item()

    assert loss.dtype == torch.float32 and rel(loss, ref) < 1e-5
    assert rel(hidden.grad, h64.grad) < 1e-2 and rel(weight.grad, w64.grad) < 1e-2


def test_chunked_cross_entropy_without_grad_and_bad_input():
    hidden, weight = torch.randn(5, 4), torch.randn(9, 4)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, torch.arange(5))
    torch.testing.assert_close(loss, F.cross_entropy(hidden @ weight.T, torch.arange(5), reduction="sum"))
    with pytest.raises(ValueError, match="labels \\[tokens\\]"):
        linear_cross_entropy(hidden, weight, torch.arange(4))
    with pytest.raises(ValueError, match="'chunked' or 'liger'"):
        linear_cross_entropy(hidden, weight, torch.arange(5), impl="fused")


def test_warmup_then_cosine_to_the_floor():
    lrs = [lr_at(s, 1.0, 4, 20, 0.1) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    assert math.isclose(lr_at(20, 1.0, 4, 20, 0.1), 0.1) and lrs[-1] > 0.1
    assert lr_at(0, 2.0, 0, 10, 0.0) == 2.0


@pytest.mark.parametrize("vocab", [97, 5000])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, None])
def test_cross_entropy_rows_kernel_matches_float64(vocab, grad_dtype):
    """The Triton rows kernel (interpreted on the CPU) against float64 cross-entropy; 5000 columns
    take two tiles of the online log-sum-exp."""
    from mtraining.train.ce_kernel import cross_entropy_rows

    gen = torch.Generator().manual_seed(vocab)
    logits = 4.0 * torch.randn(23, vocab, dtype=torch.float64, generator=gen)
    logits[3, 17] = 40.0  # one dominant logit: the online max must rescale the running sum
    labels = torch.randint(0, vocab, (23,), generator=gen)
    labels[[0, 9]] = IGNORE_INDEX
    labels[3] = 17
    loss, grad = cross_entropy_rows(logits.float(), labels, IGNORE_INDEX, grad_dtype)
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
    ref.sum().backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    assert loss[0] == 0 and loss[9] == 0
    if grad_dtype is None:
        assert grad is None
        return
    assert grad.dtype == grad_dtype
    tol = 1e-3 if grad_dtype == torch.float16 else 1e-6
    torch.testing.assert_close(grad.double(), ref_logits.grad, rtol=tol, atol=tol)
    assert not grad[[0, 9]].any()


def test_labels_outside_the_vocabulary_are_refused():
    hidden, weight = torch.randn(5, 4), torch.randn(9, 4)
    with pytest.raises(ValueError, match="tokenizer matches"):
        linear_cross_entropy(hidden, weight, torch.tensor([0, 1, 9, 2, 3]))
    with pytest.raises(ValueError, match="tokenizer matches"):
        linear_cross_entropy(hidden, weight, torch.tensor([0, 1, -2, 2, 3]))

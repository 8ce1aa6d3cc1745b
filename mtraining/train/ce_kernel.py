"""Cross-entropy rows of a logits chunk in one Triton kernel: per-row loss and softmax-minus-onehot.

The chunked loss (loss.py) holds float32 logits [T, V] of a few thousand tokens at a time. In
plain PyTorch their log-sum-exp, softmax, one-hot subtraction, masking and cast each make a pass
over the 2.5 GB chunk (T=4096, V=151936). This kernel makes two: one read for the row's
log-sum-exp (online max and sum), one read that writes the gradient in the head's dtype.
One program per row; rows whose label is the ignore index get loss 0 and a zero gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _cross_entropy_rows_kernel(
    logits_ptr,
    labels_ptr,
    loss_ptr,
    grad_ptr,
    vocab,
    logits_stride,
    grad_stride,
    ignore_index,
    BLOCK: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_logits = logits_ptr + row * logits_stride
    cols = tl.arange(0, BLOCK)
    top = tl.max(tl.load(row_logits + cols, mask=cols < vocab, other=-float("inf")), axis=0)
    total = tl.zeros((), dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        x = tl.load(row_logits + start + cols, mask=start + cols < vocab, other=-float("inf"))
        new_top = tl.maximum(top, tl.max(x, axis=0))
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top), axis=0)
        top = new_top
    lse = top + tl.log(total)
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    target = tl.where(valid, label, 0)
    picked = tl.load(row_logits + target)
    tl.store(loss_ptr + row, tl.where(valid, lse - picked, 0.0))
    if WRITE_GRAD:
        row_grad = grad_ptr + row * grad_stride
        keep = tl.where(valid, 1.0, 0.0)
        for start in range(0, vocab, BLOCK):
            c = start + cols
            x = tl.load(row_logits + c, mask=c < vocab, other=-float("inf"))
            g = tl.exp(x - lse) - tl.where(c == target, 1.0, 0.0)
            tl.store(row_grad + c, (g * keep).to(grad_ptr.dtype.element_ty), mask=c < vocab)


def cross_entropy_rows(
    logits: Tensor, labels: Tensor, ignore_index: int, grad_dtype: torch.dtype | None
) -> tuple[Tensor, Tensor | None]:
    """Per-row loss (logz - logit of the label, float32 [T]) and, if grad_dtype is given, the gradient
    of their sum w.r.t. the logits (softmax - onehot, [T, V] in grad_dtype); ignored rows give zeros.

    logits: float32 [T, V] with unit column stride; labels: integer [T] in [0, V) or ignore_index.
    """
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(
            f"logits must be float32 [tokens, vocab] with unit column stride, got {logits.dtype} {tuple(logits.shape)}"
        )
    if labels.shape != logits.shape[:1] or labels.is_floating_point():
        raise ValueError(f"labels must be integer [tokens={logits.shape[0]}], got {labels.dtype} {tuple(labels.shape)}")
    rows, vocab = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    grad = None if grad_dtype is None else torch.empty(rows, vocab, dtype=grad_dtype, device=logits.device)
    if rows:
        _cross_entropy_rows_kernel[(rows,)](
            logits,
            labels,
            loss,
            loss if grad is None else grad,
            vocab,
            logits.stride(0),
            0 if grad is None else grad.stride(0),
            ignore_index,
            BLOCK=min(4096, triton.next_power_of_2(vocab)),
            WRITE_GRAD=grad is not None,
            num_warps=8,
        )
    return loss, grad

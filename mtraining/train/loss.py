"""Next-token cross-entropy that never holds the full-vocabulary logits of the whole sequence.

``linear_cross_entropy`` (training) multiplies hidden states by the LM head ``chunk_tokens`` rows at a
time, takes the log-softmax in float32 and computes the gradients of hidden states and head weight in
the same pass (so nothing of size tokens x vocab is kept for backward). On CUDA the per-chunk
softmax-minus-onehot is one Triton kernel (ce_kernel.py); liger-kernel's fused loss can be used
instead when it is installed (train.loss_impl=liger). ``token_scores`` (evaluation) is the same
loss per token, without gradients, with each token's greedy prediction.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops.numerics import acc_dtype, matmul_acc
from .ce_kernel import cross_entropy_rows

IGNORE_INDEX = -100


def _rows_loss_and_grad(
    logits: Tensor, labels: Tensor, grad_dtype: torch.dtype | None, kernel: bool | None = None
) -> tuple[Tensor, Tensor | None]:
    """Per-row CE of float logits [T, V] and the gradient of their sum (softmax - onehot) in grad_dtype.

    CUDA float32 logits go through one Triton kernel (ce_kernel.py: two passes over the chunk
    instead of about ten); other devices and dtypes (float64 on the CPU) use the same formula in
    PyTorch. Ignored rows give zeros. ``kernel`` forces one path (bench/loss.py compares them).
    """
    if kernel is None:
        kernel = logits.is_cuda and logits.dtype == torch.float32
    if kernel:
        return cross_entropy_rows(logits, labels, IGNORE_INDEX, grad_dtype)
    valid = labels != IGNORE_INDEX
    target = labels.clamp(min=0)
    logz = torch.logsumexp(logits, dim=-1)
    row_loss = torch.where(valid, logz - logits.gather(-1, target[:, None])[:, 0], 0.0)
    if grad_dtype is None:
        return row_loss, None
    grad = logits.sub_(logz[:, None]).exp_()  # the chunk's logits are not needed again
    grad[torch.arange(len(labels), device=labels.device), target] -= 1.0
    grad *= valid[:, None]
    return row_loss, grad.to(grad_dtype)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum over rows of CE(hidden @ weight.T, labels); gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk: int) -> Tensor:
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        acc = acc_dtype(hidden)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden) if need_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_grad else None
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            h = hidden[rows]
            row_loss, dlogits = _rows_loss_and_grad(
                matmul_acc(h, weight.T), labels[rows], weight.dtype if need_grad else None
            )
            total += row_loss.sum()
            if need_grad:
                grad_hidden[rows] = (dlogits @ weight).to(hidden.dtype)
                grad_weight += matmul_acc(dlogits.T, h)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_out.to(grad_hidden.dtype), (grad_weight * grad_out).to(ctx.weight_dtype), None, None


def _check_labels(hidden: Tensor, weight: Tensor, labels: Tensor) -> None:
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden must be [tokens, hidden] with labels [tokens], got {tuple(hidden.shape)} and {tuple(labels.shape)}"
        )
    out_of_range = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= weight.shape[0]))
    if bool(out_of_range.any()):
        raise ValueError(
            f"labels must lie in [0, vocab={weight.shape[0]}) or be {IGNORE_INDEX} (ignored): "
            "check that the tokenizer matches the model's vocabulary"
        )


def linear_cross_entropy(
    hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int = 4096, impl: str = "chunked"
) -> Tensor:
    """Summed next-token CE (float32 scalar; float64 for float64 inputs) of hidden [T, H] through head weight [V, H] against labels [T].

    Labels equal to -100 are ignored. ``impl``: "chunked" (any device) or "liger" (CUDA, liger-kernel).
    """
    _check_labels(hidden, weight, labels)
    if impl == "liger":
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        except ImportError:
            raise ValueError("train.loss_impl=liger needs liger-kernel: pip install liger-kernel (CUDA only)") from None
        return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")(
            weight, hidden, labels
        ).float()
    if impl != "chunked":
        raise ValueError(f"loss implementation must be 'chunked' or 'liger', got {impl!r}")
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, chunk_tokens)


@torch.no_grad()
def token_scores(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int = 4096) -> tuple[Tensor, Tensor]:
    """Next-token CE of each row (float32 [T]; float64 for float64 inputs; 0 where the label is -100) of
    hidden [T, H] through head weight [V, H] against labels [T], and each row's greedy next token (int64
    [T], the argmax of its logits), ``chunk_tokens`` rows of logits at a time."""
    _check_labels(hidden, weight, labels)
    losses, greedy = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        logits = matmul_acc(hidden[start : start + chunk_tokens], weight.T)
        greedy.append(logits.argmax(-1))  # before the row loss, whose kernel may reuse the chunk
        losses.append(_rows_loss_and_grad(logits, labels[start : start + chunk_tokens], None)[0])
    return torch.cat(losses), torch.cat(greedy)


class CausalLMLoss(nn.Module):
    """A HF causal LM whose forward returns the summed token loss of its (local) tokens.

    The LM head is applied inside the chunked loss, so under FSDP2 this wrapper is the root module
    that owns the embeddings, final norm and head, and the decoder layers are sharded below it.
    """

    def __init__(self, model: nn.Module, chunk_tokens: int = 4096, impl: str = "chunked") -> None:
        super().__init__()
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.impl = impl

    @property
    def backbone(self) -> nn.Module:
        return getattr(self.model, self.model.base_model_prefix)

    def forward(self, input_ids: Tensor, labels: Tensor, position_ids: Tensor) -> Tensor:
        hidden = self.backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        weight = self.model.get_output_embeddings().weight
        return linear_cross_entropy(hidden.flatten(0, 1), weight, labels.flatten(), self.chunk_tokens, self.impl)

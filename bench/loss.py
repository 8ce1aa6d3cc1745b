"""LM-head cross-entropy on one GPU: the chunked loss with its Triton rows kernel vs the same loss with
PyTorch row ops, and liger-kernel's fused linear cross-entropy (when installed).

Times loss + backward of ``linear_cross_entropy`` (hidden [T, H] bf16 through the head [V, H]) with
CUDA events (median), and the per-chunk row step alone (loss and softmax-minus-onehot of float32
logits [chunk, V]), and each implementation's relative error against float64 on the first
``--accuracy-tokens`` tokens (loss, hidden and head gradients). Qwen2.5-3B's head by default
(H=2048, V=151936).

    python bench/loss.py --tokens 131072
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from pathlib import Path

import torch
from common import bench_ms, provenance, write_results

from mtraining.train import loss as loss_module


@contextlib.contextmanager
def rows_path(kernel: bool | None):
    """Force the chunked loss's row step onto the Triton kernel (True) or PyTorch (False); None: as is."""
    rows = loss_module._rows_loss_and_grad
    if kernel is not None:
        loss_module._rows_loss_and_grad = functools.partial(rows, kernel=kernel)
    try:
        yield
    finally:
        loss_module._rows_loss_and_grad = rows


def accuracy(hidden, weight, labels, tokens: int, chunk: int, impls: dict) -> dict:
    """Relative errors (norm of difference / norm) of loss and gradients against float64."""
    h, y = hidden[:tokens].detach(), labels[:tokens]
    h64, w64 = h.double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(h64 @ w64.T, y, reduction="sum")
    ref.backward()
    errors = {}
    for name, (impl, kernel) in impls.items():
        hb, wb = h.clone().requires_grad_(), weight.detach().clone().requires_grad_()
        with rows_path(kernel):
            loss = loss_module.linear_cross_entropy(hb, wb, y, chunk, impl)
            loss.backward()
        for key, got, want in (
            ("loss", loss, ref),
            ("grad_hidden", hb.grad, h64.grad),
            ("grad_weight", wb.grad, w64.grad),
        ):
            errors[f"rel_err_{name}_{key}"] = ((got.double() - want.detach()).norm() / want.detach().norm()).item()
    errors["accuracy_tokens"] = tokens
    return errors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--accuracy-tokens", type=int, default=8192)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, device="cuda", generator=gen).bfloat16().requires_grad_()
    weight = (0.02 * torch.randn(args.vocab, args.hidden, device="cuda", generator=gen)).bfloat16().requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), device="cuda", generator=gen)
    logits = torch.randn(args.chunk, args.vocab, device="cuda", generator=gen)
    rows = loss_module._rows_loss_and_grad
    record = dict(
        **provenance(),
        tokens=args.tokens,
        hidden=args.hidden,
        vocab=args.vocab,
        chunk=args.chunk,
    )
    for name, kernel in (("kernel", True), ("torch", False)):
        record[f"rows_{name}_ms"] = bench_ms(
            lambda: rows(logits.clone(), labels[: args.chunk], torch.bfloat16, kernel=kernel)
        )
    record["rows_clone_ms"] = bench_ms(
        lambda: logits.clone()
    )  # the torch path writes into its logits: each call clones

    def loss_step(impl: str) -> None:
        hidden.grad = weight.grad = None
        loss_module.linear_cross_entropy(hidden, weight, labels, args.chunk, impl).backward()

    impls = {"chunked_kernel": ("chunked", True), "chunked_torch": ("chunked", False)}
    try:
        import liger_kernel  # noqa: F401

        impls["liger"] = ("liger", None)
    except ImportError:
        print("liger-kernel is not installed: its loss is not timed")
    for name, (impl, kernel) in impls.items():
        with rows_path(kernel):
            loss_step(impl)
            torch.cuda.reset_peak_memory_stats()
            record[f"loss_{name}_ms"] = bench_ms(lambda: loss_step(impl), warmup_ms=500, rep_ms=3000)
            record[f"loss_{name}_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    record.update(accuracy(hidden, weight, labels, args.accuracy_tokens, args.chunk, impls))
    print({k: f"{v:.4g}" if isinstance(v, float) else v for k, v in record.items()})
    print(f"wrote {write_results('loss', [record], args.out)}")


if __name__ == "__main__":
    main()

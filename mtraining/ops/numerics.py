"""Numerics every attention path shares: the accumulation dtype, half-precision products with float32
results, the exact merge of partial attention results, the backward's row term, and non-finite keys.

Partial results: attention over disjoint key sets gives (out, lse) per set; ``merge_partial`` combines
them exactly (``lse = logaddexp(lse_a, lse_b)``, ``out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)``),
which is how ring steps, dense blocks and kernel launches over key chunks add up to the whole row.
"""

from __future__ import annotations

import torch
from torch import Tensor


def acc_dtype(x: Tensor | torch.dtype) -> torch.dtype:
    """Accumulation dtype of a tensor (or dtype): float64 for float64, else float32."""
    dtype = x if isinstance(x, torch.dtype) else x.dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


def matmul_acc(a: Tensor, b: Tensor) -> Tensor:
    """a @ b (2-D, or 3-D batched) in float32 (float64 for float64 inputs), a new tensor.

    Half-precision inputs on CUDA multiply on the tensor cores with a float32 result: their products
    are exact and they add in float32, as the float32 matmul of the upcast inputs would, without
    running as a SIMT SGEMM (the LM-head gradient of the loss is where that mattered).
    """
    if a.is_cuda and a.dtype in (torch.float16, torch.bfloat16):
        return (torch.bmm if a.dim() == 3 else torch.mm)(a, b.to(a.dtype), out_dtype=torch.float32)
    acc = acc_dtype(a)
    return a.to(acc) @ b.to(acc)


def merge_partial(out: Tensor, lse: Tensor, part_out: Tensor, part_lse: Tensor) -> None:
    """Merge a partial result over other keys into (out, lse), in place and exactly.

    Args:
        out: [B, S, H, D] (or a view), the result so far; updated in place.
        lse: [B, H, S] natural-log LSE of ``out``; updated in place.
        part_out, part_lse: the partial result over keys disjoint from those of ``out``.

    Rows that see no key on either side stay out 0, lse -inf; a NaN on either side stays NaN.
    """
    new = torch.logaddexp(lse, part_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    out.mul_(torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1))
    out.add_(part_out.to(out.dtype) * torch.exp(part_lse - safe).transpose(1, 2).unsqueeze(-1))
    lse.copy_(new)


def row_delta(do: Tensor, out: Tensor) -> Tensor:
    """delta [B, H, S] = rowsum(dO * O) in the accumulation dtype: the softmax backward's row term.

    Args:
        do: [B, S, H, D] gradient of the attention output.
        out: [B, S, H, D] the whole row's output (merged over every key of the row).

    Returns:
        [B, H, S] float32 (float64 for float64 ``out``), contiguous.
    """
    acc = acc_dtype(out)
    return (do.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()


def finite_keys(kh: Tensor, vh: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """Keys and values with every non-finite key zeroed, and where those keys are.

    A key is non-finite when its K or V row holds a NaN or an infinity. Attention must take nothing from
    a key a row may not see, but a product with 0 for a masked pair is NaN for such a key (0 x NaN), so
    the plain-PyTorch paths compute with zeroed keys (exact for every row that cannot see them) and set
    the score of every pair with a non-finite key to NaN (the rows that see one come out NaN).

    Args:
        kh, vh: [B, H, Sk, D] keys and values (heads already matched to the query heads).

    Returns:
        (kh, vh, bad): the inputs with non-finite keys zeroed, and bad [B, H, Sk] bool, or the inputs
        unchanged and None when every key is finite.
    """
    bad = ~(torch.isfinite(kh).all(-1) & torch.isfinite(vh).all(-1))
    if not bool(bad.any()):
        return kh, vh, None
    keep = ~bad[..., None]
    return kh.where(keep, 0.0), vh.where(keep, 0.0), bad


def mask_scores(scores: Tensor, allowed: Tensor, bad: Tensor | None) -> Tensor:
    """Scores [B, H, Sq, Sk], in place, with pairs outside ``allowed`` at -inf and pairs with a non-finite key
    (``finite_keys``; None: none) at NaN; returns ``scores``."""
    if bad is not None:
        scores.masked_fill_(bad[..., None, :], float("nan"))
    return scores.masked_fill_(~allowed, float("-inf"))

"""Matrix products with float32 results from half-precision inputs (estimation, recall, the loss)."""

from __future__ import annotations

import torch
from torch import Tensor


def acc_dtype(x: Tensor) -> torch.dtype:
    """Accumulation dtype: float64 for float64 inputs, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def matmul_acc(a: Tensor, b: Tensor) -> Tensor:
    """a @ b (2-D, or 3-D batched) in float32 (float64 for float64 inputs), a new tensor.

    Half-precision inputs on CUDA multiply on the tensor cores with a float32 result: their products
    are exact and they add in float32, as the float32 matmul of the upcast inputs would, without
    running as a SIMT SGEMM (which for the LM-head gradient of Qwen2.5-3B took 1.5 s of a 128K
    training step on an H200).
    """
    if a.is_cuda and a.dtype in (torch.float16, torch.bfloat16):
        return (torch.bmm if a.dim() == 3 else torch.mm)(a, b.to(a.dtype), out_dtype=torch.float32)
    acc = acc_dtype(a)
    return a.to(acc) @ b.to(acc)

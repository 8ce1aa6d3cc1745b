"""Per-block dense attention through cuDNN (``CUDNN``, a ``BlockOps``): the aten cuDNN ops, called directly.

Our Triton kernels are slower per pair than cuDNN, so dense blocks run here on CUDA in fp16/bf16.
K/V heads are expanded for the call only (cuDNN's dense path is not relied on for GQA shapes).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from .blocks import BlockOps

# cuDNN through aten (schema unchanged since torch 2.5; checked in cudnn_available):
#   _scaled_dot_product_cudnn_attention(query, key, value, attn_bias?, compute_log_sumexp, dropout_p=0.,
#       is_causal=False, return_debug_mask=False, *, scale=None)
#       -> (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug_attn_mask)
#   _scaled_dot_product_cudnn_attention_backward(grad_out, query, key, value, out, logsumexp, philox_seed,
#       philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None)
# Tensors are [B, H, S, D] (any strides with a unit last stride; ours are [B, S, H, D] transposed).
# logsumexp is float32, natural log, [B, H, Sq, 1] on recent torch ([B, H, Sq] on older ones). The
# backward treats an undefined cum_seq_q as dense (a defined one selects the varlen path), reads the
# sequence lengths from max_q/max_k, and computes delta from the out it is given.
_FWD_ARGS = [
    "query",
    "key",
    "value",
    "attn_bias",
    "compute_log_sumexp",
    "dropout_p",
    "is_causal",
    "return_debug_mask",
    "scale",
]
_BWD_ARGS = [
    "grad_out",
    "query",
    "key",
    "value",
    "out",
    "logsumexp",
    "philox_seed",
    "philox_offset",
    "attn_bias",
    "cum_seq_q",
    "cum_seq_k",
    "max_q",
    "max_k",
    "dropout_p",
    "is_causal",
    "scale",
]
# cuDNN's dense path is not relied on for Hq != Hkv: K/V heads are expanded for the call (only there;
# K/V travel the ring with their own heads) and dK/dV summed over each group. Set
# MTRAINING_CUDNN_NATIVE_GQA=1 to pass GQA shapes through (tests/ops/test_dense_blocks_cuda.py probes it).
NATIVE_GQA = os.environ.get("MTRAINING_CUDNN_NATIVE_GQA", "0") == "1"


def _aten(name: str):
    """torch.ops.aten.<name> (one seam: CPU tests stand a fake cuDNN op in here)."""
    return getattr(torch.ops.aten, name)


def _schema_names(op) -> list[str]:
    return [a.name for a in op.default._schema.arguments]


@functools.cache
def cudnn_available() -> bool:
    """cuDNN attention ops present with the argument lists this module calls them with (checked once)."""
    try:
        return (
            torch.backends.cudnn.is_available()
            and _schema_names(_aten("_scaled_dot_product_cudnn_attention")) == _FWD_ARGS
            and _schema_names(_aten("_scaled_dot_product_cudnn_attention_backward")) == _BWD_ARGS
        )
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def _lse_rank() -> int:
    """Rank of the logsumexp the cuDNN forward returns with this torch (4: [B, H, Sq, 1] on recent torch,
    3 on older ones), read once from the op's meta function: the backward must get the same shape."""
    t = torch.empty(1, 1, 8, 64, dtype=torch.bfloat16, device="meta")
    return torch.ops.aten._scaled_dot_product_cudnn_attention(t, t, t, None, True)[1].dim()


def _unit_last(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _heads_view(t: Tensor, group: int) -> Tensor:
    """[B, S, Hkv, D] -> [B, Hq, S, D] (a transposed view; heads repeated in a copy when group > 1)."""
    if group > 1 and not NATIVE_GQA:
        b, s, h, d = t.shape
        t = t.unsqueeze(3).expand(b, s, h, group, d).reshape(b, s, h * group, d)
    return _unit_last(t).transpose(1, 2)


def _cudnn_forward(q, k, v, causal, scale):
    group = q.shape[2] // k.shape[2]
    res = _aten("_scaled_dot_product_cudnn_attention")(
        _unit_last(q).transpose(1, 2),
        _heads_view(k, group),
        _heads_view(v, group),
        None,
        True,
        0.0,
        causal,
        False,
        scale=scale,
    )
    out, lse = res[0], res[1]
    if lse.dim() != _lse_rank():
        raise RuntimeError(
            f"cuDNN attention returned a logsumexp of rank {lse.dim()} where its meta function says "
            f"{_lse_rank()}; this torch's cuDNN ops changed: run dense attention with MTRAINING_DENSE_BACKEND=triton"
        )
    if lse.dim() == 4:
        lse = lse.squeeze(-1)
    return out.transpose(1, 2), lse.float()


def _cudnn_backward(do, q, k, v, out, lse, causal, scale):
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    lse = lse.float().contiguous()
    if _lse_rank() == 4:
        lse = lse.unsqueeze(-1)
    seed = torch.empty((), dtype=torch.int64, device=q.device)
    dq, dk, dv = _aten("_scaled_dot_product_cudnn_attention_backward")(
        # dO and O in one layout (contiguous [B, S, H, D]; no copy for the ring's row slices at batch 1)
        do.to(q.dtype).contiguous().transpose(1, 2),
        _unit_last(q).transpose(1, 2),
        _heads_view(k, group),
        _heads_view(v, group),
        out.to(q.dtype).contiguous().transpose(1, 2),
        lse,
        seed,
        seed,
        None,
        None,
        None,
        sq,
        sk,
        0.0,
        causal,
        scale=scale,
    )
    dq = dq.transpose(1, 2).float()
    dk, dv = dk.transpose(1, 2), dv.transpose(1, 2)
    if dk.shape[2] != hkv:
        dk = dk.reshape(b, sk, hkv, group, d).sum(3, dtype=torch.float32)
        dv = dv.reshape(b, sk, hkv, group, d).sum(3, dtype=torch.float32)
    return dq, dk.float(), dv.float()


CUDNN = BlockOps("cudnn", _cudnn_forward, _cudnn_backward)

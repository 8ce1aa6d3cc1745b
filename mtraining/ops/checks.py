"""Input validation shared by the oracle, the kernels and the ring: every error names the fix."""

from __future__ import annotations

import math

import torch
from torch import Tensor

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)


def resolve_scale(softmax_scale: float | None, head_dim: int) -> float:
    """The softmax scale: ``softmax_scale`` (a finite number > 0), or 1/sqrt(head_dim) when None."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    number = isinstance(softmax_scale, (int, float)) and not isinstance(softmax_scale, bool)
    if not number or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(
            f"softmax_scale must be a finite number > 0, got {softmax_scale!r}; pass None for 1/sqrt(head_dim)"
        )
    return float(softmax_scale)


def check_qkv(q: Tensor, k: Tensor, v: Tensor, *, float_dtypes: tuple[torch.dtype, ...] | None = None) -> None:
    """Validate q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D]: ranks, shapes, GQA ratio, dtype, device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dims [batch, seq, heads, head_dim], got shape {tuple(t.shape)}; "
                "transpose from [batch, heads, seq, head_dim] with .transpose(1, 2)"
            )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch (dim 0) and head_dim (dim 3)")
    if q.shape[0] == 0 or q.shape[3] == 0:
        raise ValueError(f"q {tuple(q.shape)} needs batch >= 1 and head_dim >= 1 [batch, seq, heads, head_dim]")
    hq, hkv = q.shape[2], k.shape[2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv}) for GQA")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}; move them with .to()")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast with .to(dtype)")
    if not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must be floating point, got {q.dtype}")
    if float_dtypes is not None and q.dtype not in float_dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in float_dtypes)
        raise ValueError(f"dtype {q.dtype} is not supported here; use one of: {names}")


def default_positions(q: Tensor, k: Tensor, q_pos: Tensor | None, k_pos: Tensor | None) -> tuple[Tensor, Tensor]:
    """Global positions of q rows and k columns; default: keys 0..Sk-1, queries the last Sq of them."""
    sq, sk = q.shape[1], k.shape[1]
    if k_pos is None:
        k_pos = torch.arange(sk, device=k.device, dtype=torch.int32)
    if q_pos is None:
        q_pos = torch.arange(sk - sq, sk, device=q.device, dtype=torch.int32) if sq <= sk else None
        if q_pos is None:
            raise ValueError(f"with more queries ({sq}) than keys ({sk}) pass q_pos and k_pos explicitly")
    for name, pos, n in (("q_pos", q_pos, sq), ("k_pos", k_pos, sk)):
        if pos.dim() != 1 or pos.shape[0] != n:
            raise ValueError(f"{name} must be 1-D with {n} entries (one per row), got shape {tuple(pos.shape)}")
        if pos.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {pos.dtype}")
        if pos.device != q.device:
            raise ValueError(f"{name} is on {pos.device} but q is on {q.device}; move it with .to(q.device)")
    return q_pos, k_pos


def check_pattern(pattern, q: Tensor, span: tuple[int, int]) -> None:
    """The pattern must cover the batch and query heads of q, live on its device, and be defined on the
    positions of the rows and keys: ``span`` = (smallest, largest) of them (``position_span``)."""
    b, _, hq, _ = q.shape
    if (pattern.batch, pattern.heads) != (b, hq):
        raise ValueError(
            f"pattern is for batch {pattern.batch} x {pattern.heads} heads, but q has batch {b} x {hq} heads; "
            "estimate the pattern from this q (or expand it per query head)"
        )
    if pattern.device != q.device:
        raise ValueError(f"pattern is on {pattern.device} but q is on {q.device}; use pattern.to(q.device)")
    lo, hi = span
    if lo < 0:
        raise ValueError(f"positions must be global token positions >= 0, got {lo}")
    if hi >= pattern.seq_len:
        raise ValueError(
            f"pattern is for a sequence of {pattern.seq_len} tokens but the rows and keys reach position {hi}; "
            "estimate the pattern on the sequence these positions index (estimate_pattern on its q and k)"
        )


def position_span(q_pos: Tensor, k_pos: Tensor) -> tuple[int, int]:
    """(smallest, largest) position of the rows and keys, in one device sync; (0, -1) when there are none."""
    both = torch.cat([q_pos.reshape(-1).long(), k_pos.reshape(-1).long()])
    if both.numel() == 0:
        return 0, -1
    lo, hi = torch.stack(torch.aminmax(both)).tolist()
    return lo, hi


def check_reuse(reuse: tuple[Tensor, Tensor] | None, q: Tensor) -> None:
    """Validate ``reuse`` = (out [B, Sq, Hq, D] in q's dtype, lse [B, Hq, Sq]) of an earlier forward of the same call."""
    if reuse is None:
        return
    out, lse = reuse
    b, sq, hq, _ = q.shape
    if out.shape != q.shape or out.dtype != q.dtype or lse.shape != (b, hq, sq) or out.device != q.device:
        raise ValueError(
            f"reuse must be (out, lse) of an earlier forward of this call: out {tuple(q.shape)} {q.dtype} and lse "
            f"{(b, hq, sq)} on {q.device}, got out {tuple(out.shape)} {out.dtype} and lse {tuple(lse.shape)}; "
            "get them with return_lse=True"
        )

"""Plain-PyTorch reference attention: the oracle every kernel and distributed path is tested against.

Materialises the full [B, H, Sq, Sk] score matrix, so it is for small sizes and float64 checks.
Backward runs through autograd.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_pattern, check_qkv, default_positions, resolve_scale
from .pattern import VerticalSlashPattern


def attention_mask(
    q_pos: Tensor, k_pos: Tensor, pattern: VerticalSlashPattern | None, batch: int, heads: int
) -> Tensor:
    """Boolean [B or 1, H or 1, Sq, Sk] of the pairs computed: causal by position, then the pattern."""
    if pattern is None:
        return (k_pos[None, :].long() <= q_pos[:, None].long())[None, None]
    return pattern.pair_mask(q_pos, k_pos)


def attention_oracle(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: VerticalSlashPattern | None = None,
    q_pos: Tensor | None = None,
    k_pos: Tensor | None = None,
    softmax_scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Causal (optionally vertical-slash sparse) attention by global position.

    q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] (Hq a multiple of Hkv). Returns out [B, Sq, Hq, D] in q's
    dtype and the natural-log LSE [B, Hq, Sq] in float32 (float64 for float64 inputs). Rows with no
    allowed key give out = 0 and lse = -inf, which is what a ring merge expects.
    """
    check_qkv(q, k, v)
    q_pos, k_pos = default_positions(q, k, q_pos, k_pos)
    if pattern is not None:
        check_pattern(pattern, q)
    b, sq, hq, d = q.shape
    group = hq // k.shape[2]
    scale = resolve_scale(softmax_scale, d)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qh = q.transpose(1, 2).to(acc)
    kh = k.transpose(1, 2).to(acc).repeat_interleave(group, dim=1)
    vh = v.transpose(1, 2).to(acc).repeat_interleave(group, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    allowed = attention_mask(q_pos, k_pos, pattern, b, hq)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # exp(-inf - -inf) is nan: guard rows that see nothing.
    safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - safe_lse[..., None])
    out = torch.matmul(probs, vh).transpose(1, 2).to(q.dtype)
    return out, lse


def merge_partials(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two partial attentions over disjoint key sets: exact, -inf safe.

    out [B, S, H, D], lse [B, H, S]. Returns the merged (out, lse) in out_a's dtype.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    wa = torch.exp(lse_a - safe).transpose(1, 2)[..., None]
    wb = torch.exp(lse_b - safe).transpose(1, 2)[..., None]
    out = out_a * wa.to(out_a.dtype) + out_b * wb.to(out_a.dtype)
    return out, lse

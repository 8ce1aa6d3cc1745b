"""Plain-PyTorch reference attention: the oracle every kernel and distributed path is tested against.

Materialises the full [B, H, Sq, Sk] score matrix, so it is for small sizes and float64 checks.
Backward runs through autograd.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_pattern, check_qkv, default_positions, position_span, resolve_scale
from .documents import Documents, resolve_documents
from .numerics import acc_dtype, finite_keys, mask_scores
from .pattern import VerticalSlashPattern
from .pattern.vertical_slash import attention_mask


def attention_oracle(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: VerticalSlashPattern | None = None,
    q_pos: Tensor | None = None,
    k_pos: Tensor | None = None,
    softmax_scale: float | None = None,
    documents: Documents | None = None,
) -> tuple[Tensor, Tensor]:
    """Causal (optionally vertical-slash sparse, optionally per document) attention by global position.

    q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] (Hq a multiple of Hkv). Returns out [B, Sq, Hq, D] in q's
    dtype and the natural-log LSE [B, Hq, Sq] in float32 (float64 for float64 inputs). Rows with no
    allowed key give out = 0 and lse = -inf, which is what a ring merge expects. A key whose K or V is
    not finite reaches only the rows allowed to see it (they come out NaN), forward and backward.
    ``documents``: packed documents; a row sees only keys of its own document (doc(i) == doc(j),
    tested by document index here, independently of the kernels' left bounds).
    """
    check_qkv(q, k, v)
    given = q_pos is not None or k_pos is not None
    q_pos, k_pos = default_positions(q, k, q_pos, k_pos)
    span = position_span(q_pos, k_pos) if given else (0, k.shape[1] - 1)
    if pattern is not None:
        check_pattern(pattern, q, span)
    b, sq, hq, d = q.shape
    documents = resolve_documents(documents, b, span=span)
    group = hq // k.shape[2]
    scale = resolve_scale(softmax_scale, d)
    acc = acc_dtype(q)
    qh = q.transpose(1, 2).to(acc)
    kh, vh, bad = finite_keys(
        k.transpose(1, 2).to(acc).repeat_interleave(group, dim=1),
        v.transpose(1, 2).to(acc).repeat_interleave(group, dim=1),
    )
    allowed = attention_mask(q_pos, k_pos, pattern)
    if documents is not None:
        same = documents.doc_ids(q_pos)[:, :, None] == documents.doc_ids(k_pos)[:, None, :]
        allowed = allowed & same[:, None]
    scores = mask_scores(torch.matmul(qh, kh.transpose(-1, -2)) * scale, allowed, bad)
    lse = torch.logsumexp(scores, dim=-1)
    # exp(-inf - -inf) is nan: guard rows that see nothing.
    safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - safe_lse[..., None])
    out = torch.matmul(probs, vh).transpose(1, 2).to(q.dtype)
    return out, lse

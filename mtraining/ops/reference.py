"""The torch backend (``backend="torch"``): forward/backward primitives in plain PyTorch, the CPU path of
the rings and the trainer, and the per-block attention of ``MTRAINING_DENSE_BACKEND=reference``.

An ``AttentionBackend`` (ops/backend.py), as the Triton kernels are (ops/sparse/launch.py). Works in
query-row chunks to bound memory.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .backend import Chunk
from .numerics import acc_dtype, finite_keys, mask_scores, merge_partial
from .pattern.vertical_slash import attention_mask

_ROW_CHUNK = 1024


def _finite_kv(k: Tensor, v: Tensor, group: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None]:
    """``finite_keys`` of k/v [B, S, Hkv, D] as [B, Hq, S, D] in dtype (copies; small sizes only), each key
    tested once before its heads are repeated for the query heads of its group."""
    kh, vh, bad = finite_keys(k.transpose(1, 2).to(dtype), v.transpose(1, 2).to(dtype))
    kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
    return kh, vh, None if bad is None else bad.repeat_interleave(group, dim=1)


def forward(
    chunk: Chunk,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out_dtype: torch.dtype,
    merge_into: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """``AttentionBackend.forward`` (ops/backend.py) in plain PyTorch; lse in the accumulation dtype."""
    pattern, q_pos, k_pos, scale, q_bound = chunk.pattern, chunk.q_pos, chunk.k_pos, chunk.scale, chunk.q_bound
    b, sq, hq, d = q.shape
    acc = acc_dtype(q)
    group = hq // k.shape[2]
    kh, vh, bad = _finite_kv(k, v, group, acc)
    qh = q.transpose(1, 2).to(acc)
    out = torch.empty(b, hq, sq, d, dtype=acc, device=q.device)
    lse = torch.empty(b, hq, sq, dtype=acc, device=q.device)
    for start in range(0, sq, _ROW_CHUNK):
        rows = slice(start, min(start + _ROW_CHUNK, sq))
        allowed = attention_mask(q_pos[rows], k_pos, pattern, None if q_bound is None else q_bound[:, rows])
        s = mask_scores(torch.matmul(qh[:, :, rows], kh.transpose(-1, -2)).mul_(scale), allowed, bad)
        row_lse = torch.logsumexp(s, dim=-1)
        safe = torch.where(torch.isfinite(row_lse), row_lse, torch.zeros_like(row_lse))
        out[:, :, rows] = torch.matmul(s.sub_(safe[..., None]).exp_(), vh)
        lse[:, :, rows] = row_lse
    out = out.transpose(1, 2).to(out_dtype)
    if merge_into is None:
        return out, lse
    merge_partial(*merge_into, out, lse)
    return merge_into


def backward(
    chunk: Chunk,
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor,
    delta: Tensor,
    dq_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``AttentionBackend.backward`` (ops/backend.py) in plain PyTorch; float64 gradients for float64 inputs."""
    pattern, q_pos, k_pos, scale, q_bound = chunk.pattern, chunk.q_pos, chunk.k_pos, chunk.scale, chunk.q_bound
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    acc = acc_dtype(q)
    kh, vh, bad = _finite_kv(k, v, group, acc)
    qh, doh = q.transpose(1, 2).to(acc), do.transpose(1, 2).to(acc)
    dq = torch.zeros(b, hq, sq, d, dtype=acc, device=q.device)
    dkh = torch.zeros_like(kh)
    dvh = torch.zeros_like(vh)
    safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).to(acc)
    for start in range(0, sq, _ROW_CHUNK):
        rows = slice(start, min(start + _ROW_CHUNK, sq))
        allowed = attention_mask(q_pos[rows], k_pos, pattern, None if q_bound is None else q_bound[:, rows])
        s = mask_scores(torch.matmul(qh[:, :, rows], kh.transpose(-1, -2)).mul_(scale), allowed, bad)
        p = s.sub_(safe_lse[:, :, rows, None]).exp_()
        ds = torch.matmul(doh[:, :, rows], vh.transpose(-1, -2)).sub_(delta[:, :, rows, None].to(acc)).mul_(p)
        # masked pairs give exactly 0 even in a row whose delta is not finite (it sees a non-finite key)
        ds.masked_fill_(~allowed, 0.0)
        dq[:, :, rows] = torch.matmul(ds, kh).mul_(scale)
        dkh += torch.matmul(ds.transpose(-1, -2), qh[:, :, rows]).mul_(scale)
        dvh += torch.matmul(p.transpose(-1, -2), doh[:, :, rows])
    dk = dkh.view(b, hkv, group, -1, d).sum(2).transpose(1, 2)
    dv = dvh.view(b, hkv, group, -1, d).sum(2).transpose(1, 2)
    dq = dq.transpose(1, 2)
    return (dq if dq_dtype is None else dq.to(dq_dtype)), dk, dv

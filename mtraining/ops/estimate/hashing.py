"""The sign hashes that decide which (row, key) pairs the per-block column scorers score (block_columns.py,
column_kernels.py, column_buckets.py, column_bucket_kernels.py): random hyperplanes, one bucket per row and key
in each of ``tables`` hashes of ``bits`` bits; a pair is scored when its row and key share a bucket in some hash."""

from __future__ import annotations

import torch
from torch import Tensor


def hash_planes(heads: int, head_dim: int, tables: int, bits: int, seed: int = 0) -> Tensor:
    """Float32 [heads, tables * bits, head_dim] random hyperplanes (CPU): the same on every rank for a seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(heads, tables * bits, head_dim, generator=generator)


def hash_codes(x: Tensor, planes: Tensor, bits: int) -> Tensor:
    """int64 [B, H, S, tables]: the bucket of every row of x [B, H, S, D] in each sign hash of ``planes``."""
    signs = torch.einsum("bhsd,hnd->bhsn", x, planes.to(x.device, x.dtype)) > 0
    weights = 2 ** torch.arange(bits, device=x.device)
    return (signs.view(*x.shape[:3], -1, bits).long() * weights).sum(-1)


def bucket_mates(q_codes: Tensor, k_codes: Tensor) -> Tensor:
    """Boolean [B, H, R, N]: does row r share a bucket with key n in any hash (codes [B, H, R or N, tables])."""
    return (q_codes[:, :, :, None, :] == k_codes[:, :, None, :, :]).any(-1)


def hashed_heads(
    q: Tensor, k: Tensor, tables: int, bits: int, seed: int, heads: slice = slice(None)
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(qh [B, h, Sq, D], kh [B, h, N, D]: q and k in float32 for the query heads ``heads`` (GQA: a key head
    repeated for its group), and their codes, int64 [B, h, Sq or N, tables]) from q [B, Sq, H, D], k [B, N,
    Hkv, D]. A head's codes are the same whichever heads are asked with it (its planes are fixed by the seed)."""
    hq, d = q.shape[2], q.shape[3]
    index = torch.arange(hq)[heads]
    planes = hash_planes(hq, d, tables, bits, seed)[index]
    index = index.to(q.device)
    qh = q.index_select(2, index).float().transpose(1, 2)
    kh = k.index_select(2, index // (hq // k.shape[2])).float().transpose(1, 2)
    return qh, kh, hash_codes(qh, planes, bits), hash_codes(kh, planes, bits)

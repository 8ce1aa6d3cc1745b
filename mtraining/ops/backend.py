"""The contract both attention backends keep, stated once: ``AttentionBackend``, on a ``Chunk``.

A backend computes one chunk pair (the rows of a single-device call, or one ring step, against a chunk of
keys) by global positions: ops/reference.py in plain PyTorch (``backend="torch"``), ops/sparse/launch.py by
the Triton kernels (``backend="triton"``). ``ops.sparse.ChunkPlan``, which decides how a pair runs, is a
``Chunk`` and hands itself to its backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from .pattern import VerticalSlashPattern


@dataclass(frozen=True)
class Chunk:
    """One chunk pair of attention.

    Attributes:
        pattern: the global pattern (None: dense causal).
        q_pos, k_pos: global positions of the rows [Sq] and the keys [Sk].
        scale: softmax scale.
        q_bound: packed documents: the rows' left bounds [B or 1, Sq] int32, the smallest key position each
            row may see (``Documents.left_bounds`` of q_pos); None: no documents.
    """

    pattern: VerticalSlashPattern | None
    q_pos: Tensor
    k_pos: Tensor
    scale: float
    q_bound: Tensor | None = None


class AttentionBackend(Protocol):
    """Forward and backward of a chunk pair, merging exactly across pairs: the forward returns (out, lse) (a row
    that sees no key: out 0, lse -inf), and the backward takes the whole row's LSE and delta, so the partial
    results of ring steps add up to the row's. Masked pairs contribute nothing, not even a NaN of a key the row
    may not see (``numerics.finite_keys``)."""

    def forward(
        self,
        chunk: Chunk,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out_dtype: torch.dtype,
        merge_into: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(out [B, Sq, Hq, D] in ``out_dtype``, lse [B, Hq, Sq] float32, natural log) of q [B, Sq, Hq, D] against
        k, v [B, Sk, Hkv, D]; with ``merge_into`` (out, lse) over other keys, this pair's result merged into
        them in place, and they are returned."""
        ...

    def backward(
        self,
        chunk: Chunk,
        do: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        lse: Tensor,
        delta: Tensor,
        dq_dtype: torch.dtype | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(dq, dk, dv) float32 (dq in ``dq_dtype`` if given) of this pair's pairs, given the whole rows' lse and
        delta = rowsum(dO * O) [B, Hq, Sq]."""
        ...

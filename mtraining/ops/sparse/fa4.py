"""``backend="fa4"``: a pattern's selected block diagonals by FlashAttention-4's block-sparse kernels, the verticals
they leave over by the Triton kernels, merged exactly.

The selected block diagonals are whole G x G blocks (causal on the main diagonal): what a block-sparse kernel
computes. ``SplitBackend`` hands them to a ``BlockPart`` (``FlashAttention4``: the ``flash-attn-4`` package,
imported on first use) as tile lists (block_lists.py), and runs the Triton kernels on the same pattern with
their block lists emptied (``index.without_blocks``), which leaves exactly the verticals that no selected
diagonal covers: every kept pair is computed once. Forward: the block part's (out, lse), into which the
Triton forward kernel merges the verticals' in place (``numerics.merge_partial``'s arithmetic). Backward:
given the whole rows' out and lse, the block part gives its pairs' share of dq, dk, dv (FA4 computes delta
from out and dO itself), the Triton kernels the verticals' share (with the rows' delta); they add up.

Scope (``check_call``): one device, the default positions with as many queries as keys, no packed
documents, no per-block columns, a pattern block that is a multiple of ``FA4_TILE``; everything else
stays on ``backend="triton"``, which the error names.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from ..backend import Chunk
from ..documents import Documents
from ..pattern import VerticalSlashPattern
from .block_lists import FA4_TILE, BlockLists, SparseBlocks, sparse_blocks

FA4_DTYPES = (torch.float16, torch.bfloat16)


class BlockPart(Protocol):
    """Attention over the tiles of ``BlockLists`` (causal within the partial ones) on q [B, S, Hq, D] and k, v
    [B, S, Hkv, D], queries and keys at positions 0..S-1."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, blocks: SparseBlocks, scale: float) -> tuple[Tensor, Tensor]:
        """(out [B, S, Hq, D] in q's dtype, lse [B, Hq, S] float32, natural log; out 0 and lse -inf for a row
        that meets no tile) over the tiles of ``blocks.forward``."""
        ...

    def backward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        do: Tensor,
        lse: Tensor,
        blocks: SparseBlocks,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(dq, dk, dv) of the pairs in the tiles of ``blocks.backward``, given the whole rows' out and lse."""
        ...


def installed() -> bool:
    """Whether flash-attn-4's ``flash_attn.cute`` is installed (found, not imported: importing it loads the CuTe
    DSL), so that a run can refuse backend='fa4' before it starts."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ImportError:  # no flash_attn package at all (or one that fails to import)
        return False


def _interface():
    """flash_attn.cute.interface of flash-attn-4, or an ImportError that names the install."""
    try:
        from flash_attn.cute import interface
    except ImportError as e:
        raise ImportError(
            f"backend='fa4' needs FlashAttention-4 ({e}): pip install flash-attn-4 (CUDA, Hopper or Blackwell), "
            "or use backend='triton'"
        ) from e
    return interface


class FlashAttention4:
    """The ``BlockPart`` by FA4's block-sparse kernels, through its private ``_flash_attn_fwd`` and
    ``_flash_attn_bwd`` (the signatures of flash-attn-4 4.0.0b36): the public ``flash_attn_func`` is an autograd
    function of its own, while this backend's backward needs the whole rows' lse, not the blocks'."""

    @staticmethod
    def _tensors(lists: BlockLists, tile: int):
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

        return BlockSparseTensorsTorch(*lists, block_size=(tile, tile))

    def forward(self, q: Tensor, k: Tensor, v: Tensor, blocks: SparseBlocks, scale: float) -> tuple[Tensor, Tensor]:
        if not q.is_cuda or q.dtype not in FA4_DTYPES:
            raise ValueError(
                f"backend='fa4' runs on CUDA in float16 or bfloat16, got {q.dtype} on {q.device}; "
                "use backend='triton' (or 'torch') otherwise"
            )
        out, lse, *_ = _interface()._flash_attn_fwd(
            q,
            k,
            v,
            softmax_scale=scale,
            causal=True,
            block_sparse_tensors=self._tensors(blocks.forward, blocks.tile),
            return_lse=True,
        )
        return out, lse

    def backward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        do: Tensor,
        lse: Tensor,
        blocks: SparseBlocks,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        dq, dk, dv = _interface()._flash_attn_bwd(
            q,
            k,
            v,
            out,
            do,
            lse.contiguous(),
            softmax_scale=scale,
            causal=True,
            block_sparse_tensors=self._tensors(blocks.backward, blocks.tile),
        )
        return dq, dk, dv


@dataclass
class SplitBackend:
    """The selected blocks by ``block_part`` on tiles of ``tile`` (dividing the pattern block), the verticals outside
    them by the Triton kernels (module docstring)."""

    block_part: BlockPart
    tile: int = FA4_TILE

    def _blocks(self, chunk: Chunk, seq_len: int) -> SparseBlocks:
        """The pattern's tile lists, built once per pattern, chunk pair and tile (``pattern.index_cache``)."""
        pattern = chunk.pattern
        assert pattern is not None  # check_call
        return pattern.index_cache.get(
            ("block lists", self.tile), chunk.q_pos, chunk.k_pos, lambda: sparse_blocks(pattern, seq_len, self.tile)
        )

    def forward(self, chunk: Chunk, q: Tensor, k: Tensor, v: Tensor, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(out [B, S, Hq, D] in ``out_dtype``, lse [B, Hq, S] float32) of the chunk's rows."""
        from . import launch

        out, lse = self.block_part.forward(q, k, v, self._blocks(chunk, q.shape[1]), chunk.scale)
        return launch.forward(chunk, q, k, v, out_dtype, (out.to(out_dtype), lse.float()), blocks=False)

    def backward(
        self,
        chunk: Chunk,
        do: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        delta: Tensor,
        dq_dtype: torch.dtype | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(dq, dk, dv) float32 (dq in ``dq_dtype`` if given) given the whole rows' out, lse and delta."""
        from . import launch

        grads = self.block_part.backward(q, k, v, out, do, lse, self._blocks(chunk, q.shape[1]), chunk.scale)
        dq, dk, dv = launch.backward(chunk, do, q, k, v, lse, delta, torch.float32, blocks=False)
        for total, part in zip((dq, dk, dv), grads):
            total.add_(part)
        return dq.to(dq_dtype or torch.float32), dk, dv


FA4 = SplitBackend(FlashAttention4())
"""The backend ``sparse_attention(..., backend="fa4")`` runs (the CPU tests put one with an exact torch block part
in its place)."""


def out_of_scope(
    q: Tensor,
    k: Tensor,
    pattern: VerticalSlashPattern | None,
    positions_given: bool,
    documents: Documents | None,
) -> str | None:
    """Why FA4's block-sparse kernels do not cover the call, a message naming the fix (module docstring), else
    None: ``check_call``'s rule, which models/attention.py also routes by."""
    other = "use backend='triton' (or 'auto')"
    if pattern is None:
        return "backend='fa4' computes a pattern's blocks; for dense causal attention use backend='auto'"
    if positions_given or q.shape[1] != k.shape[1]:
        return (
            f"backend='fa4' takes the default positions with as many queries as keys (got {q.shape[1]} queries, "
            f"{k.shape[1]} keys{', explicit positions' if positions_given else ''}); {other}"
        )
    if documents is not None:
        return f"backend='fa4' does not take packed documents; {other}"
    if pattern.block_cols is not None:
        return f"backend='fa4' does not compute per-block columns (pattern.block_cols); {other}"
    if pattern.block_size % FA4_TILE:
        return (
            f"backend='fa4' needs a pattern block that is a multiple of {FA4_TILE}, got {pattern.block_size}; "
            f"estimate with PatternConfig(block_size={FA4_TILE}) or {other}"
        )
    return None


def check_call(
    q: Tensor,
    k: Tensor,
    pattern: VerticalSlashPattern | None,
    positions_given: bool,
    documents: Documents | None,
) -> None:
    """ValueError naming the fix unless the call is what FA4's block-sparse kernels cover (``out_of_scope``)."""
    miss = out_of_scope(q, k, pattern, positions_given, documents)
    if miss is not None:
        raise ValueError(miss)

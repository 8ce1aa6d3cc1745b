"""Sparse attention: backend dispatch, the dense-or-sparse decision of a chunk pair, the autograd op.

``attention_forward`` / ``attention_backward`` / ``attention_delta`` are the per-chunk primitives of
the two backends (``AttentionBackend``, ops/backend.py: "torch": ops/reference.py, "triton": launch.py).
A single-device call may also ask for "fa4" (fa4.py: the selected blocks by FlashAttention-4, the verticals
by the Triton kernels), within the scope ``fa4.check_call`` names. ``plan_chunk`` decides, in one
place, how a chunk pair (the rows of one single-device call, or one ring step) is computed: as dense
blocks (no pattern, on cuDNN where it applies: ops/dense) or by the backend; the ring engines and
``sparse_attention`` (the single-device autograd op users call) both follow its ``ChunkPlan``.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from .. import dense, reference
from ..backend import AttentionBackend, Chunk
from ..checks import (
    SUPPORTED_HEAD_DIMS,
    check_pattern,
    check_qkv,
    check_reuse,
    default_positions,
    position_span,
    resolve_scale,
)
from ..documents import Documents, resolve_documents
from ..numerics import merge_partial, row_delta
from ..pattern import VerticalSlashPattern
from . import fa4
from .index import DENSE_BLOCK, check_aligned_positions

Backend = Literal["auto", "triton", "torch"]
CallBackend = Literal["auto", "triton", "torch", "fa4"]
"""The backends of a single-device call: ``Backend``'s, or "fa4" (fa4.py)."""
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def resolve_backend(backend: Backend, device: torch.device) -> Literal["triton", "torch"]:
    """'auto' picks the Triton kernels on CUDA and plain PyTorch elsewhere (ask for 'triton' explicitly
    to run the kernels in Triton's interpreter on the CPU, with TRITON_INTERPRET=1)."""
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    return backend


def _backend_module(name: str) -> AttentionBackend:
    """The backend's module (an ``AttentionBackend``); the Triton one is imported on first use (Triton reads
    TRITON_INTERPRET when the kernels are defined, and CPU-only callers never need it)."""
    if name == "triton":
        from . import launch

        return launch
    return reference


def check_backend_inputs(q: Tensor, k: Tensor, v: Tensor, backend: str) -> None:
    """q/k/v shapes, dtypes and devices, and what the resolved ``backend`` supports (the kernels' dtypes and head dims)."""
    check_qkv(q, k, v, float_dtypes=KERNEL_DTYPES if backend == "triton" else None)
    if backend == "triton" and q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {q.shape[-1]} is not supported by the kernels; use one of {SUPPORTED_HEAD_DIMS}")


def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: VerticalSlashPattern | None,
    q_pos: Tensor,
    k_pos: Tensor,
    scale: float,
    *,
    backend: str = "auto",
    out_dtype: torch.dtype | None = None,
    merge_into: tuple[Tensor, Tensor] | None = None,
    q_bound: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One block of attention: (out [B, Sq, Hq, D], lse [B, Hq, Sq] float32), ``AttentionBackend.forward`` of
    ``backend`` on the ``Chunk`` of these positions, pattern, scale and bounds. No validation (hot path).

    ``merge_into``: (out, lse) over other keys (an earlier ring step, out in ``out_dtype``), into
    which this block's result is merged in place (by the kernel itself on the Triton backend).
    ``q_bound``: packed documents, int32 [B or 1, Sq], the smallest key position each row may see
    (``Documents.left_bounds`` of q_pos).
    """
    chunk = Chunk(pattern, q_pos, k_pos, scale, q_bound)
    return _backend_module(resolve_backend(backend, q.device)).forward(chunk, q, k, v, out_dtype or q.dtype, merge_into)


def attention_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor,
    delta: Tensor,
    pattern: VerticalSlashPattern | None,
    q_pos: Tensor,
    k_pos: Tensor,
    scale: float,
    *,
    backend: str = "auto",
    dq_dtype: torch.dtype | None = None,
    q_bound: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv, float32; dq in ``dq_dtype`` if given) of one block given the full-row
    lse and delta (``attention_delta``): ``AttentionBackend.backward``; ``q_bound`` as in ``attention_forward``."""
    chunk = Chunk(pattern, q_pos, k_pos, scale, q_bound)
    return _backend_module(resolve_backend(backend, q.device)).backward(chunk, do, q, k, v, lse, delta, dq_dtype)


def attention_delta(do: Tensor, out: Tensor) -> Tensor:
    """delta [B, H, S] = rowsum(dO * O) of the whole rows, for ``attention_backward``: one Triton pass on
    CUDA (no float32 copies of dO and O), ``numerics.row_delta`` elsewhere."""
    if out.is_cuda and out.dtype != torch.float64 and out.shape[-1] in SUPPORTED_HEAD_DIMS:
        from . import launch

        return launch.row_delta(do, out)
    return row_delta(do, out)


@dataclass(frozen=True, kw_only=True)
class ChunkPlan(Chunk):
    """How one chunk pair (a ``Chunk``: one single-device call, or one ring step) is attended. Built by
    ``plan_chunk``; forward and backward follow it, handing the chunk to its backend (``AttentionBackend``).

    Attributes (beyond the ``Chunk``'s, by keyword):
        backend: the resolved backend, "torch", "triton" or "fa4" (fa4.py; single-device calls only).
        dense: the pair as dense blocks (ops/dense), or None: the backend computes it.
    """

    backend: str
    dense: dense.DenseBlocks | None

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, out_dtype: torch.dtype, merge_into: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """(out in ``out_dtype``, lse) of the pair; with ``merge_into`` (out, lse) over other keys, merged into those."""
        if self.backend == "fa4":
            if merge_into is not None:
                raise ValueError("backend='fa4' computes single-device calls, not ring steps: use backend='triton'")
            return fa4.FA4.forward(self, q, k, v, out_dtype)
        if self.dense is None:
            return _backend_module(self.backend).forward(self, q, k, v, out_dtype, merge_into)
        part = self.dense.forward(q, k, v, self.scale, out_dtype)
        if merge_into is None:
            return part
        merge_partial(*merge_into, *part)
        return merge_into

    def backward(
        self,
        do: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        delta: Tensor | None,
        dq_dtype: torch.dtype | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(dq, dk, dv) of the pair's pairs given the whole rows' out, lse and delta (``attention_delta``;
        dense blocks compute their own: None is enough when ``dense`` is set)."""
        if self.dense is not None:
            return self.dense.backward(do, q, k, v, out, lse, self.scale)
        if delta is None:
            raise ValueError("the backend's backward needs the rows' delta (attention_delta)")
        if self.backend == "fa4":  # its block part takes the rows' out (FA4 computes delta itself)
            return fa4.FA4.backward(self, do, q, k, v, out, lse, delta, dq_dtype)
        return _backend_module(self.backend).backward(self, do, q, k, v, lse, delta, dq_dtype)


def plan_chunk(
    q: Tensor,
    k: Tensor,
    pattern: VerticalSlashPattern | None,
    q_pos: Tensor,
    k_pos: Tensor,
    scale: float,
    backend: str,
    blocks: Callable[[], tuple[dense.Block, ...] | None],
    dense_pattern: Callable[[], VerticalSlashPattern] | None = None,
    q_bound: Tensor | None = None,
) -> ChunkPlan:
    """The one decision of how a chunk pair runs: without a pattern, as dense blocks wherever
    ``dense.dense_blocks`` takes it (cuDNN on CUDA, or the reference setting), else by ``backend``.

    ``blocks`` returns the pair's dense decomposition (called only when dense blocks may apply; with
    packed documents, the decomposition by document, or None where it does not apply).
    ``dense_pattern``: for a pattern-free pair the backend runs, the dense pattern it runs with (the
    rings pass one on the layout's grid, whose kernel indices then live across calls); None: the
    backend's own dense path. ``q_bound``: packed documents, the rows' left bounds (``attention_forward``).
    """
    if pattern is not None:
        return ChunkPlan(pattern, q_pos, k_pos, scale, q_bound, backend=backend, dense=None)
    blocks_path = dense.dense_blocks(q, k, backend, blocks)
    if blocks_path is None and dense_pattern is not None:
        pattern = dense_pattern()
    return ChunkPlan(pattern, q_pos, k_pos, scale, q_bound, backend=backend, dense=blocks_path)


def _plan_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: VerticalSlashPattern | None,
    q_pos: Tensor | None,
    k_pos: Tensor | None,
    softmax_scale: float | None,
    backend: CallBackend,
    documents: Documents | None,
) -> ChunkPlan:
    """Validate a single-device call once and plan it."""
    name = "fa4" if backend == "fa4" else resolve_backend(backend, q.device)
    check_backend_inputs(q, k, v, "triton" if name == "fa4" else name)  # fa4: the Triton kernels run the verticals
    q_given, k_given = q_pos is not None, k_pos is not None
    if q_given or k_given:
        q_pos, k_pos = default_positions(q, k, q_pos, k_pos)
        span = position_span(q_pos, k_pos)
        documents = resolve_documents(documents, q.shape[0], span=span)
        if documents is None:
            q_bound, blocks = None, functools.partial(dense.decompose, q_pos, k_pos)
        else:
            q_bound = documents.left_bounds(q_pos)
            blocks = functools.partial(document_blocks, documents, q_pos, k_pos)
    else:  # default positions span 0..Sk-1: known on the host, no device sync
        span = (0, k.shape[1] - 1)
        documents = resolve_documents(documents, q.shape[0], span=span)
        q_pos, k_pos, q_bound = _default_call(q, k, documents)
        sq, sk = q.shape[1], k.shape[1]
        if documents is None:
            blocks = functools.partial(dense.default_blocks, sq, sk)
        else:
            blocks = functools.partial(default_document_blocks, documents, sq, sk)
    if name == "fa4":
        fa4.check_call(q, k, pattern, q_given or k_given, documents)
    if name == "triton":
        grid = pattern.block_size if pattern is not None else DENSE_BLOCK
        # default positions are checked on the host: the device check would wait for the GPU
        if q_given or (k.shape[1] - q.shape[1]) % grid:
            check_aligned_positions(q_pos, grid, "q_pos")
        if k_given:
            check_aligned_positions(k_pos, grid, "k_pos")
    if pattern is not None:
        check_pattern(pattern, q, span)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    if q.shape[1] == 0:  # no rows: nothing to launch; the torch backend gives the empty out and lse
        return ChunkPlan(pattern, q_pos, k_pos, scale, backend="torch", dense=None)
    return plan_chunk(q, k, pattern, q_pos, k_pos, scale, name, blocks, q_bound=q_bound)


def _default_call(q: Tensor, k: Tensor, documents: Documents | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """The default positions (keys 0..Sk-1, queries the last Sq) and, with packed documents, the rows' left bounds,
    kept on the documents per shape and device: every layer of a forward makes the same call."""
    if documents is None:
        return (*default_positions(q, k, None, None), None)

    def build() -> tuple[Tensor, Tensor, Tensor]:
        q_pos, k_pos = default_positions(q, k, None, None)
        return q_pos, k_pos, documents.left_bounds(q_pos)

    return documents.cached(("default call", q.shape[1], k.shape[1], q.device), build)


def document_blocks(documents: Documents, q_pos: Tensor, k_pos: Tensor) -> tuple[dense.Block, ...] | None:
    """The dense blocks of a chunk pair by document (``dense.decompose`` with the document starts), at most
    ``dense.MAX_BLOCKS`` per document the rows meet; None when the batch rows' documents differ (one
    decomposition serves the whole batch) or more blocks would be needed."""
    if not documents.shared:
        return None
    met = documents.doc_ids(q_pos.reshape(-1)[[0, -1]].cpu())[0]
    limit = dense.MAX_BLOCKS * int(met[1] - met[0] + 1)
    return dense.decompose(q_pos, k_pos, limit, documents.starts[0].tolist())


def default_document_blocks(documents: Documents, sq: int, sk: int) -> tuple[dense.Block, ...] | None:
    """``document_blocks`` of the default positions (keys 0..sk-1, queries the last ``sq``), built once per
    documents and shape from the host-held starts: no device sync and no host work over the positions, which
    every layer of a forward would otherwise repeat."""

    def build() -> tuple[dense.Block, ...] | None:
        if not documents.shared:
            return None
        starts = documents.starts[0].tolist()
        first, last = (bisect.bisect_right(starts, p) - 1 for p in (sk - sq, sk - 1))
        limit = dense.MAX_BLOCKS * (last - first + 1)
        return dense.decompose_default(sq, sk, limit, starts)

    return documents.cached(("default_blocks", sq, sk), build)


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: ChunkPlan, reuse):
        out, lse = reuse if reuse is not None else plan.forward(q, k, v, q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        plan: ChunkPlan = ctx.plan
        delta = attention_delta(dout, out) if plan.dense is None else None
        dq, dk, dv = plan.backward(dout, q, k, v, out, lse, delta, dq_dtype=q.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: VerticalSlashPattern | None = None,
    q_pos: Tensor | None = None,
    k_pos: Tensor | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: CallBackend = "auto",
    reuse: tuple[Tensor, Tensor] | None = None,
    documents: Documents | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Causal vertical-slash sparse attention on one device (dense causal without a pattern).

    Args:
        q: [B, Sq, Hq, D] queries; k, v: [B, Sk, Hkv, D] keys and values (Hq a multiple of Hkv: GQA
            without copying K/V heads).
        pattern: the global ``VerticalSlashPattern`` (``estimate_pattern``); None: dense causal, on CUDA
            in fp16/bf16 through cuDNN as a few dense blocks (ops/dense, ``MTRAINING_DENSE_BACKEND``).
        q_pos, k_pos: global positions of the rows and keys (default: keys 0..Sk-1, queries the last Sq).
        softmax_scale: default 1/sqrt(D).
        return_lse: also return the LSE.
        backend: "auto" (Triton on CUDA, plain PyTorch elsewhere), "triton", "torch", or "fa4": the selected
            block diagonals by FlashAttention-4's block-sparse kernels and the verticals outside them by the
            Triton kernels (``pip install flash-attn-4``; one CUDA device, default positions with Sq = Sk, no
            documents, no per-block columns, a pattern block that is a multiple of 128; ValueError otherwise).
        reuse: (out, lse) that an earlier call with the same inputs returned: the forward is skipped and
            the backward uses them (for the forward that activation checkpointing recomputes).
        documents: packed documents (``mtraining.ops.Documents``): a row sees only the keys of its own
            document; work follows the pairs they keep. None (or one document per row): as before.

    Returns:
        out [B, Sq, Hq, D] in q's dtype, differentiable in q, k, v (the pattern carries no gradient);
        with ``return_lse`` also lse [B, Hq, Sq] float32 (natural log; -inf for rows that see no key).

    Raises:
        ValueError naming the fix for inputs that do not fit (shapes, dtypes, positions, a pattern of
        another sequence, batch or heads).
    """
    plan = _plan_call(q, k, v, pattern, q_pos, k_pos, softmax_scale, backend, documents)
    check_reuse(reuse, q)
    out, lse = _SparseAttention.apply(q, k, v, plan, reuse)
    return (out, lse) if return_lse else out

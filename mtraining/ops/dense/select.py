"""Which path a dense (pattern-free) chunk pair takes: dense blocks through cuDNN, through the torch backend,
or none (the sparse backend's own dense path: the Triton kernels with a dense pattern, or plain PyTorch).

Set by ``MTRAINING_DENSE_BACKEND`` or, inside a block, ``dense_backend(name)``:
``auto`` (default: cuDNN where the inputs allow, on CUDA fp16/bf16, else the backend's own dense
path), ``cudnn`` (as auto, but a ValueError when the inputs cannot use cuDNN), ``triton`` (never
cuDNN: the Triton kernels with a dense pattern, the path before cuDNN) and ``reference`` (the
blocks run through plain PyTorch on any device: tests of the decomposition and the wiring).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from .. import reference
from ..backend import Chunk
from ..numerics import row_delta
from .blocks import Block, BlockOps, DenseBlocks
from .cudnn import CUDNN, cudnn_available

ENV_VAR = "MTRAINING_DENSE_BACKEND"
DENSE_BACKENDS = ("auto", "cudnn", "triton", "reference")
CUDNN_DTYPES = (torch.float16, torch.bfloat16)
_SETTING: contextvars.ContextVar[str | None] = contextvars.ContextVar("mtraining_dense_backend", default=None)


def _block_positions(sq: int, sk: int, causal: bool, device: torch.device) -> tuple[Tensor, Tensor]:
    k_pos = torch.arange(sk, device=device)
    q_pos = torch.arange(sq, device=device) + (0 if causal else sk)
    return q_pos, k_pos


def _reference_forward(q, k, v, causal, scale):
    q_pos, k_pos = _block_positions(q.shape[1], k.shape[1], causal, q.device)
    return reference.forward(Chunk(None, q_pos, k_pos, scale), q, k, v, q.dtype)


def _reference_backward(do, q, k, v, out, lse, causal, scale):
    """Like cuDNN: delta = rowsum(dO * O) from the out it is given (the whole row's)."""
    q_pos, k_pos = _block_positions(q.shape[1], k.shape[1], causal, q.device)
    return reference.backward(Chunk(None, q_pos, k_pos, scale), do, q, k, v, lse, row_delta(do, out))


REFERENCE = BlockOps("reference", _reference_forward, _reference_backward)


@contextlib.contextmanager
def dense_backend(name: str) -> Iterator[None]:
    """Within the block (this thread or task), dense calls take ``name`` whatever the environment says."""
    token = _SETTING.set(_check_setting(name))
    try:
        yield
    finally:
        _SETTING.reset(token)


def _check_setting(name: str) -> str:
    if name not in DENSE_BACKENDS:
        raise ValueError(
            f"dense backend must be one of {DENSE_BACKENDS} (set {ENV_VAR} or dense_backend()), got {name!r}"
        )
    return name


def dense_setting() -> str:
    """The active dense backend: dense_backend()'s, else $MTRAINING_DENSE_BACKEND, else 'auto'."""
    return _check_setting(_SETTING.get() or os.environ.get(ENV_VAR, "auto") or "auto")


def select_ops(q: Tensor, k: Tensor, backend: str) -> BlockOps | None:
    """Per-block ops for a dense (pattern=None) call with resolved ``backend``, or None: the backend's own path."""
    setting = dense_setting()
    if setting == "triton":
        return None
    if setting == "reference":
        return REFERENCE
    why = None
    if not q.is_cuda:
        why = f"inputs on {q.device.type}"
    elif q.dtype not in CUDNN_DTYPES:
        why = f"dtype {q.dtype} (cuDNN attention takes float16/bfloat16)"
    elif q.shape[-1] > 128 or q.shape[-1] % 8:
        why = f"head_dim {q.shape[-1]}"
    elif backend != "triton":
        why = f"backend {backend!r}"
    elif not cudnn_available():
        why = "no cuDNN attention ops with the expected signatures in this torch"
    if why is None:
        return CUDNN
    if setting == "cudnn":
        raise ValueError(f"{ENV_VAR}=cudnn cannot run these inputs ({why}); use 'auto' or 'triton'")
    return None


def dense_blocks(
    q: Tensor, k: Tensor, backend: str, blocks: Callable[[], tuple[Block, ...] | None]
) -> DenseBlocks | None:
    """A dense causal chunk pair as dense blocks through per-block attention, where that is the path.

    Args:
        q: [B, Sq, Hq, D] the pair's queries; k: [B, Sk, Hkv, D] its keys (dtype, device, head_dim decide).
        backend: the resolved backend of the call, "torch" or "triton" (cuDNN stands in for "triton" only).
        blocks: returns the pair's decomposition (``decompose``: None when it needs more than MAX_BLOCKS
            blocks); called only when per-block attention applies, so a caller can cache it or defer its sync.

    Returns:
        ``DenseBlocks`` (per-block ops and blocks) whose forward/backward compute the pair, or None when
        the sparse backend's own dense path runs it (dense setting 'triton', inputs cuDNN cannot take
        under 'auto', or too many blocks).

    Raises:
        ValueError under MTRAINING_DENSE_BACKEND=cudnn when cuDNN cannot run these inputs.
    """
    ops = select_ops(q, k, backend)
    if ops is None:
        return None
    pair = blocks()
    return DenseBlocks(ops, pair) if pair is not None else None

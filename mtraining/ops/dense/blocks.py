"""Dense causal attention of one chunk pair as a few dense sub-problems (cuDNN on CUDA).

A chunk pair (query rows, key rows, each with its global positions, strictly increasing along the
chunk) is what one ring step or one single-device call computes. With no pattern (dense causal),
every layout's chunk pair splits into a handful of *blocks*, each a plain dense attention problem:

- ``causal``: the block's query and key positions are the same sequence, so position-causal is
  top-left causal by local index (what cuDNN's ``is_causal`` computes);
- not causal: every key of the block precedes every query (all pairs visible).

``decompose`` finds them: it cuts the positions into runs of consecutive positions, refines the
runs at each other's boundaries (so any query segment and key segment are either the same range
or disjoint), then emits one causal block per diagonal stretch and one full block per stretch of
query segments that see the same key prefix. Contiguous and zigzag layouts give one block per
ring step (step 0: the shard against itself, one causal block; later steps: half of q or half of
k, one full block); the single-device case with Sq < Sk gives two. The striped layout's later
steps are a staircase of G-token stripes (one block per stripe): more than ``MAX_BLOCKS`` blocks
returns None and the caller runs its usual dense path (the Triton kernels) for that step.

``forward`` / ``backward`` run the blocks with a pluggable per-block attention (``BlockOps``) and
keep the contract of ``attention.py``: out [B, Sq, Hq, D], lse [B, Hq, Sq] float32 natural log,
merged exactly by LSE, rows that see no key out 0 / lse -inf; the backward gets the full-row
(merged) out and lse and returns float32 dq/dk/dv of just this chunk pair's pairs. A
FlashAttention-style backward only needs P = exp(S - lse_row) and delta = rowsum(dO * O_row),
so passing the merged out and lse of the whole row gives each block's exact share.

Which path dense calls take is set by ``MTRAINING_DENSE_BACKEND`` (or ``dense_backend(name)``):
``auto`` (default: cuDNN where the inputs allow, on CUDA fp16/bf16, else the backend's own dense
path), ``cudnn`` (as auto, but a ValueError when the inputs cannot use cuDNN), ``triton`` (never
cuDNN: the Triton kernels with a dense pattern, the path before cuDNN) and ``reference`` (the
blocks run through plain PyTorch on any device: tests of the decomposition and the wiring).
"""

from __future__ import annotations

import bisect
import contextlib
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from .. import reference as torch_backend

MAX_BLOCKS = 4
ENV_VAR = "MTRAINING_DENSE_BACKEND"
DENSE_BACKENDS = ("auto", "cudnn", "triton", "reference")
CUDNN_DTYPES = (torch.float16, torch.bfloat16)


class Block(NamedTuple):
    """Local rows [q0, q1) against local keys [k0, k1); causal: top-left by local index (q1-q0 == k1-k0)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


# ----------------------------------------------------------------------------- decomposition
def _runs(pos: Tensor) -> list[tuple[int, int, int]] | None:
    """Maximal runs of consecutive positions as (local start, local end, first position); None unless increasing."""
    pos = pos.detach().to("cpu", torch.int64).reshape(-1)
    n = pos.numel()
    if n == 0:
        return []
    step = pos[1:] - pos[:-1]
    if bool((step <= 0).any()):
        return None
    cuts = [0, *((step != 1).nonzero().reshape(-1) + 1).tolist(), n]
    first = pos[torch.tensor(cuts[:-1])].tolist()
    return [(a, b, p) for a, b, p in zip(cuts[:-1], cuts[1:], first)]


def _segments(runs: list[tuple[int, int, int]], bounds: list[int]) -> list[tuple[int, int, int]]:
    """Runs split at every boundary position strictly inside them: (local start, local end, first position)."""
    out = []
    for a, b, p in runs:
        end = p + (b - a)
        i = bisect.bisect_right(bounds, p)
        while i < len(bounds) and bounds[i] < end:
            cut = bounds[i]
            out.append((a, a + cut - p, p))
            a, p = a + cut - p, cut
            i += 1
        out.append((a, b, p))
    return out


def decompose(q_pos: Tensor, k_pos: Tensor, max_blocks: int | None = MAX_BLOCKS) -> tuple[Block, ...] | None:
    """Dense blocks covering exactly the pairs k_pos[j] <= q_pos[i], each once; None if positions are not
    strictly increasing or more than ``max_blocks`` blocks would be needed (None: no limit)."""
    q_runs, k_runs = _runs(q_pos), _runs(k_pos)
    if q_runs is None or k_runs is None:
        return None
    if not q_runs or not k_runs:
        return ()
    bounds = sorted({p for a, b, p in q_runs + k_runs} | {p + b - a for a, b, p in q_runs + k_runs})
    qs, ks = _segments(q_runs, bounds), _segments(k_runs, bounds)
    k_starts = [p for _, _, p in ks]
    k_ends = [p + b - a for a, b, p in ks]
    # per query segment: f = number of key segments entirely before it (a prefix: positions increase),
    # partner = index of the key segment with the same range, if any (refined segments never overlap partially)
    seen, partner = [], []
    for a, b, p in qs:
        f = bisect.bisect_right(k_ends, p)
        same = f < len(ks) and k_starts[f] == p
        if same and k_ends[f] != p + b - a:  # cannot happen after refinement
            return None
        seen.append(f)
        partner.append(f if same else None)
    blocks: list[Block] = []
    extra = list(seen)  # key segments each query segment sees outside its causal block
    i = 0
    while i < len(qs):  # causal blocks: stretches of segments paired with consecutive key segments
        if partner[i] is None:
            i += 1
            continue
        j = i
        while j + 1 < len(qs) and partner[j + 1] == partner[j] + 1:
            j += 1
        for t in range(i, j + 1):
            extra[t] = partner[i]
        blocks.append(Block(qs[i][0], qs[j][1], ks[partner[i]][0], ks[partner[j]][1], True))
        i = j + 1
    i = 0
    while i < len(qs):  # full blocks: stretches of segments that see the same key prefix
        j = i
        while j + 1 < len(qs) and extra[j + 1] == extra[i]:
            j += 1
        if extra[i] > 0:
            blocks.append(Block(qs[i][0], qs[j][1], 0, ks[extra[i] - 1][1], False))
        i = j + 1
    if max_blocks is not None and len(blocks) > max_blocks:
        return None
    return tuple(sorted(blocks))


_BLOCK_CACHE: OrderedDict = OrderedDict()
_BLOCK_CACHE_SIZE = 64


def blocks_for(q_pos: Tensor, k_pos: Tensor) -> tuple[Block, ...] | None:
    """``decompose`` of device position tensors, cached on the tensor objects (held, so ids stay theirs)."""
    key = (id(q_pos), id(k_pos))
    hit = _BLOCK_CACHE.get(key)
    if hit is not None and hit[0] is q_pos and hit[1] is k_pos:
        _BLOCK_CACHE.move_to_end(key)
        return hit[2]
    blocks = decompose(q_pos, k_pos)
    _BLOCK_CACHE[key] = (q_pos, k_pos, blocks)
    if len(_BLOCK_CACHE) > _BLOCK_CACHE_SIZE:
        _BLOCK_CACHE.popitem(last=False)
    return blocks


# ----------------------------------------------------------------------------- per-block attention
class BlockOps(NamedTuple):
    """forward(q, k, v, causal, scale) -> (out [B,Sq,Hq,D] in q's dtype, lse [B,Hq,Sq] float32);
    backward(do, q, k, v, out, lse, causal, scale) -> float32 (dq, dk, dv), with out/lse of the whole row."""

    name: str
    forward: Callable
    backward: Callable


def _block_positions(sq: int, sk: int, causal: bool, device: torch.device) -> tuple[Tensor, Tensor]:
    k_pos = torch.arange(sk, device=device)
    q_pos = torch.arange(sq, device=device) + (0 if causal else sk)
    return q_pos, k_pos


def _reference_forward(q, k, v, causal, scale):
    q_pos, k_pos = _block_positions(q.shape[1], k.shape[1], causal, q.device)
    return torch_backend.forward(q, k, v, None, q_pos, k_pos, scale, q.dtype)


def _reference_backward(do, q, k, v, out, lse, causal, scale):
    """Like cuDNN: delta = rowsum(dO * O) from the out it is given (the whole row's)."""
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    delta = (do.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)
    q_pos, k_pos = _block_positions(q.shape[1], k.shape[1], causal, q.device)
    return torch_backend.backward(do, q, k, v, lse, delta, None, q_pos, k_pos, scale)


REFERENCE = BlockOps("reference", _reference_forward, _reference_backward)

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
_LSE_DIMS: list[int] = []  # the logsumexp rank the forward returned (3 or 4), for the backward
# cuDNN's dense path is not relied on for Hq != Hkv: K/V heads are expanded for the call (only there;
# K/V travel the ring with their own heads) and dK/dV summed over each group. Set
# MTRAINING_CUDNN_NATIVE_GQA=1 to pass GQA shapes through (tests/test_dense_blocks_cuda.py probes it).
NATIVE_GQA = os.environ.get("MTRAINING_CUDNN_NATIVE_GQA", "0") == "1"


def _aten(name: str):
    """torch.ops.aten.<name> (one seam: CPU tests stand a fake cuDNN op in here)."""
    return getattr(torch.ops.aten, name)


def _schema_names(op) -> list[str]:
    return [a.name for a in op.default._schema.arguments]


def cudnn_available() -> bool:
    """cuDNN attention ops present with the argument lists this module calls them with."""
    try:
        return (
            torch.backends.cudnn.is_available()
            and _schema_names(_aten("_scaled_dot_product_cudnn_attention")) == _FWD_ARGS
            and _schema_names(_aten("_scaled_dot_product_cudnn_attention_backward")) == _BWD_ARGS
        )
    except (AttributeError, RuntimeError):
        return False


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
    if not _LSE_DIMS:
        _LSE_DIMS.append(lse.dim())
    if lse.dim() == 4:
        lse = lse.squeeze(-1)
    return out.transpose(1, 2), lse.float()


def _cudnn_backward(do, q, k, v, out, lse, causal, scale):
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    lse = lse.float().contiguous()
    if not _LSE_DIMS or _LSE_DIMS[0] == 4:
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


# ----------------------------------------------------------------------------- selection
_override: list[str] = []


@contextlib.contextmanager
def dense_backend(name: str) -> Iterator[None]:
    """Within the block, dense calls take ``name`` (see the module docstring) whatever the environment says."""
    _check_setting(name)
    _override.append(name)
    try:
        yield
    finally:
        _override.pop()


def _check_setting(name: str) -> str:
    if name not in DENSE_BACKENDS:
        raise ValueError(
            f"dense backend must be one of {DENSE_BACKENDS} (set {ENV_VAR} or dense_backend()), got {name!r}"
        )
    return name


def dense_setting() -> str:
    """The active dense backend: dense_backend()'s, else $MTRAINING_DENSE_BACKEND, else 'auto'."""
    return _check_setting(_override[-1] if _override else os.environ.get(ENV_VAR, "auto") or "auto")


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


# ----------------------------------------------------------------------------- forward / backward
def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def forward(
    q: Tensor, k: Tensor, v: Tensor, blocks: tuple[Block, ...], scale: float, out_dtype: torch.dtype, ops: BlockOps
) -> tuple[Tensor, Tensor]:
    """(out [B, Sq, Hq, D] in out_dtype, lse [B, Hq, Sq]) of the chunk pair; 0 / -inf for rows seeing no key."""
    b, sq, hq, d = q.shape
    acc = _acc(q.dtype)
    if len(blocks) == 1 and blocks[0].q0 == 0 and blocks[0].q1 == sq:
        blk = blocks[0]
        o, lse = ops.forward(q, k[:, blk.k0 : blk.k1], v[:, blk.k0 : blk.k1], blk.causal, scale)
        return o.to(out_dtype), lse.to(acc)
    out = torch.zeros(b, sq, hq, d, dtype=acc, device=q.device)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=acc, device=q.device)
    written: list[Block] = []
    for blk in blocks:
        rows = slice(blk.q0, blk.q1)
        o, part = ops.forward(q[:, rows], k[:, blk.k0 : blk.k1], v[:, blk.k0 : blk.k1], blk.causal, scale)
        if any(w.q0 < blk.q1 and blk.q0 < w.q1 for w in written):
            torch_backend.merge_partial(out[:, rows], lse[:, :, rows], o, part.to(acc))
        else:  # first block of these rows: a copy, no merge
            out[:, rows] = o
            lse[:, :, rows] = part
        written.append(blk)
    return out.to(out_dtype), lse


def backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    blocks: tuple[Block, ...],
    scale: float,
    ops: BlockOps,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) float32 (float64 for float64 inputs) of the chunk pair's pairs; out/lse are the whole rows'."""
    acc = _acc(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for blk in blocks:
        rows, cols = slice(blk.q0, blk.q1), slice(blk.k0, blk.k1)
        gq, gk, gv = ops.backward(
            do[:, rows], q[:, rows], k[:, cols], v[:, cols], out[:, rows], lse[:, :, rows], blk.causal, scale
        )
        dq[:, rows] += gq
        dk[:, cols] += gk
        dv[:, cols] += gv
    return dq, dk, dv

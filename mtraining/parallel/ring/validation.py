"""Validation of a ring call: its inputs on this rank, and that every rank makes the same call."""

from __future__ import annotations

import os

import torch
from torch import Tensor

from ...ops.checks import check_pattern
from ...ops.estimate import PatternConfig
from ...ops.pattern import VerticalSlashPattern
from ...ops.sparse.attention import check_backend_inputs
from ..agreement import documents_field
from ..layout import Layout


def call_fields(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: Layout,
    pattern: VerticalSlashPattern | None,
    pattern_config: PatternConfig | None,
    softmax_scale: float | None,
    backend: str,
    layer_idx: int,
    ring: str,
    inner_size: int | None,
    reuse: bool,
    documents: object,
) -> dict[str, object]:
    """What every rank of a ring call must share (``agreement.check_ranks_agree``), from this rank's
    arguments. The pattern enters by its grid and shape, not its contents (read on the device); the
    documents by their boundaries' digest."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return {
        "q shape": tuple(q.shape),
        "k shape": tuple(k.shape),
        "v shape": tuple(v.shape),
        "dtype": str(q.dtype),
        "device type": q.device.type,
        "layout": layout,
        "pattern (seq_len, block, batch, heads)": None
        if pattern is None
        else (pattern.seq_len, pattern.block_size, pattern.batch, pattern.heads),
        "pattern_config": pattern_config,
        "softmax_scale": softmax_scale,
        "backend": backend,
        "layer_idx": layer_idx,
        "ring": ring,
        "inner_size": inner_size,
        "LOCAL_WORLD_SIZE": os.environ.get("LOCAL_WORLD_SIZE") if ring == "hierarchical" else None,
        "reuse": reuse,
        "gradients": grad,
        "documents": documents_field(documents),
    }


def check_arguments(q: object, k: object, v: object, layout: object) -> None:
    """The arguments the agreement check reads must be tensors and a layout."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a Layout (make_layout(...)), got {type(layout).__name__}")


def check_ring_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    world_size: int,
    layout: Layout,
    pattern: VerticalSlashPattern | None,
    pattern_config: PatternConfig | None,
    backend: str,
) -> None:
    """This rank's shards, the layout and the pattern fit one another (ValueError naming the fix)."""
    if pattern is not None and pattern_config is not None:
        raise ValueError(
            "pass either pattern (a global VerticalSlashPattern) or pattern_config (to estimate one), not both"
        )
    if layout.world_size != world_size:
        raise ValueError(
            f"layout is for {layout.world_size} ranks but the process group has {world_size}; "
            f"build it with make_layout({layout.name!r}, {layout.seq_len}, {world_size}, {layout.block_size}) "
            "or pass the matching group"
        )
    check_backend_inputs(q, k, v, backend)
    for name, t in (("q", q), ("k", k)):
        if t.shape[1] != layout.local_len:
            raise ValueError(
                f"{name} holds {t.shape[1]} tokens per rank but the {layout.name} layout of seq_len "
                f"{layout.seq_len} over {world_size} ranks gives {layout.local_len}; shard the full sequence "
                "with layout.shard(x, rank)"
            )
    if pattern is None:
        return
    if pattern.seq_len != layout.seq_len:
        raise ValueError(
            f"pattern is for seq_len {pattern.seq_len} but the layout for {layout.seq_len}; estimate the "
            "pattern on the same global sequence the layout splits"
        )
    check_pattern(pattern, q, (0, layout.seq_len - 1))
    layout.check_pattern_block(pattern.block_size)

"""The memory estimate of ``mtraining check`` (train/estimate.py): what sparse attention holds beyond dense."""

from __future__ import annotations

import torch

from mtraining.models import build_model
from mtraining.ops.estimate.estimator import estimate_pattern
from mtraining.ops.sparse.attention import sparse_attention
from mtraining.train.config import parse_config
from mtraining.train.estimate import GPUS, ModelShape, memory_per_gpu, sparse_attention_bytes
from tests.configs import TINY
from tests.factories import make_qkv
from tests.memory import tensor_bytes

ATTENTION = {"block_size": 16, "backend": "triton", "v_size": 16, "s_size": 32, "last_q": 16, "local_window": 16}


def _config(sparse: bool, seq_len: int = 256, context: int = 1):
    return parse_config(
        {
            "model": {"config": TINY, "dtype": "float32"},
            "attention": {**ATTENTION, "sparse": sparse},
            "parallel": {"context": context},
            "data": {"sources": ["unused.jsonl"], "seq_len": seq_len},
            "train": {"steps": 1, "device": "cuda"},
        }
    )


def _shape() -> ModelShape:
    with torch.device("meta"):
        return ModelShape.of(build_model(config=TINY))


def test_the_estimate_counts_what_sparse_attention_holds_beyond_dense():
    shape = _shape()
    dense, sparse = _config(False), _config(True)
    extra = sparse_attention_bytes(sparse, shape)
    assert sparse_attention_bytes(dense, shape) == 0 and extra > 0
    gpu = GPUS["h200"]
    names = [name for name, _, _ in memory_per_gpu(sparse, shape, gpu).terms]
    assert any("kernel walks" in name for name in names), names
    assert memory_per_gpu(sparse, shape, gpu).total == memory_per_gpu(dense, shape, gpu).total + extra


def test_the_estimate_bounds_a_layers_pattern_and_walks():
    """One sparse layer's pattern and the walks its forward and backward build (Triton kernels, interpreted)
    stay within the formula's share of one layer: its pattern plus one layer's walks."""
    cfg, shape = _config(True), _shape()
    n, heads, kv = cfg.data.seq_len, shape.heads, shape.kv_heads
    q, k, v = (t.requires_grad_() for t in make_qkv(1, n, n, heads, kv, 16, torch.float32, 0)[:3])
    pattern = estimate_pattern(q.detach(), k.detach(), cfg.attention.pattern_config(), softmax_scale=0.25)
    sparse_attention(q, k, v, pattern, softmax_scale=0.25, backend="triton").sum().backward()
    held = tensor_bytes(vars(pattern) | {"index_cache": None}) + tensor_bytes(pattern.index_cache._entries)
    positions = 2 * n * 4  # the chunk pair's q and k positions: the cache's key, the plan's
    one_layer = sparse_attention_bytes(cfg, shape) - (shape.layers - 1) * _pattern_bytes(cfg, shape)
    assert 0.9 * one_layer <= held - positions <= one_layer, (held - positions, one_layer)


def _pattern_bytes(cfg, shape: ModelShape) -> int:
    """One layer's pattern as the formula counts it."""
    blocks = -(-cfg.data.seq_len // cfg.attention.block_size)
    diags = min(blocks, 2 * cfg.attention.s_size)
    return shape.heads * (diags + cfg.attention.v_size + 2) * 4

"""What sparse attention holds for the backward, against dense attention at the same size.

Sparse attention may hold its pattern beyond what dense attention holds, and nothing else: the same
tensors saved for the backward (q, k, v, out, lse), and no cached kernel walks piling up over the layers
(models/attention.py, "Memory"). The kernels run in Triton's interpreter, whose walks are what the GPU builds.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import mtraining.ops.sparse.launch as launch
from mtraining.models import Attention, bind, build_model
from mtraining.ops.estimate.estimator import PatternConfig
from mtraining.ops.pattern import VerticalSlashPattern
from tests.configs import SMALL
from tests.factories import make_qkv
from tests.memory import tensor_bytes

SPARSE = PatternConfig(v_size=8, s_size=16, last_q=16, block_size=16, sink_tokens=2, local_window=16)


def _held_for_backward(pattern_config: PatternConfig | None) -> tuple[int, int, int]:
    """(bytes saved for the backward, bytes the graph node holds besides them, bytes of the pattern itself) of
    one checkpointed forward of a layer's attention (Triton kernels, float32)."""
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 128, 128, 4, 2, 16, torch.float32, 0)[:3])
    attention = Attention(pattern_config=pattern_config, max_density=None, backend="triton", checkpointed=True)
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.untyped_storage().nbytes())
        return t

    with attention.forward(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = attention.attend(0, q, k, v, 0.25)
    kept = attention._kept.patterns.get(0)
    pattern = 0 if kept is None else tensor_bytes(vars(kept) | {"index_cache": None})
    held = tensor_bytes(vars(out.grad_fn))  # the op's context: its plan (positions, pattern, dense blocks)
    return sum(saved), held, pattern


def test_sparse_holds_no_more_than_dense_beyond_its_pattern():
    sparse_saved, sparse_held, pattern = _held_for_backward(SPARSE)
    dense_saved, dense_held, _ = _held_for_backward(None)
    assert pattern > 0 and sparse_saved == dense_saved
    assert sparse_held <= dense_held + pattern, (sparse_held, dense_held, pattern)


def _walks_alive() -> int:
    """Patterns alive whose kernel walks are cached."""
    gc.collect()
    return sum(len(p.index_cache) > 0 for p in gc.get_objects() if type(p) is VerticalSlashPattern)


@pytest.mark.slow
def test_checkpointed_layers_keep_the_walks_of_one_layer_at_a_time(monkeypatch):
    """Three checkpointed sparse layers: no walks kept after the forward; during the backward only the layer
    being differentiated holds its walks (not every layer done so far)."""
    torch.manual_seed(0)
    model = build_model(config={**SMALL, "model_type": "qwen2", "num_hidden_layers": 3, "hidden_size": 64})
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer)
    attention = bind(model, Attention(pattern_config=SPARSE, max_density=None, backend="triton", checkpointed=True))
    ids = torch.randint(0, SMALL["vocab_size"], (1, 128), generator=torch.Generator().manual_seed(0))
    with attention.forward():
        loss = model(input_ids=ids, use_cache=False).logits.pow(2).mean()
    assert _walks_alive() == 0
    alive, real = [], launch.backward

    def counted(*args, **kwargs):
        alive.append(_walks_alive())
        return real(*args, **kwargs)

    monkeypatch.setattr(launch, "backward", counted)
    with attention.recompute():
        loss.backward()
    assert len(alive) == 3 and max(alive) == 1, alive
    assert _walks_alive() == 0

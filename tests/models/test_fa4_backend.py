"""A model's attention on ``backend="fa4"`` (models/attention.py, ``Attention.backend``): each sparse single-device
call inside fa4's scope runs on fa4, every other call on "triton"; refused with context parallelism.

FlashAttention-4 needs CUDA, so ``fa4.FA4`` is monkeypatched to the split with ``TorchBlocks`` (tests/fa4_blocks.py)
as its block part: the whole fa4 path (tile lists, the Triton kernels' verticals in the interpreter, the merge) runs
on the CPU in float32.
"""

from __future__ import annotations

import pytest
import torch

from mtraining.models import Attention, attention, bind, build_model
from mtraining.ops import Documents, VerticalSlashPattern
from mtraining.ops.estimate.estimator import PatternConfig
from mtraining.ops.sparse import fa4
from mtraining.parallel.layout import make_layout
from tests.configs import SMALL
from tests.fa4_blocks import TorchBlocks
from tests.factories import make_qkv
from tests.numerics import rel_err

N = 256  # two blocks of 128, the smallest pattern block fa4 takes
SPARSE = PatternConfig(v_size=16, s_size=16, last_q=16, block_size=128, sink_tokens=2, local_window=16)
MODEL = {**SMALL, "model_type": "qwen2", "hidden_size": 64}  # head dim 16: one the Triton kernels take


@pytest.fixture
def backends(monkeypatch) -> list[str]:
    """fa4 on the CPU (``TorchBlocks`` for FA4), and the backend of every single-device call the models make."""
    monkeypatch.setattr(fa4, "FA4", fa4.SplitBackend(TorchBlocks(), tile=32))
    seen, real = [], attention.sparse_attention

    def recorded(*args, **kwargs):
        seen.append(kwargs["backend"])
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "sparse_attention", recorded)
    return seen


def _attend(att: Attention, n_q: int = N, documents: Documents | None = None) -> None:
    q, k, v, _ = make_qkv(1, N, N, 4, 2, 16, torch.float32, gen=3)
    with att.forward(record="off", documents=documents):
        att.attend(0, q[:, N - n_q :], k, v, 0.25)


def _with_a_column() -> VerticalSlashPattern:
    """The main block diagonal, and key 0 as a column of the second block's rows."""
    diag = torch.zeros(1, 4, N // 128, dtype=torch.bool)
    diag[..., 0] = True
    columns = torch.full((1, 4, N // 128, 1), -1)
    columns[:, :, 1, 0] = 0
    return VerticalSlashPattern.from_masks(diag, torch.zeros(1, 4, N, dtype=torch.bool), 128).with_block_columns(
        columns
    )


@pytest.mark.parametrize(
    "case, backend",
    [
        ("sparse", "fa4"),
        ("dense layer", "triton"),
        ("short sequence", "triton"),
        ("fewer queries", "triton"),
        ("documents", "triton"),
        ("one document", "fa4"),
        ("columns", "triton"),
    ],
)
def test_calls_outside_fa4s_scope_run_on_triton(backends, monkeypatch, case, backend):
    settings: dict = dict(pattern_config=SPARSE, max_density=None, backend="fa4")
    if case == "dense layer":
        settings["dense_layers"] = frozenset({0})
    elif case == "short sequence":
        settings["min_sparse_len"] = N + 1
    elif case == "columns":  # the estimate at this size keeps every pair, which leaves no column: one made here
        monkeypatch.setattr(attention, "estimate_pattern", lambda *args, **kwargs: _with_a_column())
    starts = {"documents": [0, 100], "one document": [0]}.get(case)
    documents = None if starts is None else Documents.from_cu_seqlens(torch.tensor([*starts, N]))
    _attend(Attention(**settings), N - 128 if case == "fewer queries" else N, documents)
    assert backends == [backend]


def test_fa4_is_refused_with_context_parallelism(monkeypatch):
    monkeypatch.setattr(Attention, "cp_size", property(lambda self: 2))
    with pytest.raises(ValueError, match="single-device calls only .* use backend='triton' with context parallelism"):
        Attention(layout=make_layout("striped", N, 2), pattern_config=SPARSE, backend="fa4")


@pytest.mark.slow
def test_a_model_on_fa4_matches_it_on_triton(backends):
    """Forward and backward of a tiny float32 model whose sparse layers run on fa4 (one dense layer, on triton)
    against the same model on triton: the same pattern, the sums in another order."""
    ids = torch.randint(0, SMALL["vocab_size"], (1, N), generator=torch.Generator().manual_seed(0))
    results = {}
    for backend in ("triton", "fa4"):
        torch.manual_seed(0)
        model = build_model(config={**MODEL, "num_hidden_layers": 3})
        att = bind(
            model, Attention(pattern_config=SPARSE, max_density=None, dense_layers=frozenset({1}), backend=backend)
        )
        with att.forward(record="off"):
            logits = model(input_ids=ids, use_cache=False).logits
        logits.pow(2).mean().backward()
        results[backend] = logits.detach(), {name: p.grad for name, p in model.named_parameters()}
    assert backends[-3:] == ["fa4", "triton", "fa4"]  # layers 0 and 2 sparse on fa4, layer 1 dense on triton
    (logits, grads), (logits_fa4, grads_fa4) = results["triton"], results["fa4"]
    assert rel_err(logits_fa4, logits) < 1e-5
    for name, grad in grads.items():
        assert rel_err(grads_fa4[name], grad) < 1e-4, name

"""The trainer <-> attention protocol (mtraining.models.Attention): forward, recompute, end_step.

A tiny float64 Qwen2 with sparse attention on both layers. The forward keeps each layer's pattern
(and with save_outputs its (out, lse)) for the recompute of activation checkpointing, which takes
them back instead of estimating or attending again; with several micro-batches per step each
forward is paired with its own recompute, so the gradients equal those of the same model without
checkpointing.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import mtraining.ops.sparse.attention as sparse_ops
from mtraining.models import Attention, attention, bind, build_model
from mtraining.ops.estimate.estimator import PatternConfig
from mtraining.train.loss import CausalLMLoss
from tests.configs import SMALL
from tests.numerics import sdpa_by_document

MODEL = dict(model_type="qwen2", **SMALL)
SPARSE = PatternConfig(v_size=8, s_size=16, last_q=8, block_size=16, sink_tokens=2, local_window=16)


def _model(checkpointed: bool, **settings) -> tuple[torch.nn.Module, Attention]:
    """The seeded model (its decoder layers wrapped as the trainer wraps them when ``checkpointed``), bound."""
    torch.manual_seed(0)
    model = build_model(config=MODEL).double()
    if checkpointed:
        layers = model.model.layers
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer)
    settings = dict(pattern_config=SPARSE, max_density=None) | settings
    return model, bind(model, Attention(checkpointed=checkpointed, **settings))


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 96, (1, 64), generator=torch.Generator().manual_seed(seed))


def _counting(monkeypatch, name: str) -> list[int]:
    """Count the calls of ``name`` in models/attention.py (one list entry per call)."""
    calls, real = [], getattr(attention, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, name, counted)
    return calls


def test_recompute_takes_back_the_forward_patterns(monkeypatch):
    """The forward keeps one pattern per sparse layer; a forward run inside recompute() takes them back
    (no estimation) and gives the forward's output; each pattern is taken back once."""
    model, att = _model(checkpointed=True)
    ids = _ids(0)
    with att.forward():
        first = model(input_ids=ids, use_cache=False).logits
    estimates = _counting(monkeypatch, "estimate_pattern")
    with att.recompute():
        assert torch.equal(model(input_ids=ids, use_cache=False).logits, first)
        with pytest.raises(RuntimeError, match="layer 0 is recomputed but the last forward kept nothing"):
            model(input_ids=ids, use_cache=False)
    assert estimates == []


def test_recompute_takes_back_saved_outputs(monkeypatch):
    """With save_outputs the recomputed forward runs no attention kernel: the saved (out, lse) come back."""
    model, att = _model(checkpointed=True)
    ids = _ids(0)
    with att.forward(save_outputs=True):
        first = model(input_ids=ids, use_cache=False).logits

    def no_attention(*args, **kwargs):
        raise AssertionError("the recompute must not run attention again")

    monkeypatch.setattr(sparse_ops, "attention_forward", no_attention)
    with att.recompute():
        assert torch.equal(model(input_ids=ids, use_cache=False).logits, first)


@pytest.mark.slow
@pytest.mark.parametrize("save_outputs", [False, True])
def test_checkpointed_micro_batches_equal_the_plain_model(monkeypatch, save_outputs):
    """Three micro-batches of different tokens accumulated as the trainer does (forward, then the backward
    inside recompute): the checkpointed model's gradients are bit-identical to the plain model's, every
    layer estimates once per micro-batch, and end_step reports the last micro-batch's stats."""
    batches = [_ids(seed) for seed in (1, 2, 3)]
    results = {}
    for checkpointed in (False, True):
        model, att = _model(checkpointed=checkpointed)
        loss_model = CausalLMLoss(model, chunk_tokens=50)
        estimates = _counting(monkeypatch, "estimate_pattern")
        for m, ids in enumerate(batches):
            last = m == len(batches) - 1
            with att.forward(record="recall" if last else "density", save_outputs=save_outputs and checkpointed):
                loss = loss_model(ids[:, :-1], ids[:, 1:], torch.arange(63)[None])
            with att.recompute():
                loss.backward()
        grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()}
        results[checkpointed] = (grads, att.end_step(), len(estimates))
        monkeypatch.undo()
    (plain, plain_stats, plain_estimates), (ckpt, ckpt_stats, ckpt_estimates) = results[False], results[True]
    assert plain_estimates == ckpt_estimates == 2 * len(batches)
    assert ckpt.keys() == plain.keys() and all(torch.equal(ckpt[name], grad) for name, grad in plain.items())
    assert ckpt_stats == plain_stats and sorted(ckpt_stats.layers) == [0, 1]
    assert all(0 < s.density < 1 and 0 < s.recall < 1 for s in ckpt_stats.layers.values())  # the last: recall
    assert att.end_step().layers == {}  # forgotten


@pytest.mark.slow
def test_stats_are_recorded_as_asked():
    """record="off" records nothing, "density" no recall; a model run outside any block records nothing."""
    model, att = _model(checkpointed=False)
    ids = _ids(0)
    with att.forward(record="off"):
        model(input_ids=ids, use_cache=False)
    model(input_ids=ids, use_cache=False)
    assert att.end_step().layers == {}
    with att.forward(record="density"):
        model(input_ids=ids, use_cache=False)
    stats = att.end_step()
    assert stats.recall is None and 0 < stats.density < 1 and stats.dense_fallback == 0


def test_recall_measures_the_rows_of_the_forward_seed(monkeypatch):
    """forward(record="recall", seed=s): every sparse layer's recall is pattern_recall's with seed s (the trainer
    passes the step), so the same seed gives the same figures and another seed other rows."""
    seeds, real = [], attention.pattern_recall

    def spied(*args, seed):
        seeds.append(seed)
        return real(*args, seed=seed)

    monkeypatch.setattr(attention, "pattern_recall", spied)
    model, att = _model(checkpointed=False)
    ids = _ids(0)
    recalls = {}
    for seed in (5, 5, 6):
        with att.forward(record="recall", seed=seed):
            model(input_ids=ids, use_cache=False)
        recalls.setdefault(seed, []).append([s.recall for s in att.end_step().layers.values()])
    assert seeds == [5, 5, 5, 5, 6, 6]  # two sparse layers per forward
    assert recalls[5][0] == recalls[5][1] and recalls[5][0] != recalls[6][0], recalls


def test_misuse_fails_clearly():
    model, att = _model(checkpointed=True)
    ids = _ids(0)
    with pytest.raises(ValueError, match="save_outputs needs checkpointed layers"):
        with _model(checkpointed=False)[1].forward(save_outputs=True):
            pass
    with att.forward():
        with pytest.raises(RuntimeError, match="do not nest"):
            with att.recompute():
                pass
        with pytest.raises(RuntimeError, match="after the step"):
            att.end_step()
        model(input_ids=ids, use_cache=False)
    with pytest.raises(RuntimeError, match="before the last forward's backward ran inside attention.recompute"):
        with att.forward():
            pass
    with att.recompute():
        pass
    with torch.no_grad(), att.forward():  # no backward will follow: nothing is kept
        model(input_ids=ids, use_cache=False)
    with att.forward():  # so a forward may follow
        model(input_ids=ids, use_cache=False)


@pytest.mark.slow
def test_documents_of_a_forward_reach_its_recompute(monkeypatch):
    """forward(documents=) masks each document and keeps the documents for its recompute: the recomputed
    forward equals the forward, and both equal the model run on each document alone."""
    from mtraining.ops import Documents

    model, att = _model(checkpointed=True)
    ids = _ids(0)
    lengths = [20, 30, 14]
    docs = Documents.from_lengths(lengths)
    seen = []
    real = attention.sparse_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("documents"))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "sparse_attention", spy)
    with att.forward(documents=docs):
        first = model(input_ids=ids, use_cache=False).logits
    with att.recompute():
        again = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(again, first) and seen == [docs] * 4
    dense, dense_att = _model(checkpointed=False, pattern_config=None)
    with dense_att.forward(documents=docs):
        packed = dense(input_ids=ids, use_cache=False).logits
    start = 0
    for n in lengths:
        alone = dense(input_ids=ids[:, start : start + n], use_cache=False).logits
        torch.testing.assert_close(packed[:, start : start + n], alone, rtol=1e-6, atol=1e-7)  # RoPE: float32 angles
        start += n
    with dense_att.forward():  # without documents the later documents see the earlier ones
        assert not torch.allclose(dense(input_ids=ids, use_cache=False).logits[:, 20:], packed[:, 20:], atol=1e-3)


# --------------------------------------------------------------------------- documents from position ids
# per batch row: (document lengths, the position id each document starts at); issue 34.2
POSITION_LAYOUTS = {
    "restart at 0": [([30, 41, 25], [0, 0, 0])],
    "restart elsewhere": [([30, 41, 25], [0, 5, 3])],
    "first document cut": [([30, 41, 25], [7, 0, 12])],
    "rows differ": [([30, 41, 25], [0, 5, 0]), ([64, 32], [0, 9])],
    "one document": [([96], [10])],
    "tokens alone": [([1] * 96, [0] * 96)],
}


def _position_ids(layout: list) -> tuple[torch.Tensor, list[list[int]]]:
    """Packed position ids [B, S] of ``layout`` (POSITION_LAYOUTS) and each row's document lengths."""
    rows = [torch.cat([torch.arange(n) + first for n, first in zip(*row)]) for row in layout]
    return torch.stack(rows), [row[0] for row in layout]


@pytest.mark.parametrize("name", sorted(POSITION_LAYOUTS))
def test_position_ids_mark_documents_where_they_do_not_continue(name):
    """One device: a document starts wherever a position id does not continue the previous one (flash-attention's
    varlen convention), whatever value it restarts at; each equals SDPA run on that document alone."""
    ids, lengths = _position_ids(POSITION_LAYOUTS[name])
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(ids.shape[0], ids.shape[1], h, 16, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    out = Attention().attend(0, q, k, v, 0.25, ids)
    torch.testing.assert_close(out, sdpa_by_document(q, k, v, lengths, 0.25), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "ids,match",
    [
        (torch.tensor([[0, 1, 2, -1, 0, 1]]), "position ids must be >= 0"),
        (torch.tensor([[0.0, 1.0, 2.0, 0.0, 1.0, 2.0]]), "integers"),
        (torch.arange(5)[None], r"position_ids \(1, 5\) do not fit"),
        (torch.arange(6).repeat(3, 1), r"position_ids \(3, 6\) do not fit"),
    ],
)
def test_position_ids_it_cannot_read_are_refused(ids, match):
    q = torch.randn(2, 6, 4, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match=match):
        Attention().attend(0, q, q[:, :, :2], q[:, :, :2], 0.25, ids)


def test_no_tokens_read_no_position_ids():
    q = torch.randn(1, 0, 4, 16, dtype=torch.float64)
    out = Attention().attend(0, q, q[:, :, :2], q[:, :, :2], 0.25, torch.zeros(1, 0, dtype=torch.long))
    assert out.shape == q.shape

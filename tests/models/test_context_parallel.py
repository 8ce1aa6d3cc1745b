"""The HF adapter under context parallelism: loss and gradients equal one process, every layout.

A tiny float64 Qwen2 (GQA 4:2) runs with attn_implementation="mtraining" on 2 and 4 gloo ranks;
each rank feeds its layout shard (tokens, labels, global position ids). The summed loss and the
gradients summed over ranks must equal the single-process run of the same model on the whole
sequence: dense, sparse with a full budget (= dense), and sparse with a small budget (= the
single-device sparse run, since the pattern is global). Recall and density must agree too.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mtraining.models import Attention, bind, build_model
from mtraining.ops.pattern.estimate import PatternConfig
from mtraining.parallel.layout import make_layout
from mtraining.train.launch import run_local
from mtraining.train.loss import CausalLMLoss
from mtraining.train.packing import shard_batch

SEQ, BLOCK, VOCAB = 256, 16, 64
MODEL = dict(
    model_type="qwen2",
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
FULL = PatternConfig(v_size=SEQ, s_size=SEQ, last_q=16, block_size=BLOCK, sink_tokens=4, local_window=16)
SMALL = PatternConfig(v_size=12, s_size=24, last_q=16, block_size=BLOCK, sink_tokens=4, local_window=16)
LAYOUTS = ("contiguous", "zigzag", "striped")


def _model():
    torch.manual_seed(0)
    return build_model(config=MODEL).double()


def _samples() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))


def _run(model, attention: Attention, ids, labels, pos) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict]:
    bind(model, attention)
    with attention.forward(record="recall"):
        loss = CausalLMLoss(model, chunk_tokens=100)(ids, labels, pos)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, attention.end_step().layers


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def _compare_on_ranks() -> dict:
    """Every case on this group; returns {case: (loss diff, max grad diff, max stats diff)}."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, samples = _model(), _samples()
    ids, labels, pos = samples[:, :-1], samples[:, 1:], torch.arange(SEQ)[None]
    references = {
        name: _run(model, Attention(pattern_config=cfg), ids, labels, pos)
        for name, cfg in (("dense", None), ("small", SMALL))
    }
    report = {}
    for layout_name in LAYOUTS:
        layout = make_layout(layout_name, SEQ, world, BLOCK)
        shard = shard_batch(samples, layout, rank)
        for case, cfg, ref in (("dense", None, "dense"), ("full", FULL, "dense"), ("small", SMALL, "small")):
            attention = Attention(group=dist.group.WORLD, layout=layout, pattern_config=cfg, backend="torch")
            loss, grads, stats = _run(model, attention, shard.input_ids, shard.labels, shard.position_ids)
            dist.all_reduce(loss)
            for g in grads.values():
                dist.all_reduce(g)
            ref_loss, ref_grads, ref_stats = references[ref]
            stats_diff = 0.0
            if case == "small":
                stats_diff = max(
                    max(abs(stats[i].density - ref_stats[i].density), abs(stats[i].recall - ref_stats[i].recall))
                    for i in ref_stats
                )
            if case == "full":
                stats_diff = max(max(abs(s.density - 1.0), abs(s.recall - 1.0)) for s in stats.values())
            report[(layout_name, case)] = (
                float((loss - ref_loss).abs() / ref_loss),
                _max_diff(grads, ref_grads),
                stats_diff,
            )
    return report


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_context_parallel_equals_single_process(world_size):
    report = run_local(_compare_on_ranks, world_size)[0]
    assert len(report) == 3 * len(LAYOUTS)
    for case, (loss_diff, grad_diff, stats_diff) in report.items():
        assert loss_diff < 1e-12, (case, loss_diff)
        assert grad_diff < 1e-10, (case, grad_diff)
        assert stats_diff < 1e-9, (case, stats_diff)


def test_single_device_sparse_small_budget_is_sparse_and_full_budget_is_dense():
    model, samples = _model(), _samples()
    ids, labels, pos = samples[:, :-1], samples[:, 1:], torch.arange(SEQ)[None]
    dense = _run(model, Attention(), ids, labels, pos)
    full = _run(model, Attention(pattern_config=FULL), ids, labels, pos)
    small = _run(model, Attention(pattern_config=SMALL), ids, labels, pos)
    assert float((full[0] - dense[0]).abs()) < 1e-10 and _max_diff(full[1], dense[1]) < 1e-10
    assert all(abs(s.recall - 1.0) < 1e-9 and s.density == 1.0 for s in full[2].values())
    assert all(0 < s.density < 1 and 0 < s.recall < 1 for s in small[2].values())
    assert float((small[0] - dense[0]).abs()) > 1e-6  # it really dropped pairs


@pytest.mark.slow
def test_dense_layers_and_min_sparse_len_fall_back_to_dense():
    model, samples = _model(), _samples()
    ids, labels, pos = samples[:, :-1], samples[:, 1:], torch.arange(SEQ)[None]
    dense = _run(model, Attention(), ids, labels, pos)
    by_layer = _run(model, Attention(pattern_config=SMALL, dense_layers=frozenset({0, 1})), ids, labels, pos)
    by_len = _run(model, Attention(pattern_config=SMALL, min_sparse_len=SEQ + 1), ids, labels, pos)
    one = _run(model, Attention(pattern_config=SMALL, dense_layers=frozenset({0})), ids, labels, pos)
    for run in (by_layer, by_len):
        assert torch.equal(run[0], dense[0]) and not run[2]
    assert set(one[2]) == {1}

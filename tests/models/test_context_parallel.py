"""The HF adapter under context parallelism: loss and gradients equal one process, every layout.

A tiny float64 Qwen2 (GQA 4:2) runs with attn_implementation="mtraining" on 2 and 4 gloo ranks;
each rank feeds its layout shard (tokens, labels, global position ids). The summed loss and the
gradients summed over ranks must equal the single-process run of the same model on the whole
sequence: dense, sparse with a full budget (= dense), and sparse with a small budget (= the
single-device sparse run, since the pattern is global). Recall and density must agree too.

Packed position ids mark documents under context parallelism as on one device (issue 34.2): the ranks read
them on the gathered global sequence, and each document's logits and gradients equal the model run on that
document alone.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.distributed as dist

from mtraining.models import Attention, bind, build_model
from mtraining.ops.estimate.estimator import PatternConfig
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


# --------------------------------------------------------------------------- documents from position ids
DOC_SEQ = 192  # a multiple of 2 * W * BLOCK for 2 and 3 ranks (zigzag)
DOC_IDS = {  # (document lengths, the position id each starts at): they cross the shards of every layout
    "restart at 0": ([70, 90, 32], [0, 0, 0]),
    "restart elsewhere": ([70, 90, 32], [0, 5, 3]),
}
DOC_FULL = dataclasses.replace(FULL, v_size=DOC_SEQ, s_size=DOC_SEQ)  # every pair: the dense result


def _logits_and_grads(model, ids, pos) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The model's logits and the gradients of their summed squares (no attention bound: one device, dense)."""
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    logits.square().sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


def _documents_from_position_ids_on_ranks() -> dict:
    """Per (ids, layout, case): max differences of the gathered logits and summed gradients against the model on
    each document alone, and the stats; with ids that count each shard's own positions, every rank's error."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    ids = torch.randint(0, VOCAB, (1, DOC_SEQ), generator=torch.Generator().manual_seed(2))
    report = {}
    for name, (lengths, firsts) in DOC_IDS.items():
        pos = torch.cat([torch.arange(n) + first for n, first in zip(lengths, firsts)])[None]
        bind(model, Attention())
        alone = [_logits_and_grads(model, ids[:, s : s + n], pos[:, s : s + n]) for s, n in _spans(lengths)]
        ref_logits = torch.cat([a[0] for a in alone], 1)
        ref_grads = {n: sum(a[1][n] for a in alone) for n in alone[0][1]}
        for layout_name in LAYOUTS:
            layout = make_layout(layout_name, DOC_SEQ, world, BLOCK)
            for case, cfg in (("dense", None), ("full", DOC_FULL)):
                attention = bind(
                    model, Attention(group=dist.group.WORLD, layout=layout, pattern_config=cfg, backend="torch")
                )
                block = attention.forward(record="recall") if cfg is not None else contextlib.nullcontext()
                with block:  # a user's plain call (dense), or the trainer's protocol without documents (full)
                    local = model(
                        input_ids=layout.shard(ids, rank), position_ids=layout.shard(pos, rank), use_cache=False
                    ).logits
                local.square().sum().backward()
                grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
                model.zero_grad(set_to_none=True)
                for g in grads.values():
                    dist.all_reduce(g)
                logits = layout.all_gather(local.detach(), None, dim=1)
                stats = attention.end_step().layers.values()
                report[(name, layout_name, case)] = (
                    float((logits - ref_logits).abs().max()),
                    max(float((grads[n] - ref_grads[n]).abs().max() / ref_grads[n].abs().max()) for n in grads),
                    [(s.density, s.recall) for s in stats],
                )
    layout = make_layout("striped", DOC_SEQ, world, BLOCK)
    bind(model, Attention(group=dist.group.WORLD, layout=layout, backend="torch"))
    try:  # no position_ids: Hugging Face counts each rank's shard from 0
        model(input_ids=layout.shard(ids, rank), use_cache=False)
        report["local ids"] = "no error"
    except ValueError as e:
        report["local ids"] = str(e)
    return report


def _spans(lengths: list[int]) -> list[tuple[int, int]]:
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0).tolist()
    return list(zip(starts, lengths))


@pytest.mark.parametrize("world_size", [2, 3])
def test_position_ids_mark_documents_under_context_parallelism(world_size):
    reports = run_local(_documents_from_position_ids_on_ranks, world_size)
    report = reports[0]
    assert len(report) == len(DOC_IDS) * len(LAYOUTS) * 2 + 1
    for key, value in report.items():
        if key == "local ids":
            continue
        logits_diff, grad_diff, stats = value
        assert logits_diff < 1e-10 and grad_diff < 1e-10, (key, logits_diff, grad_diff)
        if key[2] == "full":  # density and recall over the pairs within documents: all of them
            assert stats and all(abs(d - 1) < 1e-9 and abs(r - 1) < 1e-9 for d, r in stats), (key, stats)
    messages = {r["local ids"] for r in reports}
    assert len(messages) == 1, messages  # the same error on every rank
    assert f"count 0..{DOC_SEQ // world_size - 1} on each of the {world_size}" in messages.pop()

"""Evaluation through context parallelism (gloo ranks) equals the single-process evaluation.

A tiny float64 Qwen2 with large random weights (so greedy answers depend on the whole context)
gives per-token losses, teacher-forced greedy predictions and greedy answers on 2 and 4 ranks, in
several layouts, dense and sparse; they must match one process: the loss to float64 round-off, the
predictions and answers token for token.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mtraining.eval.answers import Prompting
from mtraining.eval.datafiles import infinitebench_samples, place, run_samples
from mtraining.eval.engine import Engine
from mtraining.eval.infinitebench import run_infinitebench
from mtraining.eval.loading import load_tokenizer
from tests.eval.official_samples import infinitebench_files
from tests.eval.tiny_engine import SEQ, G, inputs, spec, tiny_model

TOKENIZER = Path(__file__).resolve().parents[2] / "data" / "tokenizer.json"  # 512 tokens, as the model
NEW_TOKENS = 6
REFERENCE = [7, 70, 300, 11]  # a reference answer scored teacher-forced after each prompt


def evaluate(group, layout: str, sparse: bool, ring: str = "flat", context_mode: str = "ring"):
    """Worker (and reference with group=None): per-token losses and predictions, greedy answers and the teacher-forced
    scores of a reference answer, sparse densities."""
    engine = Engine(tiny_model(), spec(layout, sparse, context_mode, ring), group)
    ids, prompts = inputs()
    nll, predicted = engine.token_scores(ids)
    assert torch.equal(engine.token_nll(ids), nll)
    answers = [engine.respond(p, NEW_TOKENS, reference=REFERENCE) for p in prompts]
    return (nll, predicted), answers, engine.densities


def benchmark_answers(group, samples):
    """Worker (and reference with group=None): InfiniteBench answers, generated and from official files,
    through sparse striped context parallelism; the predictions and the densities of the prefills."""
    engine = Engine(tiny_model(), spec("striped", True), group)
    tokenizer = load_tokenizer(TOKENIZER)
    prompting = Prompting(samples=1, seed=3, show_progress=False)
    generated = run_infinitebench(engine, tokenizer, ["passkey", "math_find"], [512], prompting)
    files = run_samples(engine, tokenizer, samples, [256, 512], "files", show_progress=False)
    return [r["prediction"] for r in generated["records"] + files["records"]], engine.densities


@pytest.mark.slow
def test_benchmarks_on_two_ranks_answer_as_one(pool, tmp_path):
    """The paper's evaluation set (here InfiniteBench, generated and official records, one cut in the
    middle) runs through the context-parallel prefill and gives one process's answers on 2 gloo ranks."""
    samples = infinitebench_samples([infinitebench_files(tmp_path, filler=12)])
    samples = place(samples, [256, 512], load_tokenizer(TOKENIZER).count, truncate=True)
    assert any(s.prompt_tokens + s.max_new_tokens > 512 for s in samples)  # one prompt is cut
    reference, densities = benchmark_answers(None, samples)
    assert len(reference) == 2 + len(samples) and len(set(reference)) > len(reference) // 2
    assert len(densities) == len(reference)  # every prompt is prefilled through the sparse path
    assert max(densities) <= 1 and min(densities) < 0.6  # the long prefills really are sparse (short ones keep all)
    for answers, _ in pool.run(benchmark_answers, 2, samples):
        assert answers == reference


def unsplittable(group):
    engine = Engine(tiny_model(), spec("zigzag", False), group)
    try:
        engine.token_nll(torch.arange(SEQ + G))
    except ValueError as err:
        return str(err)
    return None


@pytest.fixture(scope="module")
def reference():
    return {sparse: evaluate(None, "striped", sparse) for sparse in (False, True)}


@pytest.mark.slow
@pytest.mark.parametrize(
    "world, layout, sparse, context_mode, ring",
    [
        (2, "striped", False, "ring", "flat"),
        (4, "zigzag", False, "ring", "flat"),
        (4, "contiguous", False, "ring", "flat"),
        (2, "zigzag", True, "ring", "flat"),
        (4, "striped", True, "ring", "flat"),
        (4, "contiguous", True, "ring", "hierarchical"),
        (2, "zigzag", False, "allgather", "flat"),
        (4, "striped", True, "allgather", "flat"),
    ],
)
def test_cp_matches_single_process(pool, reference, world, layout, sparse, context_mode, ring):
    """Every prompt padded to the layout's unit (32 to 128 tokens) answers as on one process, unpadded."""
    (ref_nll, ref_predicted), ref_answers, ref_density = reference[sparse]
    for (nll, predicted), answers, density in pool.run(evaluate, world, layout, sparse, ring, context_mode):
        assert nll.shape == predicted.shape == (SEQ - 1,)
        torch.testing.assert_close(nll, ref_nll, rtol=0, atol=1e-9)
        assert torch.equal(predicted, ref_predicted)
        for got, want in zip(answers, ref_answers, strict=True):
            assert got.tokens == want.tokens and got.forced.greedy == want.forced.greedy
            torch.testing.assert_close(torch.tensor(got.forced.nll), torch.tensor(want.forced.nll), rtol=0, atol=1e-9)
        if sparse:
            assert density[0] < 0.9  # the loss pass (256 tokens) really is sparse
    perplexity = torch.exp(ref_nll.mean())
    assert torch.isfinite(perplexity)


def test_predictions_are_the_argmax_of_the_model(reference):
    ids, _ = inputs()
    with torch.no_grad():
        logits = tiny_model()(input_ids=ids[None]).logits[0, :-1]
    nll, predicted = reference[False][0]
    assert torch.equal(predicted, logits.argmax(-1))
    expected = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="none")
    torch.testing.assert_close(nll, expected)  # float64 model: float64 losses (train.loss.token_scores)
    assert len(set(predicted.tolist())) > 10  # the predictions depend on the position


def test_sparse_differs_from_dense(reference):
    (dense_nll, _), _, dense_density = reference[False]
    (sparse_nll, _), _, _ = reference[True]
    assert not dense_density
    assert (dense_nll - sparse_nll).abs().max() > 1e-6


def test_answers_depend_on_the_context(reference):
    answers = [a.tokens for a in reference[False][1]]
    assert len({tuple(a) for a in answers}) == len(answers)
    assert all(len(a) == NEW_TOKENS for a in answers)


@pytest.mark.slow
def test_cp_length_must_split(pool):
    errors = pool.run(unsplittable, 2)
    assert all(e is not None and "multiples of 64" in e for e in errors)
    assert dist.is_available()


@pytest.mark.slow
def test_generation_equals_greedy_recomputation():
    """Prefill plus cached decoding answers exactly as re-running the model on the whole text each step."""
    model, (_, prompts) = tiny_model(), inputs()
    engine = Engine(model, spec("striped", sparse=False), None)
    for prompt in prompts:
        ids, expected = list(prompt), []
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                expected.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
                ids.append(expected[-1])
        assert engine.generate(prompt, NEW_TOKENS) == expected

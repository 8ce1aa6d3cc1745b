"""Answers read the whole prompt through the attention under test (``Engine.respond``).

- A pattern that hides the needle from the question fails retrieval, in generation and teacher-forced (beside
  generation or alone, without decoding), on one process and through the striped ring with a padding document; with
  the needle kept both find it.
- Every prompt token goes through the sparse attention; only generated tokens after the first decode dense.
- Dense attention answers as Hugging Face's greedy ``generate``, and teacher-forced losses are the model's own.
- Sparse teacher-forced scores are the float64 oracle's attention with the pattern the prompt alone estimates,
  on one process and on a ring: the reference answer cannot change the pattern the prompt is read with.
"""

from __future__ import annotations

import pytest
import torch

import mtraining.models.attention as attention_module
from mtraining.eval.answers import answer
from mtraining.eval.engine import DECODE_ATTENTION, AttentionSpec, Engine, Forced, _attn_implementation
from mtraining.eval.tasks import Sample
from mtraining.ops import attention_oracle
from tests.eval.needle import needle_model, needle_prompt
from tests.eval.tiny_engine import inputs, spec, tiny_model

G = 16
HIDDEN = dict(v_size=1, sink_tokens=1, s_size=16, local_window=16, last_q=16)  # the sink and the local window
KEPT = HIDDEN | dict(v_size=4)  # room for the needle's vertical
PROMPT, NEEDLE_AT, VALUE = 203, 57, 7
NEW_TOKENS = 6  # 203 % 16 != 0: a partial last block, and padding on a ring


def needle_engine(group, pattern: dict) -> Engine:
    spec = AttentionSpec(sparse=bool(pattern), layout="striped", block_size=G, backend="torch", pattern=pattern)
    return Engine(needle_model(), spec, group)


def retrieve(group, pattern: dict) -> tuple[list[int], bool, float, Forced]:
    """Worker (and one process with group=None): generated tokens, whether the teacher-forced needle is the
    greedy prediction and its loss, and the needle teacher-forced alone (one answer token: no decoding)."""
    engine, prompt = needle_engine(group, pattern), needle_prompt(PROMPT, NEEDLE_AT, VALUE)
    response = engine.respond(prompt, 2, reference=[VALUE])
    alone = engine.respond(prompt, 1, reference=[VALUE])
    return response.tokens, response.forced.all_greedy, response.forced.nll[0], alone.forced


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_a_pattern_that_hides_the_needle_fails_retrieval(pool, world):
    results = {
        name: [retrieve(None, pattern)] if world == 1 else pool.run(retrieve, world, pattern)
        for name, pattern in (("dense", {}), ("kept", KEPT), ("hidden", HIDDEN))
    }
    for name in ("dense", "kept"):
        for tokens, greedy, nll, alone in results[name]:
            assert tokens[0] == VALUE and greedy and nll < 0.1, name
            assert alone == Forced([nll], [greedy]), name
    for tokens, greedy, nll, alone in results["hidden"]:
        assert tokens[0] != VALUE and not greedy and nll > 3  # ln 64 = 4.16: every logit 0
        assert alone == Forced([nll], [greedy])


class _Ids:
    """The tokenizer of samples that carry their token ids: no stop ids, ids decoded as numbers."""

    stop_ids: list[int] = []

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def test_a_needle_teacher_forced_alone_is_read_as_beside_generation():
    """``answer(generate=False)`` prefills the same prompt and decodes nothing: its teacher-forced scores are the
    generated answer's, so a pattern that hides the needle fails both and one that keeps it passes both."""
    ids = needle_prompt(PROMPT, NEEDLE_AT, VALUE)
    sample = Sample("niah_single", PROMPT + 2, "", [str(VALUE)], 2, ids=ids, reference_ids=[VALUE])
    for pattern, found in ((KEPT, True), (HIDDEN, False)):
        engine = needle_engine(None, pattern)
        generated = answer(engine, _Ids(), sample)
        steps = engine.phases.decode_steps
        alone = answer(engine, _Ids(), sample, generate=False)
        assert steps == 1 and engine.phases.decode_steps == steps and engine.phases.prefills == 2
        assert alone.prediction is None and alone.forced == generated.forced
        assert generated.forced.all_greedy == found and (generated.prediction.split()[0] == str(VALUE)) == found


def test_every_prompt_token_goes_through_the_sparse_path(monkeypatch):
    """Per prefill, the sparse attention of every layer sees all prompt and reference rows; the dense decode
    sees only generated tokens (one per step, from the second on)."""
    sparse_rows, decoded = [], []
    original = attention_module.sparse_attention

    def counting(q, k, v, pattern=None, **kwargs):
        sparse_rows.append(q.shape[1] if pattern is not None else 0)
        return original(q, k, v, pattern, **kwargs)

    monkeypatch.setattr(attention_module, "sparse_attention", counting)
    engine = Engine(tiny_model(), spec("striped", sparse=True), None)
    engine.model.model.embed_tokens.register_forward_hook(lambda m, args, out: decoded.append(args[0].shape[1]))
    (_, prompts), layers = inputs(), engine.model.config.num_hidden_layers
    for prompt in prompts:
        for reference in ([], [5, 6, 7]):
            sparse_rows.clear(), decoded.clear()
            tokens = engine.respond(prompt, NEW_TOKENS, reference=reference).tokens
            assert sparse_rows == [len(prompt) + len(reference)] * layers
            assert decoded == [len(prompt) + len(reference)] + [1] * (len(tokens) - 1)


def test_dense_answers_are_hugging_face_generate():
    model, (_, prompts) = tiny_model(), inputs()
    engine = Engine(model, spec("striped", sparse=False), None)
    for prompt in prompts:
        with _attn_implementation(model, DECODE_ATTENTION):
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        assert engine.generate(prompt, NEW_TOKENS) == out[0, len(prompt) :].tolist()


def test_dense_teacher_forcing_is_the_model_loss():
    model, (_, prompts) = tiny_model(), inputs()
    engine = Engine(model, spec("striped", sparse=False), None)
    for prompt in prompts:
        reference = engine.generate(prompt, 4)
        reference[2] = (reference[2] + 1) % 512  # one token off the greedy path
        forced = engine.respond(prompt, 4, reference=reference).forced
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + reference])).logits[0, len(prompt) - 1 : -1]
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(reference), reduction="none")
        torch.testing.assert_close(torch.tensor(forced.nll, dtype=torch.float64), nll, rtol=1e-9, atol=1e-9)
        assert forced.greedy == [True, True, False, reference[3] == int(logits[3].argmax())]


def record_patterns(monkeypatch) -> list:
    """Every pattern the layers estimate (one device or a ring), in order."""
    seen = []
    for name in ("estimate_pattern", "estimate_pattern_cp"):
        original = getattr(attention_module, name)

        def recording(*args, _original=original, **kwargs):
            seen.append(_original(*args, **kwargs))
            return seen[-1]

        monkeypatch.setattr(attention_module, name, recording)
    return seen


def oracle_losses(model, ids: list[int], first: int, patterns: list) -> torch.Tensor:
    """-log p(ids[i + 1]) for i >= first of the model run on ``ids`` alone with each layer's attention the float64
    oracle on ``patterns[layer]`` (a pattern of a longer sequence: its pairs among these positions)."""
    layers = iter(patterns)

    def oracle(q, k, v, pattern=None, softmax_scale=None, return_lse=False, **kwargs):
        out, lse = attention_oracle(q, k, v, next(layers), softmax_scale=softmax_scale)
        return (out, lse) if return_lse else out

    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        patch.setattr(attention_module, "sparse_attention", oracle)
        logits = model(input_ids=torch.tensor([ids])).logits[0, first:-1]
    return torch.nn.functional.cross_entropy(logits, torch.tensor(ids[first + 1 :]), reduction="none")


COLUMNS = dict(v_size=8, s_size=24, last_q=16, local_window=16, sink_tokens=4, block_columns=4, column_bits=3)


def forced_with_patterns(group, reference):
    """Worker: teacher-forced scores of ``reference`` after the second prompt, sparse with block columns."""
    engine = Engine(tiny_model(), spec_with(COLUMNS), group)
    return engine.respond(inputs()[1][1], 3, reference=reference)


def spec_with(pattern: dict) -> AttentionSpec:
    return AttentionSpec(sparse=True, layout="striped", block_size=G, backend="torch", pattern=pattern)


def test_sparse_teacher_forcing_is_the_oracle_on_the_prompts_pattern(monkeypatch, pool):
    model, prompt = tiny_model(), inputs()[1][1]
    reference = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]  # 14 answer rows: some share the prompt's last block
    engine = Engine(model, spec_with(COLUMNS), None)
    seen = record_patterns(monkeypatch)
    alone = engine.respond(prompt, 3)
    prompt_patterns = list(seen)
    seen.clear()
    response = engine.respond(prompt, 3, reference=reference)
    pos = torch.arange(len(prompt))
    for mine, theirs in zip(seen, prompt_patterns, strict=True):  # the answer rows chose nothing
        assert torch.equal(mine.pair_mask(pos, pos), theirs.pair_mask(pos, pos))
    assert response.tokens == alone.tokens
    want = oracle_losses(model, prompt + reference, len(prompt) - 1, list(seen))
    torch.testing.assert_close(torch.tensor(response.forced.nll, dtype=torch.float64), want, rtol=1e-9, atol=1e-9)
    for ring in pool.run(forced_with_patterns, 2, reference):  # a padding document after the answer
        assert ring.tokens == response.tokens and ring.forced.greedy == response.forced.greedy
        torch.testing.assert_close(torch.tensor(ring.forced.nll, dtype=torch.float64), want, rtol=1e-9, atol=1e-9)

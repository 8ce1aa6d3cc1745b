"""``Engine.token_scores`` with packed documents: each document scored as if alone, and pattern recall recorded."""

from __future__ import annotations

import pytest
import torch

from mtraining.eval.engine import Engine
from mtraining.ops.documents import Documents
from tests.eval.tiny_engine import SEQ, TINY, inputs, spec, tiny_model

LENGTHS = (96, 64, 96)  # three packed documents, SEQ tokens in all


def test_packed_documents_score_as_each_alone():
    """Dense, with document masking: every document's losses and predictions are those of the document run
    alone (RoPE is relative, so the global positions change nothing but round-off; the losses are float32); without, they differ."""
    assert sum(LENGTHS) == SEQ
    ids, _ = inputs()
    engine = Engine(tiny_model(), spec("striped", sparse=False), None)
    nll, predicted = engine.token_scores(ids, Documents.from_lengths(LENGTHS))
    unmasked, _ = engine.token_scores(ids)
    start = 0
    for n in LENGTHS:
        alone_nll, alone_predicted = engine.token_scores(ids[start : start + n])
        end = start + n - 1  # the last token's next one lies in the next document
        torch.testing.assert_close(nll[start:end], alone_nll, rtol=1e-5, atol=1e-5)
        assert torch.equal(predicted[start:end], alone_predicted)
        start += n
    assert not torch.allclose(nll[LENGTHS[0] :], unmasked[LENGTHS[0] :])  # later documents saw earlier ones
    torch.testing.assert_close(nll[: LENGTHS[0] - 1], unmasked[: LENGTHS[0] - 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("documents", [None, Documents.from_lengths(LENGTHS)], ids=["unmasked", "masked"])
def test_sparse_prefill_records_recall(documents):
    ids, _ = inputs()
    engine = Engine(tiny_model(), spec("striped", sparse=True), None, record="recall")
    for _ in range(2):
        engine.token_scores(ids, documents)
    assert len(engine.densities) == len(engine.recalls) == 2
    assert all(0 < d < 1 for d in engine.densities) and all(0 < r <= 1 for r in engine.recalls)
    assert engine.recalls[0] != engine.recalls[1]  # each prefill draws its own rows (seed: its index)
    dense = Engine(tiny_model(), spec("striped", sparse=False), None, record="recall")
    dense.token_scores(ids, documents)
    assert dense.densities == dense.recalls == []


def test_record_must_be_known():
    with pytest.raises(ValueError, match="record must be"):
        Engine(tiny_model(), spec("striped", sparse=False), None, record="off")
    assert TINY["max_position_embeddings"] >= SEQ


def test_ids_beyond_the_embeddings_and_answers_of_no_tokens_are_refused():
    """A tokenizer with more ids than the model (another model's) crashed in the embedding (a device assert on
    a GPU); an answer budget of 0 tokens scored an empty answer."""
    engine = Engine(tiny_model(), spec("striped", sparse=False), None)
    beyond = [1, 2, TINY["vocab_size"]]
    with pytest.raises(ValueError, match=f"token id {TINY['vocab_size']} is beyond the model's 512 embeddings"):
        engine.token_scores(torch.tensor(beyond))
    with pytest.raises(ValueError, match="beyond the model's 512 embeddings: the tokenizer is not"):
        engine.generate(beyond, 4)
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1, got 0"):
        engine.generate([1, 2, 3], 0)

"""experiments/extension/query_position.py: the two placements hold the same tokens at the same length, and the answers
follow their tokens (the value asked for sits at every answer position, the question just before it)."""

from __future__ import annotations

from collections import Counter

import pytest

from experiments.extension import query_position as qp
from experiments.extension.recall_corpus import eval_set
from experiments.extension.settings import SCALES

pytestmark = pytest.mark.slow


def test_questions_end_the_document_or_lie_tail_tokens_before_its_end():
    scale, tail = SCALES["toy"], 40
    docs = eval_set(scale.vocab, scale.long - tail, 3, scale.eval_shape, scale.depths, 0)
    variants = qp.placed([(d.ids, d.answers, d.depths) for d in docs], tail, scale, 0)
    for doc, end, after in zip(docs, variants["end"], variants["tail"]):
        assert len(end[0]) == len(after[0]) == scale.long and Counter(end[0]) == Counter(after[0])
        assert end[0][0] == after[0][0] == scale.vocab.eos_id  # the sink stays first
        assert max(end[1]) == scale.long - 1 and max(after[1]) == scale.long - 1 - tail
        for ids, answers, _ in (end, after):  # each answer is the value stored with the key just before it
            for a, original in zip(answers, doc.answers):
                assert ids[a] == doc.ids[original] and ids[a - 2] == scale.vocab.query_id
                needle = ids.index(ids[a - 1])  # the key's first occurrence: its needle, then its value
                assert ids[needle + 1] == ids[a] and needle < a - 2

"""``Documents.estimate_end``: positions from it on take no part in estimating the pattern.

A prompt followed by a padding document (a layout splits only multiples of its unit) or by answer tokens
(scored teacher-forced) must be read with the pattern of the prompt alone: on the prompt's rows and keys the
kept pairs are those of the prompt estimated by itself, and the attention there is the float64 oracle's on the
prompt alone with that pattern.
"""

from __future__ import annotations

import pytest
import torch

from mtraining.ops import Documents, attention_oracle
from mtraining.ops.estimate.estimator import PatternConfig, document_sinks, estimate_pattern, scoring_rows
from mtraining.ops.sparse import sparse_attention
from tests.factories import make_qkv

G, N = 16, 75  # the prompt: not a multiple of G
B, HQ, HKV, D = 1, 4, 2, 16
CONFIG = dict(v_size=6, s_size=3, last_q=8, block_size=G, sink_tokens=2, local_window=2)
TAILS = {  # (tokens after the prompt, its Documents)
    "padding": (21, Documents.from_lengths([N, 21], estimate_end=N)),
    "answer": (9, Documents([[0]], N + 9, estimate_end=N)),
    "answer_and_padding": (21, Documents.from_lengths([N + 9, 12], estimate_end=N)),
}


@pytest.mark.parametrize("columns", [0, 5])
@pytest.mark.parametrize("tail", list(TAILS))
def test_prompt_rows_keep_the_pattern_of_the_prompt_alone(tail, columns):
    extra, documents = TAILS[tail]
    config = PatternConfig(**CONFIG, block_columns=columns, column_tables=4, column_bits=3)
    q, k, v, _ = make_qkv(B, N + extra, N + extra, HQ, HKV, D, gen=7)
    alone = estimate_pattern(q[:, :N], k[:, :N], config)
    padded = estimate_pattern(q, k, config, documents=documents)
    pos = torch.arange(N)
    assert torch.equal(padded.pair_mask(pos, pos), alone.pair_mask(pos, pos))
    out = sparse_attention(q, k, v, padded, documents=documents)[:, :N]
    want, _ = attention_oracle(q[:, :N], k[:, :N], v[:, :N], alone)
    torch.testing.assert_close(out, want.to(out.dtype), rtol=1e-10, atol=1e-10)
    # without estimate_end the tail's rows choose lines too: the prompt's pattern changes
    chosen = Documents(documents.starts, documents.seq_len)
    other = estimate_pattern(q, k, config, documents=None if chosen.single else chosen)
    assert not torch.equal(other.pair_mask(pos, pos), alone.pair_mask(pos, pos))


def test_scoring_rows_and_sinks_stop_at_the_end():
    documents = Documents.from_lengths([10, 30, 20, 4], estimate_end=35)
    pos, bound = scoring_rows(documents, 0, last_q=8)
    assert pos.tolist() == [2, 3, 4, 5, 6, 7, 8, 9, *range(27, 35)]
    assert bound.tolist() == [0] * 8 + [10] * 8
    sinks = document_sinks(documents, 3, torch.device("cpu"))[0, 0].nonzero().flatten().tolist()
    assert sinks == [0, 1, 2, 10, 11, 12]  # none from the documents at 40 and 60
    short = Documents.from_lengths([10, 30], estimate_end=11)  # the second document's first row only
    assert scoring_rows(short, 0, 8)[0].tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert document_sinks(short, 3, torch.device("cpu"))[0, 0].nonzero().flatten().tolist() == [0, 1, 2, 10]


def test_estimate_end_validation_and_identity():
    assert Documents([[0]], 20, estimate_end=20).single  # the end of the sequence: nothing left out
    assert not Documents([[0]], 20, estimate_end=19).single
    assert Documents([[0]], 20, 19).digest() != Documents([[0]], 20).digest()  # ranks agree on it too
    for bad in (0, 21, 3.0, True):
        with pytest.raises(ValueError, match="estimate_end must be"):
            Documents([[0]], 20, estimate_end=bad)

"""Inputs tokenised once: a sample carrying its token ids (``answers.tokenised``) and perplexity windows built from
ids (``ppl.Windows.of_ids``) are answered and scored exactly as from text, without tokenising again."""

from __future__ import annotations

from mtraining.eval.answers import answer, tokenised
from mtraining.eval.engine import Engine
from mtraining.eval.ppl import Windows, run_ppl
from mtraining.eval.tasks import Sample
from tests.eval.tiny_engine import TINY, spec, tiny_model


class CountingTokenizer:
    """Characters as ids (below the tiny model's vocabulary), counting the texts it encodes."""

    stop_ids: list[int] = []

    def __init__(self) -> None:
        self.encoded = 0

    def encode(self, text: str) -> list[int]:
        self.encoded += 1
        return [ord(c) % TINY["vocab_size"] for c in text]

    def continuation(self, prompt: str, text: str) -> list[int]:
        return self.encode(text)

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def test_a_tokenised_sample_is_answered_as_its_text_without_tokenising():
    tok = CountingTokenizer()
    engine = Engine(tiny_model(), spec("striped", sparse=False), None)
    sample = Sample("niah_single", 256, "The secret number of amber-heron is 1234567. " * 4, ["1234567"], 6)
    from_text = answer(engine, tok, sample)
    ready = tokenised(sample, tok)
    tok.encoded = 0
    from_ids = answer(engine, tok, ready)
    assert tok.encoded == 0
    assert from_ids == from_text and from_ids.forced is not None


def test_windows_of_ids_score_as_the_texts_without_tokenising():
    tok = CountingTokenizer()
    engine = Engine(tiny_model(), spec("striped", sparse=False), None)
    docs = ["abcdefgh" * 40, "the tide came in " * 20]
    from_text = run_ppl(engine, tok, docs, [64, 128], samples=2, first_bucket=16, show_progress=False)
    windows = Windows.of_ids([tok.encode(d) for d in docs], tok)
    tok.encoded = 0
    from_ids = run_ppl(engine, tok, windows, [64, 128], samples=2, first_bucket=16, show_progress=False)
    assert tok.encoded == 0 and from_ids == from_text

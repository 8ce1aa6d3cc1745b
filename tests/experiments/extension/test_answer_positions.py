"""experiments/extension/answer_positions.py: answers located on hand-made documents whose positions are computed here
independently, the filler count of a tiny packing by hand, and the script end to end at the toy-text scale."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.extension import answer_positions as ap
from experiments.extension import text_corpus

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]

RECALL = (
    "The farmer sold the red cart at dawn. The secret number of quiet-river is 4718205. "
    "A child painted the old fence by the lake. The secret number of brave-stone is 9034127. "
    "Question: What is the secret number of quiet-river? Answer: The secret number of quiet-river is 4718205. "
    "The baker carried the bread to the market. "
    "Question: What is the secret number of brave-stone? Answer: The secret number of brave-stone is 9034127. "
    "The wind moved the leaves across the yard."
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    scale = ap.SCALES["toy-text"]
    return ap.tokenizer_for(scale, tmp_path_factory.mktemp("tok"), 0)


def _encode(tokenizer: Path, text: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer)).encode(text, add_special_tokens=False)


def test_recall_answers_are_located_at_their_tokens(tokenizer):
    answers = ap.locate("recall", RECALL)
    # by hand: the value after each "Answer: ... is ", and its first statement
    expected = []
    cursor = 0
    for value in ("4718205", "9034127"):
        cursor = RECALL.index(f"is {value}. ", RECALL.index("Answer:", cursor)) + 3
        expected.append((cursor, cursor + 7, RECALL.index(value)))
    assert [(a.start, a.end, a.evidence) for a in answers] == expected
    enc = _encode(tokenizer, RECALL)
    located = ap.to_tokens(answers, enc.offsets)
    for (start, end, evidence), got in zip(expected, located):
        # digits are single tokens: the answer's first token is the count of tokens of the text before it
        assert got.first == len(_encode(tokenizer, RECALL[:start]).ids)
        assert got.evidence == len(_encode(tokenizer, RECALL[:evidence]).ids)
        assert got.tokens == 7 and "".join(enc.tokens[got.first : got.first + 7]) == RECALL[start:end]
    doc = ap.Document("recall", enc.ids, located)
    last = len(enc.ids)  # the EOS
    figures = ap.answer_figures([doc], {"recall": 1.0}, last_q=last - located[1].first + 1)
    # only the second answer is in the rows, and all of its 7 tokens
    assert figures["answers"] == 2 and figures["answer_tokens"] == 14
    assert figures["answer_tokens_in_rows_share"] == pytest.approx(7 / 14)
    assert figures["answer_to_end_tokens"]["p90"] == last - located[0].first


def test_final_answers_of_niah_and_vt_end_the_document(tokenizer):
    for kind, seed in (("niah", 3), ("vt", 4)):
        text = text_corpus.make_document(kind, seed, 40)
        answers = ap.locate(kind, text)
        listing = text[text.rindex("\nAnswer: ") :]
        assert answers and all(text[a.start : a.end] in listing for a in answers)
        assert answers[-1].end == len(text) - 1  # the final "."
        question = text.rindex("Question:")
        assert all(
            a.evidence < question and text[a.evidence : a.evidence + a.end - a.start] == text[a.start : a.end]
            for a in answers
        )
        enc = _encode(tokenizer, text)
        located = ap.to_tokens(answers, enc.offsets)
        assert located[-1].first + located[-1].tokens == len(enc.ids) - 1  # then the "." token


def test_locate_refuses_documents_without_answers():
    with pytest.raises(ValueError, match="no retrieval answers"):
        ap.locate("copy", "a b c")
    with pytest.raises(ValueError, match="never stated"):
        ap.locate("recall", "Answer: The secret number of a-b is 1234567.")


def test_filler_share_counts_the_unused_tail_of_each_sample():
    docs = [ap.Document("recall", [5] * n, []) for n in (5, 3, 6)]
    # seq_len 8, first fit with an EOS after each: [5+1, filler 2], [3+1, filler 4], [6+1, filler 1]
    got = ap.packing([docs], seq_len=8, eos=0)
    assert got["samples"] == 3 and got["tokens"] == 24
    assert got["filler_tokens"] == 7 and got["filler_share"] == pytest.approx(7 / 24)
    assert 0 <= got["filler_share"] <= 1


def test_script_end_to_end_at_toy_scale(tmp_path):
    out = tmp_path / "answers.json"
    cmd = [sys.executable, "-m", "experiments.extension.answer_positions", "--scale", "toy-text", "--docs", "3"]
    subprocess.run([*cmd, "--work", str(tmp_path), "--out", str(out)], check=True, capture_output=True, cwd=ROOT)
    result = json.loads(out.read_text())
    assert {"device", "commit", "command"} <= set(result) and result["device"] == "cpu"
    ext = result["stages"]["extension"]
    assert 0 <= ext["packing"]["filler_share"] <= 1
    kinds = ext["answers"]["kinds"]
    assert set(kinds) == {"niah", "vt", "recall"} and all(k["documents"] >= 3 for k in kinds.values())
    assert kinds["niah"]["answer_tokens_in_rows_share"] == kinds["vt"]["answer_tokens_in_rows_share"] == 1.0
    shares = [k["answer_tokens_in_rows_share"] for k in kinds.values()]
    assert min(shares) <= ext["answers"]["mixture"]["answer_tokens_in_rows_share"] <= max(shares)

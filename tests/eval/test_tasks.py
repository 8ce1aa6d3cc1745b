"""Evaluation building blocks without a model: task generators, scoring, documents, parsing, buckets."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from mtraining.eval import infinitebench
from mtraining.eval.answers import Prompting, reference_text, score_samples
from mtraining.eval.documents import Haystack, filler_sentences, load_documents, text_pieces
from mtraining.eval.engine import Forced, Response
from mtraining.eval.intervals import score_interval
from mtraining.eval.niah import run_niah
from mtraining.eval.ppl import position_buckets
from mtraining.eval.ruler import run_ruler
from mtraining.eval.runtime import parse_lengths
from mtraining.eval.scoring import match_all, match_any, mean_percent
from mtraining.eval.tasks import MAX_NEW_TOKENS, TASKS, fit_knob, generate, top_words
from tests.eval.counting import bpe_count, words


def context_of(prompt: str) -> str:
    """The text between the instruction and the question."""
    return prompt.split("\n\n", 1)[1].rsplit("\n\nQuestion:", 1)[0]


# ---------------------------------------------------------------------------- generators
@pytest.mark.parametrize("task", TASKS)
def test_generators_are_deterministic_and_fit(task):
    a = generate(task, 2000, seed=3, count_tokens=words)
    b = generate(task, 2000, seed=3, count_tokens=words)
    c = generate(task, 2000, seed=4, count_tokens=words)
    assert (a.prompt, a.answers) == (b.prompt, b.answers)
    assert a.prompt != c.prompt
    budget = 2000 - MAX_NEW_TOKENS[task]
    assert a.prompt_tokens == words(a.prompt) <= budget
    assert a.prompt_tokens > 0.9 * budget  # the fit uses the budget, not a fraction of it
    assert a.answers and all(isinstance(x, str) and x for x in a.answers)


@pytest.mark.parametrize("length", [600, 4096])
def test_generators_fit_a_real_tokenizer(length):
    for task in TASKS:
        s = generate(task, length, seed=0, count_tokens=bpe_count)
        assert bpe_count(s.prompt) == s.prompt_tokens <= length - s.max_new_tokens
        assert s.prompt_tokens > 0.85 * (length - s.max_new_tokens)


def needle_values(prompt: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for key, value in re.findall(r"The secret number of ([a-z]+-[a-z]+) is (\d+)\.", context_of(prompt)):
        found.setdefault(key, []).append(value)
    return found


def asked_keys(prompt: str) -> list[str]:
    return re.findall(r"[a-z]+-[a-z]+", prompt.rsplit("Question:", 1)[1].split("\n")[0])


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"])
def test_needle_answers_are_in_the_text(task):
    for seed in range(5):
        s = generate(task, 1500, seed, words)
        needles = needle_values(s.prompt)
        keys = asked_keys(s.prompt)
        expected = [v for k in keys for v in needles[k]]
        assert sorted(expected) == sorted(s.answers)
        assert {"niah_single": 1, "niah_multikey": 4, "niah_multivalue": 1, "niah_multiquery": 4}[task] == len(needles)
        if task == "niah_multikey":  # distractors carry other values
            assert len(keys) == 1 and all(v not in s.answers for k, vs in needles.items() if k != keys[0] for v in vs)
        if task == "niah_multivalue":
            assert len(s.answers) == 4 and len(set(s.answers)) == 4


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_needle_depth(depth):
    s = generate("niah_single", 3000, 1, words, depth=depth)
    context = context_of(s.prompt)
    where = context.index("The secret number of") / len(context)
    assert abs(where - depth) < 0.05
    assert s.meta["depth"] == depth


def test_variable_tracking_answer_follows_the_chains():
    for seed in range(5):
        s = generate("vt", 1200, seed, words)
        value = re.search(r"assigned the value (\d+)", s.prompt).group(1)
        holds: dict[str, str] = {}
        for name, rhs in re.findall(r"VAR ([A-Z]+) = (VAR [A-Z]+|\d+)\.", context_of(s.prompt)):
            holds[name] = holds[rhs[4:]] if rhs.startswith("VAR ") else rhs  # statements come in chain order
        assert sorted(n for n, v in holds.items() if v == value) == sorted(s.answers)
        assert len(holds) == 10 and len(s.answers) == 5


@pytest.mark.parametrize("length", [1000, 9000])
def test_common_words_answer_is_the_most_frequent(length):
    s = generate("cwe", length, 2, words)
    entries = re.findall(r"^\d+\. (\w+)$", context_of(s.prompt), flags=re.M)
    counts = Counter(entries)
    top = sorted(counts.values(), reverse=True)
    n = len(s.answers)
    assert set(s.answers) == {w for w, _ in counts.most_common(n)}
    assert top[n - 1] > top[n]  # no tie at the boundary: the answer is unique


def test_frequent_words_answer_is_the_top_three():
    for seed in range(6):
        s = generate("fwe", 700, seed, words)
        text = context_of(s.prompt).split()
        counts = Counter(text)
        ranked = sorted(counts.values(), reverse=True)
        assert set(s.answers) == set(top_words(text, 3)) and len(s.answers) == 3
        assert min(counts[w] for w in s.answers) > ranked[3]


def test_generate_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown task"):
        generate("nope", 1000, 0, words)
    with pytest.raises(ValueError, match="depth"):
        generate("niah_single", 1000, 0, words, depth=1.5)
    with pytest.raises(ValueError, match="use a longer length"):
        generate("cwe", 40, 0, words)


def test_fit_knob_finds_the_largest_fitting_size():
    for slope, base, budget in ((7, 30, 1000), (1, 0, 5), (13, 100, 100_000), (3, 10, 11)):
        knob, tokens = fit_knob(lambda k, base=base, slope=slope: base + slope * k, budget)
        assert tokens <= budget < base + slope * (knob + 1)


CODE = "import os\n\n\ndef main():\n    return os.getcwd()\n"
PROSE = "A first sentence. " * 40 + "\nA short line.\n"


def test_text_pieces_keep_the_text_as_written():
    for text in (CODE, PROSE, "no newline at the end"):
        assert "".join(text_pieces(text)) == text
    assert text_pieces(CODE)[:3] == ["import os\n", "\n", "\n"]
    assert max(len(p) for p in text_pieces(PROSE)) <= 512  # the long line cut after its sentences


def test_haystack_from_documents_draws_each_prompt_its_own_text():
    stack = Haystack([CODE, PROSE, "Third document.\n"], seed=1)
    assert stack.name == "documents" and Haystack().name == "filler"
    first = stack.context(30, [], draw=0)
    assert first == stack.context(30, [], draw=0) and first != stack.context(30, [], draw=1)
    assert stack.context(31, [], draw=0).startswith(first)  # a knob's context is a prefix of the next one's
    assert len({stack.context(10, [], draw=d) for d in range(20)}) > 5
    needle = "The secret number of amber-heron is 1234567."
    text = stack.context(30, [(0.5, needle)], draw=0)
    assert needle in text.splitlines()  # a line of its own, the text around it as written (line breaks aside)
    assert text.replace(needle, "").replace("\n", "") == first.replace("\n", "")
    assert filler_sentences(50, 1)[:10] == filler_sentences(10, 1)
    assert Haystack(seed=1).context(3, [(1.0, needle)]) == " ".join([*filler_sentences(3, 1), needle])
    with pytest.raises(ValueError, match="hold no text"):
        Haystack(["   "])


def test_real_filler_reaches_niah_vt_and_passkey():
    stack = Haystack([CODE * 30, PROSE * 10], seed=0)
    for task in ("niah_single", "vt"):
        sample = generate(task, 1500, 2, words, stack)
        assert "os.getcwd()" in sample.prompt or "A first sentence." in sample.prompt
        assert sample.prompt_tokens <= 1500 - sample.max_new_tokens
    passkey = infinitebench.generate("passkey", 1500, 2, words, haystack=stack)
    assert "The grass is green" not in passkey.prompt and f"The pass key is {passkey.answers[0]}." in passkey.prompt
    assert "The grass is green" in infinitebench.generate("passkey", 1500, 2, words).prompt


def test_reference_text_follows_the_prompt():
    sample = generate("niah_multivalue", 1500, 0, words)
    assert reference_text(sample) == " " + ", ".join(sample.answers)
    kv = infinitebench.generate("kv_retrieval", 1500, 0, words)
    assert kv.prompt.endswith(": ") and reference_text(kv) == kv.answers[0]


# ---------------------------------------------------------------------------- scoring
def test_scoring_on_hand_made_predictions():
    assert match_all(" 1234567. Done.", ["1234567"]) == 1.0
    assert match_all("The number is 12345678", ["1234567"]) == 0.0  # no credit inside a longer number
    assert match_all("7654321 and 1234567", ["1234567", "7654321", "1111111", "2222222"]) == 0.5
    assert match_all("The words are: Bamiko, lutera and SOVEKI", ["bamiko", "soveki", "lutera"]) == 1.0
    assert match_all("amber-heron is it", ["amber heron"]) == 1.0
    assert match_all("", ["x"]) == 0.0
    assert match_any("nothing here, 42", ["7", "42"]) == 1.0
    assert match_any("nothing here", ["7", "42"]) == 0.0
    assert mean_percent([1.0, 0.5, 0.0, 0.5]) == 50.0
    with pytest.raises(ValueError, match="expected answer"):
        match_all("x", [])


def test_generated_answers_score_full_marks():
    for task in TASKS:
        s = generate(task, 1500, 0, words)
        assert match_all(" " + ", ".join(s.answers) + ".", s.answers) == 1.0
        assert match_all(" I do not know.", s.answers) == 0.0


class _Chars:
    """A tokenizer of one id per character."""

    stop_ids: list[int] = []

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))

    def count(self, text: str) -> int:
        return len(text)

    def continuation(self, prompt: str, text: str) -> list[int]:
        return self.encode(text)


class _Answers:
    """An engine whose greedy answer is always ' 1234567.'."""

    def respond(self, ids, max_new_tokens, stop_ids, reference=None):
        return Response([ord(c) for c in " 1234567."])


class _Recording:
    """An engine that records each call (prompt ids, answer budget) and answers every other one right: the
    needle's digits generated and every reference token greedy, else neither."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], int]] = []

    def respond(self, ids, max_new_tokens, stop_ids, reference=None):
        self.calls.append((list(ids), max_new_tokens))
        right = len(self.calls) % 2 == 1
        text = " " + "".join(chr(t) for t in reference if chr(t).isdigit()) if right else " no."
        forced = Forced([0.1 * len(self.calls)] * len(reference), [right] * len(reference))
        return Response([ord(c) for c in text][:max_new_tokens], forced)


def test_teacher_forced_alone_prompts_are_the_generated_ones_and_counted_apart():
    """``Prompting.generated``: each cell's first prompts are generated, the rest read teacher-forced alone from the
    same prompt ids with a one-token budget (no decoding); the generated score and interval count the generated
    records, the teacher-forced figures all of them."""
    tok, lengths, depths = _Chars(), [600], [0.0, 100.0]
    every = _Recording()
    run_niah(every, tok, lengths, depths, Prompting(samples=3, show_progress=False))
    some = _Recording()
    result = run_niah(some, tok, lengths, depths, Prompting(samples=3, generated=1, show_progress=False))
    assert [ids for ids, _ in some.calls] == [ids for ids, _ in every.calls]  # the same prompts, seed by seed
    assert [n for _, n in some.calls] == [MAX_NEW_TOKENS["niah_single"], 1, 1] * 2
    records = result["records"]
    assert [r["generated"] for r in records] == [True, False, False] * 2
    assert all(r["prediction"] is None and r["score"] is None for r in records if not r["generated"])
    (pooled,) = result["by_length"]
    scores = [r["score"] for r in records if r["generated"]]
    assert (pooled["prompts"], pooled["generated"]) == (6, 2) and scores == [1.0, 0.0]
    assert pooled["score"] == 50.0 and pooled["interval"] == list(score_interval(scores))
    forced = [r["forced_score"] for r in records]
    assert pooled["forced"] == mean_percent(forced) and pooled["forced_interval"] == list(score_interval(forced))
    nll = [x for r in records for x in r["forced_nll"]]
    assert pooled["forced_nll"] == pytest.approx(sum(nll) / len(nll))
    assert result["scores"] == [[100.0], [0.0]] and result["forced"] == [
        [mean_percent(forced[:3])],
        [mean_percent(forced[3:])],
    ]


def test_ruler_and_infinitebench_generate_only_the_first_prompts_of_a_cell_too():
    tok = _Chars()
    for run, tasks in (
        (run_ruler, ["niah_multikey", "vt"]),
        (infinitebench.run_infinitebench, ["passkey", "kv_retrieval"]),
    ):
        engine = _Recording()
        result = run(engine, tok, tasks, [600], Prompting(samples=2, generated=1, show_progress=False))
        assert [r["generated"] for r in result["records"]] == [True, False] * len(tasks)
        assert sorted(n for _, n in engine.calls)[: len(tasks)] == [1] * len(tasks)  # the forced ones decode nothing


def test_prompting_generated_takes_some_of_the_samples_and_teacher_forcing():
    assert Prompting(samples=4, generated=4, forced=False).generated == 4  # all generated: nothing forced alone
    for bad in (0, 5):
        with pytest.raises(ValueError, match="generated must be in 1..samples"):
            Prompting(samples=4, generated=bad)
    with pytest.raises(ValueError, match="keep teacher forcing on"):
        Prompting(samples=4, generated=2, forced=False)


def test_prompting_cache_builds_each_sample_once():
    built = []

    def make(seed: int):
        def build():
            built.append(seed)
            return generate("niah_single", 600, seed, words)

        return build

    cache = {}
    runs = [({"task": "niah_single", "length": 600}, {"seed": s}, make(s)) for s in (0, 1)]
    first = score_samples(_Answers(), _Chars(), runs, "t", show_progress=False, cache=cache, forced=False)
    again = score_samples(_Answers(), _Chars(), runs, "t", show_progress=False, cache=cache, forced=False)
    assert built == [0, 1] and len(cache) == 2 and again == first
    other = score_samples(_Answers(), _Chars(), runs, "other title", show_progress=False, cache=cache, forced=False)
    assert built == [0, 1, 0, 1] and other[0] == first[0]  # keys carry the title


# ---------------------------------------------------------------------------- documents and parsing
def test_load_documents_all_formats(tmp_path):
    (tmp_path / "book.txt").write_text("A long book.")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "docs.jsonl").write_text(
        json.dumps({"body": "first"}) + "\n\n" + json.dumps({"body": "second"}) + "\n"
    )
    assert load_documents([tmp_path / "book.txt"]) == ["A long book."]
    assert load_documents([tmp_path], text_field="body") == ["A long book.", "first", "second"]
    with pytest.raises(ValueError, match="--text-field"):
        load_documents([tmp_path / "sub" / "docs.jsonl"])
    with pytest.raises(ValueError, match="does not exist"):
        load_documents([tmp_path / "missing.txt"])
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match="unsupported file type"):
        load_documents([tmp_path / "x.csv"])
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_documents([tmp_path / "bad.jsonl"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no"):
        load_documents([tmp_path / "empty"])


def test_parse_lengths():
    assert parse_lengths("4K, 512k,1M,300,4096") == [300, 4096, 524288, 1 << 20]
    for bad in ("", "abc", "-4K"):
        with pytest.raises(ValueError):
            parse_lengths(bad)


def test_position_buckets_cover_every_prediction():
    for length, first in ((4096, 1024), (513, 32), (100, 1024), (2, 1)):
        buckets = position_buckets(length, first)
        assert buckets[0][0] == 0 and buckets[-1][1] == length - 1
        assert all(a < b for a, b in buckets) and all(b == c for (_, b), (c, _) in zip(buckets, buckets[1:]))
    assert position_buckets(4096, 1024) == [(0, 1024), (1024, 2048), (2048, 4095)]

"""The paper's evaluation set without a model: InfiniteBench's generated tasks, the official scorers,
and loaders for files in the official formats (InfiniteBench JSONL, RULER JSONL, PG-19 layouts),
tested on small samples written here in those formats."""

from __future__ import annotations

import gzip
import json
import re
import shutil
import statistics
from pathlib import Path

import pytest

from mtraining.eval import datafiles, infinitebench
from mtraining.eval.answers import middle_cut
from mtraining.eval.documents import load_documents
from mtraining.eval.infinitebench import FILLER, MAX_NEW_TOKENS, TASKS, generate, render
from mtraining.eval.scoring import score
from tests.eval.counting import bpe_count, words
from tests.eval.official_samples import KEY, OTHER, infinitebench_files, needle_context, ruler_files, write_jsonl

DATA = Path(__file__).resolve().parents[2] / "data"


# ---------------------------------------------------------------------------- generated tasks
@pytest.mark.parametrize("task", TASKS)
def test_generators_are_deterministic_and_fit(task):
    a = generate(task, 3000, 5, words)
    assert (a.prompt, a.answers) == (generate(task, 3000, 5, words).prompt, generate(task, 3000, 5, words).answers)
    assert a.prompt != generate(task, 3000, 6, words).prompt
    budget = 3000 - MAX_NEW_TOKENS[task]
    assert a.prompt_tokens == words(a.prompt) <= budget and a.prompt_tokens > 0.9 * budget
    assert a.metric == infinitebench.METRICS[task] and len(a.answers) == 1
    for length in (512, 2048):
        s = generate(task, length, 0, bpe_count)
        assert bpe_count(s.prompt) == s.prompt_tokens <= length - s.max_new_tokens
        assert s.prompt_tokens > 0.8 * (length - s.max_new_tokens)


def test_passkey_and_number_string_hide_their_key_at_the_depth():
    for task, noun in (("passkey", "pass key"), ("number_string", "sequence of digits")):
        for seed in range(4):
            s = generate(task, 4000, seed, words)
            key = s.answers[0]
            assert re.fullmatch(r"\d{5}" if task == "passkey" else r"\d{10}", key)
            lines = s.prompt.split("\n\n", 1)[1].rsplit("\n\n\n", 1)[0].split("\n")
            needle = [i for i, line in enumerate(lines) if key in line]
            assert len(needle) == 1 and lines[needle[0]] == f"The {noun} is {key}. Remember it. {key} is the {noun}."
            assert all(line == FILLER.strip() for i, line in enumerate(lines) if i != needle[0])
            assert abs(needle[0] / (len(lines) - 1) - s.meta["depth"]) < 0.05
            assert s.prompt.endswith(f"What is the {noun}?\n\nThe {noun} is")
        if task == "number_string":  # digits repeat in place, as in the benchmark
            assert any(a == b for a, b in zip(key, key[1:]))


def test_kv_retrieval_asks_one_key_of_the_json():
    for seed in range(4):
        s = generate("kv_retrieval", 3000, seed, words)
        body = s.prompt.split("JSON data:\n", 1)[1].split("\n\n\nKey:", 1)[0]
        pairs = json.loads(body)
        key = re.search(r'Key: "([0-9a-f-]+)"', s.prompt).group(1)
        assert len(pairs) > 10 and pairs[key] == s.answers[0]
        assert s.prompt.endswith("The value associated with the specified key is: ")


def test_math_find_answers_what_it_asks():
    asked = set()
    for seed in range(14):
        s = generate("math_find", 600, seed, words)
        values = json.loads(s.prompt.split("\n\n")[1])
        what = re.search(r"The (.+) number of the list is: $", s.prompt).group(1)
        assert s.prompt.startswith(f"What is the {what} number  in the following list?\n\n[")
        distinct = sorted(set(values))
        expected = {
            "largest": distinct[-1],
            "second largest": distinct[-2],
            "third largest": distinct[-3],
            "smallest": distinct[0],
            "second smallest": distinct[1],
            "third smallest": distinct[2],
            "median": statistics.median(values),
        }[what]
        assert float(s.answers[0]) == expected and all(0 <= v <= 99 for v in values)
        asked.add(what)
    assert len(asked) == 7


def test_generate_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown InfiniteBench task"):
        generate("longbook_qa_eng", 1000, 0, words)
    with pytest.raises(ValueError, match="use a longer length"):
        generate("kv_retrieval", 30, 0, words)


# ---------------------------------------------------------------------------- official scorers
def test_official_scorers_on_perfect_and_wrong_predictions():
    for task in TASKS:
        s = generate(task, 1500, 1, words)
        assert score(s.metric, " " + s.answers[0] + ".\n", s.answers) == 1.0
        assert score(s.metric, " I do not know.", s.answers) == 0.0
    # InfiniteBench: first integer (passkey, number string)
    assert score("first_integer", "71432. Remember", ["71432"]) == 1.0
    assert score("first_integer", "8941. Remember 89415", ["89415"]) == 0.0  # a later right number does not count
    assert score("first_integer", "871432", ["71432"]) == 0.0
    # InfiniteBench: key-value, the value among the words (split on whitespace and \n : " ' . , ? ! { })
    assert score("word", f'{KEY}\n\n\nKey: "{OTHER}', [KEY]) == 1.0
    assert score("word", f'"{KEY}".', [KEY]) == 1.0
    assert score("word", KEY[:-1], [KEY]) == 0.0 and score("word", KEY + "0", [KEY]) == 0.0
    # InfiniteBench: Math.Find, the first number compared numerically
    assert score("first_number", "88\n\nThe smallest number of the list is: 1", ["88"]) == 1.0
    assert score("first_number", "50", ["50.0"]) == 1.0 and score("first_number", "49.5", ["49.5"]) == 1.0
    assert score("first_number", "49", ["49.5"]) == 0.0 and score("first_number", "1 88", ["88"]) == 0.0
    # RULER: substrings, ignoring case; all answers (string_match_all) or any (string_match_part)
    assert score("substring_all", "The numbers are 1234567 and 12345678", ["1234567", "7654321"]) == 0.5
    assert score("substring_all", "PARIS, Rome", ["paris", "rome"]) == 1.0
    assert score("substring_any", "it is paris", ["Paris", "Lyon"]) == 1.0
    assert score("substring_any", "it is rome", ["Paris", "Lyon"]) == 0.0
    with pytest.raises(ValueError, match="unknown metric"):
        score("bleu", "x", ["x"])


def test_middle_cut_keeps_both_ends():
    ids = list(range(10))
    assert middle_cut(ids, 10) == ids and middle_cut(ids, 20) == ids
    assert middle_cut(ids, 5) == [0, 1, 7, 8, 9]
    assert middle_cut(ids, 4) == [0, 1, 8, 9]


# ---------------------------------------------------------------------------- official files on disk
def test_infinitebench_records_render_like_the_benchmark(tmp_path):
    folder = infinitebench_files(tmp_path / "ib")
    samples = datafiles.infinitebench_samples([folder])
    by_task = {t: [s for s in samples if s.task == t] for t in TASKS}
    assert [len(by_task[t]) for t in TASKS] == [2, 1, 1, 2]
    passkey = by_task["passkey"][1]
    assert passkey.prompt == infinitebench.TEMPLATES["passkey"].format(
        context=needle_context("06907", 1, 3), input="What is the pass key?"
    )
    assert passkey.prompt.endswith("What is the pass key?\n\nThe pass key is") and passkey.answers == ["06907"]
    assert passkey.meta == {"file": str(folder / "passkey.jsonl"), "id": 1} and passkey.max_new_tokens == 6
    kv = by_task["kv_retrieval"][0]
    assert kv.prompt.startswith("Extract the value corresponding") and kv.prompt.endswith("specified key is: ")
    assert kv.metric == "word" and kv.answers == [OTHER]
    largest, median = by_task["math_find"]
    assert largest.prompt.startswith("What is the second largest number  in the following list?\n\n[3, 97, 12, 97, 40]")
    assert largest.answers == ["40"] and median.answers == ["2.5"] and median.metric == "first_number"
    assert sorted(s.task for s in datafiles.infinitebench_samples([folder], limit=1)) == sorted(TASKS)


def test_infinitebench_task_from_name_or_option(tmp_path):
    folder = infinitebench_files(tmp_path / "ib")
    (folder / "passkey.jsonl").rename(folder / "passkey_8192.jsonl")
    assert {s.task for s in datafiles.infinitebench_samples([folder / "passkey_8192.jsonl"])} == {"passkey"}
    renamed = folder / "mine.jsonl"
    (folder / "number_string.jsonl").rename(renamed)
    with pytest.raises(ValueError, match="cannot tell the InfiniteBench task of .*mine.jsonl.*--task"):
        datafiles.infinitebench_samples([renamed])
    assert datafiles.infinitebench_samples([renamed], task="number_string")[0].metric == "first_integer"
    with pytest.raises(ValueError, match="not supported"):
        datafiles.infinitebench_samples([write_jsonl(tmp_path / "longbook_qa_eng.jsonl", [{"id": 0}])])


def test_benchmark_files_go_through_the_shared_reader(tmp_path):
    """Gzipped JSONL and globs, as for training data; a line that is not an object names file and line."""
    folder = infinitebench_files(tmp_path / "ib")
    raw = (folder / "passkey.jsonl").read_bytes()
    (folder / "passkey.jsonl").unlink()
    (folder / "passkey.jsonl.gz").write_bytes(gzip.compress(raw))
    samples = datafiles.infinitebench_samples([str(folder / "pass*")])
    assert [s.answers for s in samples] == [["71432"], ["06907"]] and samples[0].task == "passkey"
    write_jsonl(tmp_path / "list" / "passkey.jsonl", [])
    (tmp_path / "list" / "passkey.jsonl").write_text('["not", "an", "object"]\n')
    with pytest.raises(ValueError, match="passkey.jsonl:1 is a JSON list, not an object"):
        datafiles.infinitebench_samples([tmp_path / "list"])


def test_bad_files_name_the_line_and_the_fix(tmp_path):
    bad = write_jsonl(
        tmp_path / "passkey.jsonl", [{"id": 0, "context": "key 1", "input": "q", "answer": ["1"]}, {"id": 1}]
    )
    with pytest.raises(ValueError, match=r"passkey.jsonl:2: an InfiniteBench record needs .*found fields \['id'\]"):
        datafiles.infinitebench_samples([bad])
    bad = write_jsonl(
        tmp_path / "math_find.jsonl", [{"context": "[1]", "input": "The largest number of", "answer": "x"}]
    )
    with pytest.raises(ValueError, match="math_find.jsonl:1: the answer 'x' cannot be scored with first_number"):
        datafiles.infinitebench_samples([bad])
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "passkey.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="passkey.jsonl:1: not valid JSON"):
        datafiles.infinitebench_samples([tmp_path / "broken"])
    with pytest.raises(ValueError, match="does not exist"):
        datafiles.ruler_samples([tmp_path / "missing"])
    with pytest.raises(ValueError, match="--limit must be at least 1"):
        datafiles.ruler_samples([tmp_path], limit=0)


def test_ruler_records_prompt_and_metric(tmp_path):
    folder = ruler_files(tmp_path / "ruler" / "4096")
    niah, other, qa = datafiles.ruler_samples([tmp_path / "ruler"])
    assert (niah.task, niah.metric, niah.max_new_tokens) == ("niah_single_1", "substring_all", 128)
    assert niah.prompt.endswith(
        "in the provided text?" + " The special magic numbers for lucky-river mentioned in the provided text are"
    )
    assert niah.answers == ["8472013"] and other.answers == ["1234567"] and other.meta["id"] == 1
    assert (qa.task, qa.metric, qa.max_new_tokens) == ("qa_1", "substring_any", 32) and qa.prompt.endswith("Answer:")
    custom = write_jsonl(tmp_path / "custom" / "validation.jsonl", [{"input": "Say 7.", "outputs": ["7"]}])
    with pytest.raises(ValueError, match="unknown RULER task 'custom'.*--max-new-tokens"):
        datafiles.ruler_samples([custom])
    assert datafiles.ruler_samples([custom], max_new_tokens=4)[0].max_new_tokens == 4
    assert datafiles.ruler_samples([custom], task="vt")[0].max_new_tokens == 30
    with pytest.raises(ValueError, match="needs a string input and a list of outputs"):
        datafiles.ruler_samples([write_jsonl(tmp_path / "cwe.jsonl", [{"input": "x", "outputs": "y"}])])
    assert datafiles.ruler_samples([folder / "qa_1" / "validation.jsonl"])[0].task == "qa_1"


UNSCORABLE = [
    # (file, record, metric, why): an empty RULER answer is in every output (100%); the others in none (0%)
    ("niah_single_1.jsonl", {"input": "x", "outputs": [""]}, "substring_all", "found in every output"),
    ("qa_1.jsonl", {"input": "x", "outputs": ["Paris", "  "]}, "substring_any", "found in every output"),
    ("passkey.jsonl", {"context": "c", "input": "q", "answer": "71 432"}, "first_integer", "not a run of digits"),
    ("number_string.jsonl", {"context": "c", "input": "q", "answer": ["x1"]}, "first_integer", "not a run of digits"),
    ("kv_retrieval.jsonl", {"context": "c", "input": "q", "answer": "a value"}, "word", "not one word"),
    ("kv_retrieval.jsonl", {"context": "c", "input": "q", "answer": "key:"}, "word", "not one word"),
    ("math_find.jsonl", {"context": "[1]", "input": "The largest number of", "answer": -3}, "first_number", "sign"),
    ("math_find.jsonl", {"context": "[1]", "input": "The largest number of", "answer": "nan"}, "first_number", "sign"),
    # a retrieval answer the context does not hold: no model can find it
    ("passkey.jsonl", {"context": "The pass key is 5.", "input": "q", "answer": "7"}, "first_integer", "not in the"),
    ("kv_retrieval.jsonl", {"context": '{"a": "b"}', "input": "q", "answer": "zz"}, "word", "not in the context"),
]


@pytest.mark.parametrize("name, record, metric, why", UNSCORABLE, ids=lambda v: str(v)[:24])
def test_answers_that_cannot_score_are_refused_with_file_and_line(tmp_path, name, record, metric, why):
    fine = {**record, "context": "1", "answer": "1"} if "context" in record else {**record, "outputs": ["1"]}
    path = write_jsonl(tmp_path / name, [fine, record])
    load = datafiles.infinitebench_samples if "context" in record else datafiles.ruler_samples
    with pytest.raises(
        ValueError, match=rf"{re.escape(name)}:2: the answer .* cannot be scored with {metric}: .*{why}"
    ):
        load([path])


def test_a_ruler_record_without_a_prompt_is_refused_with_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "vt.jsonl", [{"input": "x", "outputs": ["1"]}, {"input": "", "outputs": ["1"]}])
    with pytest.raises(ValueError, match=r"vt\.jsonl:2: the prompt \(input \+ answer_prefix\) is empty"):
        datafiles.ruler_samples([path])


def test_place_by_length_refuse_or_truncate(tmp_path):
    samples = datafiles.infinitebench_samples([infinitebench_files(tmp_path / "ib", filler=30)])
    need = {id(s): words(s.prompt) + s.max_new_tokens for s in samples}
    placed = datafiles.place(samples, [4096, 300], words, truncate=False)
    for s in placed:
        assert s.length == (300 if need[id(s)] <= 300 else 4096) and s.prompt_tokens == words(s.prompt)
    assert {s.length for s in placed} == {300, 4096}
    with pytest.raises(ValueError) as err:
        datafiles.place(samples, [300], words)
    message = " ".join(str(err.value).split())
    assert "2 of 6 records are longer than the longest length 300" in message and "passkey.jsonl record 1" in message
    assert "--truncate" in message and f"add a length of at least {max(need.values())} to --lengths" in message
    cut = datafiles.place(samples, [300], words, truncate=True)
    assert {s.length for s in cut} == {300} and max(s.prompt_tokens for s in cut) > 300
    with pytest.raises(ValueError, match="leave no room"):
        datafiles.place(samples, [6], words)


def test_prompts_that_spell_a_special_token_are_refused(tmp_path):
    """A RULER file prepared with a chat template spells its special tokens; read as text, the template would
    reach the model as plain characters."""
    from mtraining.eval.loading import load_tokenizer

    specials = load_tokenizer(DATA / "tokenizer.json").special_tokens
    assert specials == ["<|endoftext|>"]
    fine = {"input": "Where is the key?", "outputs": ["1"]}
    templated = {"input": "<|endoftext|>user: Where is the key?", "outputs": ["1"]}
    datafiles.refuse_special_tokens(datafiles.ruler_samples([write_jsonl(tmp_path / "a/vt.jsonl", [fine])]), specials)
    samples = datafiles.ruler_samples([write_jsonl(tmp_path / "b/vt.jsonl", [fine, templated])])
    with pytest.raises(
        ValueError, match=r"vt.jsonl record 2 spells the special token '<\|endoftext\|>'.*template_type base"
    ):
        datafiles.refuse_special_tokens(samples, specials)


# ---------------------------------------------------------------------------- PG-19 for perplexity
def test_packed_perplexity_windows_join_documents_with_the_separator():
    """A bare tokenizer.json declares no EOS: --pack ran the documents together with nothing between them."""
    from mtraining.eval.loading import load_tokenizer
    from mtraining.eval.ppl import Windows

    tok = load_tokenizer(DATA / "tokenizer.json")
    assert tok.eos_id is None
    docs = ["Ada keeps the red lamp.", "Who?"]
    first, second = (tok.encode(d) for d in docs)
    window = Windows(docs, tok).windows(len(first) + 1 + len(second), 1, pack=True)[0]
    assert window == (0, [*first, 0, *second])


def test_pg19_folder_of_books(tmp_path):
    """The original release: one <id>.txt per book under train/, validation/, test/ and a metadata.csv."""
    for split, books in (("test", {"10146": "First book.", "3027": "Second book."}), ("train", {"1": "Train."})):
        (tmp_path / "pg19" / split).mkdir(parents=True)
        for name, text in books.items():
            (tmp_path / "pg19" / split / f"{name}.txt").write_text(text)
    (tmp_path / "pg19" / "metadata.csv").write_text("10146,Some Title,1900,url\n")
    assert load_documents([tmp_path / "pg19" / "test"]) == ["First book.", "Second book."]
    assert len(load_documents([tmp_path / "pg19"])) == 3


def test_pg19_parquet_and_arrow(tmp_path):
    """The Hugging Face layouts: parquet with a text column, and the arrow files of `datasets`."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    books = {
        "short_book_title": ["A", "B"],
        "publication_date": [1900, 1901],
        "url": ["u", "v"],
        "text": ["One.", "Two."],
    }
    table = pa.table(books)
    pq.write_table(table, tmp_path / "test-00000-of-00001.parquet")
    assert load_documents([tmp_path / "test-00000-of-00001.parquet"]) == ["One.", "Two."]
    saved = tmp_path / "saved" / "test"  # DatasetDict.save_to_disk: arrow stream + metadata JSON
    saved.mkdir(parents=True)
    with pa.ipc.new_stream(saved / "data-00000-of-00001.arrow", table.schema) as writer:
        writer.write_table(table)
    (saved / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}, indent=2)
    )
    (saved / "dataset_info.json").write_text(json.dumps({"features": {}}, indent=2))
    (saved.parent / "dataset_dict.json").write_text(json.dumps({"splits": ["test"]}))
    assert load_documents([saved.parent]) == ["One.", "Two."]  # a DatasetDict of one split: that split
    cache = tmp_path / "cache" / "pg19" / "default" / "0.1.0" / "abc123"  # datasets' cache: no state.json
    cache.mkdir(parents=True)
    shutil.copy(saved / "data-00000-of-00001.arrow", cache / "pg19-test.arrow")
    (cache / "dataset_info.json").write_text(json.dumps({"features": {}}, indent=2))
    assert load_documents([tmp_path / "cache"]) == ["One.", "Two."]  # the metadata JSON is not a document
    with pa.ipc.new_file(tmp_path / "file.arrow", table.schema) as writer:  # the IPC file format too
        writer.write_table(table)
    assert load_documents([tmp_path / "file.arrow"]) == ["One.", "Two."]
    with pytest.raises(ValueError, match="no column 'body'.*--text-field"):
        load_documents([tmp_path / "file.arrow"], text_field="body")


def test_render_math_find_needs_its_question():
    with pytest.raises(ValueError, match="math_find input must name what it asks"):
        render("math_find", infinitebench.Record("[1, 2]", "Which?", ["2"]))

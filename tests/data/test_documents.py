"""The shared reader: every supported format and source form, and one clear message per bad input."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from mtraining.data.documents import DataError, find_files, read_documents
from mtraining.data.tokenizer import TextTokenizer

DATA = Path(__file__).resolve().parents[2] / "data"


def _docs(source, field: str = "text") -> list[str]:
    return [d for f in find_files(source) for d in read_documents(f, field)]


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_text_jsonl_gzip_folders_and_globs(tmp_path):
    (tmp_path / "a.txt").write_text("one whole file")
    _jsonl(tmp_path / "b.jsonl", [{"text": "first"}, {"text": "second"}])
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "zipped"}) + "\n\n" + json.dumps({"text": "again"}) + "\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "d.md").write_text("nested")
    (tmp_path / "notes.csv").write_text("ignored in folders")
    assert _docs(tmp_path) == ["one whole file", "first", "second", "zipped", "again", "nested"]
    assert _docs(tmp_path / "*.jsonl*") == ["first", "second", "zipped", "again"]
    assert _docs(tmp_path / "c.jsonl.gz") == ["zipped", "again"]


def test_parquet_arrow_and_saved_datasets(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"body": ["p0", "p1", "p2"], "n": [0, 1, 2]})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=2)  # two row groups
    with pa.OSFile(str(tmp_path / "file.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    with pa.OSFile(str(tmp_path / "stream.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    for name in ("t.parquet", "file.arrow", "stream.arrow"):
        assert _docs(tmp_path / name, "body") == ["p0", "p1", "p2"], name

    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "hf" / "train"
    # built from an Arrow table with a fixed fingerprint (no dill hashing of the data)
    ds = datasets.Dataset(pa.table({"text": [f"row {i}" for i in range(7)]}), fingerprint="rows")
    ds.save_to_disk(str(saved), max_shard_size=60)  # several Arrow shards, in order
    assert len(list(saved.glob("*.arrow"))) > 1
    assert _docs(saved) == [f"row {i}" for i in range(7)]
    assert _docs(tmp_path / "hf") == [f"row {i}" for i in range(7)]  # a folder holding one: its Arrow files only
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match="point the source at one split"):
        _docs(tmp_path / "dd")


def _file(name: str, content: bytes):
    """A maker of one file with these bytes."""

    def make(tmp: Path) -> Path:
        (tmp / name).write_bytes(content)
        return tmp / name

    return make


def _bad_utf8_gz(tmp: Path) -> Path:
    p = tmp / "bad.jsonl.gz"
    with gzip.open(p, "wb") as f:
        f.write(b'{"text": "fine"}\n{"text": "\xff"}\n')
    return p


def _truncated_gz(tmp: Path) -> Path:
    p = tmp / "cut.jsonl.gz"
    p.write_bytes(gzip.compress(b'{"text": "x"}\n' * 1000)[:50])
    return p


def _parquet(tmp: Path, values) -> Path:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    p = tmp / "t.parquet"
    pq.write_table(pa.table({"text": values}), p)
    return p


def _corrupt_parquet(tmp: Path) -> Path:
    pytest.importorskip("pyarrow")
    p = tmp / "broken.parquet"
    p.write_bytes(b"PAR1 this is not parquet")
    return p


# One clear message per bad input (issue 15, item 8): what is wrong, where (file:line or row), the fix.
BAD_INPUTS = [
    ("malformed JSONL line", _file("x.jsonl", b'{"text": "ok"}\n{"text": "no end\n'), r"x\.jsonl:2: not valid JSON"),
    (
        "bad UTF-8 in JSONL (right line)",
        _file("bad.jsonl", b'{"text": "fine"}\n\n{"text": "caf\xe9"}\n'),  # a latin-1 byte on line 3
        r"bad\.jsonl:3: not valid UTF-8 \(byte 0xe9\)",
    ),
    ("bad UTF-8 in gzipped JSONL", _bad_utf8_gz, r"bad\.jsonl\.gz:2: not valid UTF-8"),
    ("bad UTF-8 in a text file", _file("book.txt", b"line one\nline two\nline \x80three\n"), r"book\.txt:3: not valid"),
    ("truncated gzip", _truncated_gz, r"cut\.jsonl\.gz: cannot be read"),
    (
        "non-string text field",
        lambda t: _jsonl(t / "n.jsonl", [{"text": 5}]),
        r"n\.jsonl:1: field 'text' holds a int, not a string",
    ),
    ("null text field", lambda t: _jsonl(t / "n.jsonl", [{"text": None}]), r"field 'text' holds a NoneType"),
    (
        "missing text field",
        lambda t: _jsonl(t / "m.jsonl", [{"body": "x"}]),
        r"m\.jsonl:1 has no field 'text' \(found \['body'\]\)",
    ),
    (
        "a JSON list, not an object",
        lambda t: _jsonl(t / "l.jsonl", [["x"]]),
        r"has no field 'text' \(found a JSON list\)",
    ),
    ("non-string parquet column", lambda t: _parquet(t, [1, 2]), r"column 'text' holds int64, not strings"),
    ("null parquet row", lambda t: _parquet(t, ["a", None]), r"row 1 of column 'text' is null"),
    ("corrupt parquet", _corrupt_parquet, r"broken\.parquet: cannot be read as parquet"),
    ("unsupported file type", _file("x.csv", b"a,b"), r"unsupported file type"),
    ("missing path", lambda t: t / "nowhere.jsonl", r"nowhere\.jsonl does not exist"),
    ("empty folder", lambda t: (t / "empty").mkdir() or t / "empty", r"folder .*empty holds no"),
    # reading a FIFO waits for a writer forever
    ("a FIFO", lambda t: os.mkfifo(t / "f.jsonl") or t / "f.jsonl", r"f\.jsonl is not a regular file"),
    ("a FIFO in a folder", lambda t: os.mkfifo(t / "f.jsonl") or t, r"f\.jsonl is not a regular file"),
]


@pytest.mark.parametrize("make, expected", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs_give_one_clear_message(tmp_path, make, expected):
    with pytest.raises(DataError, match=expected):
        _docs(make(tmp_path))


@pytest.mark.parametrize(
    "content, expected",
    [
        (b'{"version": "1.0", "truncated', "is not a valid tokenizer.json"),
        (b'{"version": "1.0"}', "is not a valid tokenizer.json"),
        (b"\xff\xfe garbage", "is not a valid tokenizer.json"),
    ],
    ids=["truncated", "no model", "not UTF-8"],
)
def test_corrupt_tokenizer_json(tmp_path, content, expected):
    (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(DataError, match=expected):
        TextTokenizer(tmp_path)
    assert TextTokenizer(DATA / "tokenizer.json").vocab_size == 512  # the control

"""Token streams read window by window, the token cache (once per content and tokenizer), token-file scans."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from mtraining.data import cache as cache_module
from mtraining.data.cache import TokenCache
from mtraining.data.documents import DataError
from mtraining.data.tokenizer import TextTokenizer, Tokenizer
from mtraining.data.tokens import TokenStream, open_token_file, scan_max

DATA = Path(__file__).resolve().parents[2] / "data"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return TextTokenizer(DATA / "tokenizer.json")


def test_stream_windows_cross_file_boundaries():
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 500, n).astype(dtype) for n, dtype in ((5, np.uint16), (1, np.uint32), (9, np.int32))]
    stream, whole = TokenStream(parts + [np.empty(0, np.uint16)]), np.concatenate(parts).astype(np.int64)
    assert len(stream) == 15
    for start in range(16):
        for stop in range(start, 16):
            window = stream.read(start, stop)
            assert window.dtype == np.int64 and np.array_equal(window, whole[start:stop])
    with pytest.raises(IndexError):
        stream.read(10, 16)


def test_token_files_are_memory_mapped_and_scanned_in_chunks(tmp_path, monkeypatch):
    ids = np.arange(1000, dtype=np.uint32)[::-1].copy()
    ids[500] = 70000
    np.save(tmp_path / "a.npy", ids)
    ids.astype(np.int64).tofile(tmp_path / "b.bin")
    assert isinstance(open_token_file(tmp_path / "a.npy"), np.memmap)
    monkeypatch.setattr("mtraining.data.tokens._SCAN_TOKENS", 64)  # many chunks, and a short last one
    assert scan_max(tmp_path / "a.npy") == 70000
    assert scan_max(tmp_path / "b.bin", "int64") == 70000
    np.save(tmp_path / "neg.npy", np.array([3, -1], dtype=np.int32))
    with pytest.raises(DataError, match="negative token id"):
        scan_max(tmp_path / "neg.npy")
    np.save(tmp_path / "f.npy", np.zeros(3, dtype=np.float32))
    with pytest.raises(DataError, match="1-D integer array"):
        open_token_file(tmp_path / "f.npy")


def test_text_is_tokenised_once_per_content_and_tokenizer(tmp_path, tokenizer, monkeypatch):
    source = tmp_path / "docs.jsonl"
    source.write_text(json.dumps({"text": "Ada keeps the red lamp."}) + "\n" + json.dumps({"text": "Who?"}) + "\n")
    cache = TokenCache(tmp_path / "cache")
    eos = tokenizer.separator_id(None)
    said: list[str] = []
    entry = cache.tokenize(source, tokenizer, "text", eos, log=said.append)
    expected = [i for doc in tokenizer.encode(["Ada keeps the red lamp.", "Who?"]) for i in (*doc, eos)]
    assert entry.open().tolist() == expected and entry.documents == 2 and entry.max_id == max(expected)
    assert entry.dtype == "uint16" and len(said) == 1

    # a second call (another rank, another run) is a cache hit: the file is hashed, not tokenised again
    monkeypatch.setattr(cache_module, "read_documents", lambda *a: pytest.fail("tokenised twice"))
    assert cache.tokenize(source, tokenizer, "text", eos, log=said.append) == entry and len(said) == 1
    monkeypatch.undo()

    # the key covers the content, the text field, the separator and the tokenizer's bytes
    assert cache.lookup(source, tokenizer, "body", eos) is None
    assert cache.lookup(source, tokenizer, "text", eos + 1) is None
    (tmp_path / "tok.json").write_text((DATA / "tokenizer.json").read_text() + "\n")  # other bytes
    assert cache.lookup(source, TextTokenizer(tmp_path / "tok.json"), "text", eos) is None
    source.write_text(json.dumps({"text": "Changed."}) + "\n")
    assert cache.lookup(source, tokenizer, "text", eos) is None


def test_a_failed_tokenisation_leaves_no_entry(tmp_path, tokenizer):
    source = tmp_path / "docs.jsonl"
    source.write_text(json.dumps({"text": "fine"}) + "\n" + "{broken\n")
    cache = TokenCache(tmp_path / "cache")
    with pytest.raises(DataError, match="docs.jsonl:2"):
        cache.tokenize(source, tokenizer, "text", 0, log=lambda _: None)
    assert not list((tmp_path / "cache" / "tokens").iterdir())
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "cache").write_text("a file, not a folder")
    with pytest.raises(DataError, match="set data.cache_dir to a writable folder"):
        TokenCache(tmp_path / "ro" / "cache").tokenize(source, tokenizer, "text", 0)


def test_a_file_rewritten_with_the_same_size_and_time_is_tokenised_again(tmp_path, tokenizer):
    """The cache is keyed by the file's bytes: same path, size and modification time with other words is
    another entry (it served the old tokens when keyed by path, size and time)."""
    source = tmp_path / "docs.jsonl"
    source.write_text(json.dumps({"text": "Ada keeps the red lamp."}) + "\n")
    stat = source.stat()
    cache = TokenCache(tmp_path / "cache")
    eos = tokenizer.separator_id(None)
    before = cache.tokenize(source, tokenizer, "text", eos, log=lambda _: None).open().tolist()
    source.write_text(json.dumps({"text": "Bob keeps the big lamp."}) + "\n")
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert source.stat().st_size == stat.st_size and source.stat().st_mtime_ns == stat.st_mtime_ns
    assert cache.lookup(source, tokenizer, "text", eos) is None
    after = cache.tokenize(source, tokenizer, "text", eos, log=lambda _: None).open().tolist()
    assert after == [*tokenizer.encode(["Bob keeps the big lamp."])[0], eos] and after != before


def test_a_cache_entry_cut_short_is_written_again(tmp_path, tokenizer):
    source = tmp_path / "docs.jsonl"
    source.write_text(json.dumps({"text": "Ada keeps the red lamp."}) + "\n")
    cache = TokenCache(tmp_path / "cache")
    entry = cache.tokenize(source, tokenizer, "text", 0, log=lambda _: None)
    ids = Path(entry.path)
    ids.write_bytes(ids.read_bytes()[:2])
    assert cache.lookup(source, tokenizer, "text", 0) is None
    assert cache.tokenize(source, tokenizer, "text", 0, log=lambda _: None).open().tolist() == entry.open().tolist()


@pytest.mark.parametrize(
    "written, read, expected",
    [
        (np.uint32, "uint16", "set data.token_dtype=uint32"),
        (np.int64, "uint16", "set data.token_dtype=int64"),
        (np.int64, "uint32", "set data.token_dtype=int64"),
    ],
)
def test_raw_ids_of_a_wider_type_read_narrower_are_refused(tmp_path, written, read, expected, monkeypatch):
    """Ids below 512 written as uint32 and read as uint16 are every id followed by a 0: ids a model accepts,
    so training ran on garbage. Zeros between all ids (over every chunk of the scan) name the type."""
    ids = np.random.default_rng(0).integers(1, 512, 1000).astype(written)
    ids.tofile(tmp_path / "t.bin")
    monkeypatch.setattr("mtraining.data.tokens._SCAN_TOKENS", 64)
    with pytest.raises(DataError, match=f"t.bin read as data.token_dtype={read} .*{expected}"):
        scan_max(tmp_path / "t.bin", read)
    assert scan_max(tmp_path / "t.bin", np.dtype(written).name) == ids.max()  # the right type reads
    with_zeros = ids.copy()
    with_zeros[1::4] = 0  # many ids 0 (but not every second one): real ids of its type
    with_zeros.tofile(tmp_path / "z.bin")
    assert scan_max(tmp_path / "z.bin", np.dtype(written).name) == with_zeros.max()


def test_a_raw_file_whose_size_the_type_does_not_divide_is_refused(tmp_path):
    np.arange(5, dtype=np.uint16).tofile(tmp_path / "t.bin")  # 10 bytes
    with pytest.raises(DataError, match="t.bin has 10 bytes, not a multiple of 4: .*set data.token_dtype"):
        open_token_file(tmp_path / "t.bin", "uint32")


@pytest.mark.parametrize("name", ["docs.jsonl", "doc.txt"])
def test_special_token_strings_in_text_are_text(tmp_path, tokenizer, name):
    """'<|endoftext|>' written in a document (a tokenizer's source, a chat log) is text: the separator id
    only ever ends a document, so document masking finds the documents that were written."""
    texts = ['TOKEN = "<|endoftext|>"', "Who?"] if name.endswith("jsonl") else ["a <|endoftext|> b"]
    source = tmp_path / name
    source.write_text("\n".join(json.dumps({"text": t}) for t in texts) if name.endswith("jsonl") else texts[0])
    eos = tokenizer.separator_id(None)
    ids = TokenCache(tmp_path / "cache").tokenize(source, tokenizer, "text", eos, log=lambda _: None).open().tolist()
    ends = [i for i, t in enumerate(ids) if t == eos]
    assert len(ends) == len(texts) and ends[-1] == len(ids) - 1
    assert tokenizer.decode(ids[: ends[0]]).strip() == texts[0]


def test_a_separator_that_text_can_spell_is_refused(tmp_path, tokenizer):
    """A data.separator that is not a special token occurs inside documents: their boundaries would be guessed."""
    source = tmp_path / "docs.jsonl"
    source.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": "the cat sat on the hat"}) + "\n")
    separator = tokenizer.separator_id("Ġh")
    with pytest.raises(DataError, match=r"docs.jsonl: document 2 holds the separator 'Ġh' \(id 300\).*special token"):
        TokenCache(tmp_path / "cache").tokenize(source, tokenizer, "text", separator, log=lambda _: None)


def test_blank_documents_are_skipped_and_a_file_of_them_is_refused(tmp_path, tokenizer):
    """A blank record was a lone separator: a file of them trained on separators alone with exit 0."""
    source = tmp_path / "docs.jsonl"
    source.write_text("\n".join(json.dumps({"text": t}) for t in ["", "Who?", "  \n", "Ada."]) + "\n")
    eos = tokenizer.separator_id(None)
    entry = TokenCache(tmp_path / "cache").tokenize(source, tokenizer, "text", eos, log=lambda _: None)
    assert entry.documents == 2
    assert entry.open().tolist() == [i for doc in tokenizer.encode(["Who?", "Ada."]) for i in (*doc, eos)]
    source.write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": " "}) + "\n")
    with pytest.raises(DataError, match="docs.jsonl holds no documents, only 2 blank ones"):
        TokenCache(tmp_path / "cache").tokenize(source, tokenizer, "text", eos, log=lambda _: None)

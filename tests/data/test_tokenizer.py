"""One tokenizer for training and evaluation: the ids, stop ids, separators and cache keys each path had
before the two wrappers became one (values recorded from the separate train and eval wrappers)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from mtraining.data.cache import TokenCache
from mtraining.data.documents import DataError
from mtraining.data.tokenizer import TextTokenizer, Tokenizer
from mtraining.eval.loading import load_tokenizer

DATA = Path(__file__).resolve().parents[2] / "data"
TEXT = "Ada keeps the red lamp.\nWho?  ünïcode 12"
IDS = [33, 68, 65, 272, 259, 444, 484, 14, 199, 55, 308, 31, 221, 221, 128, 121, 78, 128, 108, 67, 79, 68, 69, 221]
IDS += [17, 18]
EOS = 0  # <|endoftext|>


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Tokenizer folders as save_pretrained writes them: one declaring an EOS, one whose tokenizer adds a BOS."""
    from tokenizers import Tokenizer as Raw
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tokenizers")
    PreTrainedTokenizerFast(tokenizer_file=str(DATA / "tokenizer.json"), eos_token="<|endoftext|>").save_pretrained(
        root / "eos"
    )
    raw = Raw.from_file(str(DATA / "tokenizer.json"))
    raw.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    bos = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    bos.save_pretrained(root / "bos")
    return {"file": DATA / "tokenizer.json", "eos": root / "eos", "bos": root / "bos"}


@pytest.mark.parametrize(
    "name, ids, stop_ids",
    [("file", IDS, []), ("eos", IDS, [EOS]), ("bos", [EOS, *IDS], [EOS])],
    ids=["bare tokenizer.json", "folder declaring EOS", "folder adding BOS"],
)
def test_eval_prompts_keep_their_ids_and_stop_ids(folders, name, ids, stop_ids):
    tok = load_tokenizer(folders[name])
    assert tok.encode(TEXT) == ids and tok.count(TEXT) == len(ids)
    assert tok.stop_ids == stop_ids and tok.eos_id == (stop_ids[0] if stop_ids else None)
    assert tok.decode(ids) == TEXT  # special tokens skipped


@pytest.mark.parametrize("name", ["file", "eos", "bos"])
def test_training_documents_keep_their_ids_without_special_tokens(folders, name):
    tok = TextTokenizer(folders[name])
    assert tok.encode([TEXT, "Who?"]) == [IDS, [55, 308, 31]]
    assert tok.separator_id(None) == EOS and tok.vocab_size == 512
    assert tok.decode(tok.encode([TEXT])[0]) == TEXT


def test_training_separator_prefers_the_declared_eos(tmp_path):
    shutil.copy(DATA / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "Ġh"}}))
    assert TextTokenizer(tmp_path).separator_id(None) == 300
    assert TextTokenizer(tmp_path).separator_id("<|endoftext|>") == EOS


def test_token_cache_keys_cover_the_text_options(tmp_path):
    """The key holds the tokenizer.json's sha256 and the options documents are tokenised with, so an entry
    written with other options (special-token strings read as special ids: the key below) is not served."""
    tok = TextTokenizer(DATA / "tokenizer.json")
    digest = hashlib.sha256((DATA / "tokenizer.json").read_bytes()).hexdigest()
    assert tok.fingerprint == digest == "9e062da238b83765467e71d57b79b6820873bd81255f6943ac85166819711919"
    source = tmp_path / "docs.jsonl"
    source.write_text(json.dumps({"text": "Ada keeps the red lamp."}) + "\n")
    cache = TokenCache(tmp_path / "cache")
    stale = tmp_path / "cache" / "tokens" / "e1268ddd4f58aa6cf90f8b019903a1d29b4f3d9860997bd6fc0cb7c8e6856b7c"
    stale.parent.mkdir(parents=True)
    np.asarray([7, EOS], dtype=np.uint16).tofile(stale.with_suffix(".bin"))
    record = {"dtype": "uint16", "tokens": 2, "documents": 1, "max_id": 7, "source": "x", "tokenizer": "y"}
    stale.with_suffix(".json").write_text(json.dumps(record))
    assert cache.lookup(source, tok, "text", EOS) is None
    entry = cache.tokenize(source, tok, "text", EOS, log=lambda _: None)
    assert entry.open().tolist() == [*IDS[:8], EOS]


@pytest.mark.parametrize("name", ["file", "eos", "bos"])
def test_special_token_strings_in_text_never_give_special_ids(folders, name):
    """Training documents and evaluation prompts read '<|endoftext|>' in their text as text; a prompt's BOS
    comes from the tokenizer alone."""
    text = 'Ada said "<|endoftext|>" twice<|endoftext|>'
    for tok in (TextTokenizer(folders[name]), load_tokenizer(folders[name])):
        ids = tok.encode(text)
        bos = [EOS] if tok.add_special_tokens and name == "bos" else []
        assert ids[: len(bos)] == bos and EOS not in ids[len(bos) :]
        assert tok.encode([text]) == [ids] and tok.count(text) == len(ids)
        assert tok.decode(ids) == text


def test_train_and_eval_share_one_class_and_only_exact_files_key_caches(folders, tmp_path):
    assert type(TextTokenizer(folders["eos"])) is type(load_tokenizer(folders["eos"])) is Tokenizer
    source = tmp_path / "docs.jsonl"
    source.write_text(json.dumps({"text": "Who?"}) + "\n")
    auto = Tokenizer.from_folder(folders["eos"], add_special_tokens=False)  # what AutoTokenizer makes of a folder
    with pytest.raises(DataError, match="token caches need one"):
        TokenCache(tmp_path / "cache").tokenize(source, auto, "text", EOS)

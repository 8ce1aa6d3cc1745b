"""bench/accuracy_guard.py: a deterministic corpus in the eval's formats, and configs that differ only in attention."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import numpy as np
import yaml

from mtraining.eval.tasks import TASKS
from mtraining.train.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def _guard():
    spec = importlib.util.spec_from_file_location("accuracy_guard", ROOT / "bench" / "accuracy_guard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_corpus_is_deterministic_and_large_enough(tmp_path):
    guard = _guard()
    a = guard.build_corpus(tmp_path / "a.npy", 50_000, 1024, seed=0)
    b = guard.build_corpus(tmp_path / "b.npy", 50_000, 1024, seed=0)
    c = guard.build_corpus(tmp_path / "c.npy", 50_000, 1024, seed=1)
    assert a["tokens"] >= 50_000 and a["sha256"] == b["sha256"] != c["sha256"]
    tokens = np.load(tmp_path / "a.npy")
    assert tokens.max() < 512 and set(a["tokens_by_kind"]) == {"niah", "vt", "recall", "inventory"}


def test_niah_documents_end_with_the_answer_in_the_eval_format():
    guard = _guard()
    doc = guard.make_document("niah", 1_000_003, 40, guard._load_tiny_corpus_module())
    assert doc.startswith("Some facts are hidden in the text below.") and "\n\nQuestion: What" in doc
    answer = doc.rsplit("\nAnswer: ", 1)[1]
    assert answer.startswith("The secret number") and answer.endswith(".") and any(ch.isdigit() for ch in answer)
    assert "niah_single" in TASKS


def test_heldout_documents_are_long_enough(tmp_path):
    guard = _guard()
    guard.build_heldout(tmp_path / "h.jsonl", 1024, 2, 1024, seed=0)
    docs = [json.loads(line)["text"] for line in (tmp_path / "h.jsonl").read_text().splitlines()]
    tok = guard.TextTokenizer(guard.TOKENIZER)
    assert len(docs) == 2 and all(len(ids) >= 1024 for ids in tok.encode(docs))


def test_configs_differ_only_in_attention_sparse(tmp_path):
    guard = _guard()
    args = argparse.Namespace(
        arch="tiny", device="cpu", seq_len=1024, lr=6e-4, rope_theta=1e6, seed=0, v_size=None, s_size=None
    )
    tokens = tmp_path / "t.npy"
    np.save(tokens, np.zeros(4096, dtype=np.uint16))
    paths = {m: guard.write_config(tmp_path / m, args, m, tokens, 12) for m in ("dense", "sparse")}
    raw = {m: yaml.safe_load(p.read_text()) for m, p in paths.items()}
    for cfg, mode in ((raw["dense"], "dense"), (raw["sparse"], "sparse")):
        cfg["checkpoint"].pop("export_dir")
        cfg["log"].pop("dir")
        assert cfg["attention"].pop("sparse") == (mode == "sparse")
    assert raw["dense"] == raw["sparse"]
    for path in paths.values():
        cfg = load_config(path)  # valid for the trainer
        assert cfg.world_size == 1 and cfg.train.activation_checkpointing and cfg.data.tokenizer


def test_unbundle_writes_flat_eval_files(tmp_path):
    guard = _guard()
    bundle = {
        "evals": {
            "dense-trained_dense-attn": {"status": [], "ppl": {"kind": "ppl"}, "niah": {"kind": "niah"}},
            "sparse-trained_sparse-attn": {"status": ["ruler: stopped at the deadline"], "ruler": {"kind": "ruler"}},
        }
    }
    (tmp_path / "b.json").write_text(json.dumps(bundle))
    written = guard.unbundle(tmp_path / "b.json", tmp_path)
    assert sorted(p.name for p in written) == [
        "eval_dense-trained_dense-attn_niah.json",
        "eval_dense-trained_dense-attn_ppl.json",
        "eval_sparse-trained_sparse-attn_ruler.json",
    ]
    assert json.loads((tmp_path / "eval_dense-trained_dense-attn_ppl.json").read_text()) == {"kind": "ppl"}

"""bench/packed_documents.py on the CPU: its checks against the float64 oracle, the record's figures."""

from __future__ import annotations

import json

from bench import packed_documents


def test_packed_lengths_fill_the_sequence():
    lengths = packed_documents.packed_lengths(4096, 16, 512, seed=3)
    assert sum(lengths) == 4096 and all(1 <= n <= 512 for n in lengths) and len(lengths) > 8
    assert lengths == packed_documents.packed_lengths(4096, 16, 512, seed=3)


def test_cpu_run_checks_against_the_oracle_and_records_every_figure(tmp_path):
    argv = "--device cpu --check --seq-len 256 --min-doc 8 --max-doc 96 --block-size 16 --heads-q 2 --heads-kv 1"
    argv += " --head-dim 16 --v-size 32 --s-size 64 --world 2 --layouts striped contiguous --dense-causal"
    record = packed_documents.main([*argv.split(), "--out", str(tmp_path)])
    assert record["check"]["passed"], record["check"]
    saved = json.loads((tmp_path / "packed_documents.json").read_text())[0]
    assert saved["device"] == "cpu" and saved["commit"] and saved["command"]
    assert sum(saved["document_lengths"]) == 256 and saved["documents"] == len(saved["document_lengths"])
    assert 0 < saved["masked_density"] <= 1 and saved["document_pair_fraction"] < 1
    for name in ("sparse_docs", "sparse_nodocs", "sparse_one_document", "dense_docs", "dense_causal"):
        assert saved[f"{name}_fwd_bwd_ms"] > 0
    for layout in ("striped", "contiguous"):
        balance = saved["balance"][layout]
        assert len(balance["rank_fwd_bwd_ms"]) == 2 and balance["pair_rank_imbalance"] >= 1
    assert set(saved["goals"]) == {"one_document_no_slower", "within_1_3x_of_ideal", "striped_imbalance_le_1_1"}

"""`mtraining eval` end to end on a tiny model: every command writes its JSON (and PNG), bad input fails clearly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mtraining.eval.cli import eval_app
from mtraining.eval.infinitebench import MAX_NEW_TOKENS, METRICS
from mtraining.eval.infinitebench import TASKS as INFINITEBENCH
from mtraining.eval.scoring import score
from mtraining.models import build_model
from tests.configs import TINY
from tests.eval.official_samples import infinitebench_files, ruler_files

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "data" / "tokenizer.json"
CORPUS = ROOT / "data" / "tiny_corpus.jsonl"

FAST = ["--block-size", "16", "--backend", "torch"]
SPARSE = ["--attention", "sparse", "--v-size", "8", "--s-size", "32", "--last-q", "16", "--local-window", "16"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def invoke(*args: str):
    result = CliRunner().invoke(eval_app, [str(a) for a in args])
    return result.exit_code, result.output + (result.stderr if result.stderr_bytes is not None else "")


def ok(*args: str) -> str:
    code, out = invoke(*args)
    assert code == 0, out
    return out


def fails(*args: str) -> str:
    code, out = invoke(*args)
    assert code == 2, out
    return " ".join(out.split())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny HF model directory with the shipped byte-level BPE tokenizer."""
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    build_model(config=TINY).save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER), eos_token="<|endoftext|>").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def results(tiny, tmp_path_factory) -> Path:
    """Run every command once (dense and sparse); returns the results folder."""
    out = tmp_path_factory.mktemp("results")
    common = ["--lengths", "256,512", *FAST]
    ok(
        "ppl",
        tiny,
        "--data",
        CORPUS,
        "--pack",
        "--samples",
        "2",
        "--first-bucket",
        "64",
        *common,
        "--out-dir",
        out / "dense",
        "--label",
        "dense",
    )
    ok(
        "ppl",
        tiny,
        "--data",
        CORPUS,
        "--pack",
        "--first-bucket",
        "64",
        *common,
        *SPARSE,
        "--out-dir",
        out / "sparse",
        "--label",
        "sparse",
    )
    # sparse: real filler, 2 prompts per cell of which the first is generated and the second teacher-forced alone
    for extra, name in (
        ([], "dense"),
        ([*SPARSE, "--haystack", CORPUS, "--samples", "2", "--generated", "1"], "sparse"),
    ):
        ok(
            "niah",
            tiny,
            "--depths",
            "0,50,100",
            "--max-new-tokens",
            "3",
            *common,
            *extra,
            "--out-dir",
            out / name,
            "--label",
            name,
        )
    ok(
        "ruler",
        tiny,
        "--lengths",
        "512",
        "--samples",
        "1",
        "--max-new-tokens",
        "3",
        *FAST,
        "--out-dir",
        out / "dense",
        "--label",
        "dense",
    )
    ok(
        "infinitebench",
        tiny,
        "--lengths",
        "512",
        "--samples",
        "1",
        "--no-teacher-forcing",
        *FAST,
        "--out-dir",
        out / "dense",
        "--label",
        "dense",
    )
    return out


def test_ppl_json(results):
    data = json.loads((results / "dense" / "ppl.json").read_text())
    assert data["kind"] == "ppl" and data["attention"] == "dense" and data["world_size"] == 1
    assert [r["length"] for r in data["result"]] == [256, 512]
    for r in data["result"]:
        assert r["windows"] == 2 and r["tokens"] == 2 * (r["length"] - 1)
        assert sum(b["tokens"] for b in r["buckets"]) == r["tokens"]
        assert r["buckets"][0]["start"] == 1 and r["buckets"][-1]["end"] == r["length"] - 1
        assert 1 < r["ppl"] < 10 * TINY["vocab_size"]
        lo, hi = r["buckets"][-1]["ppl_interval"]  # over the two windows
        assert lo <= r["buckets"][-1]["ppl"] <= hi and r["ppl_interval"][0] <= r["ppl"] <= r["ppl_interval"][1]
        assert [w["document"] for w in r["window_records"]] == sorted(w["document"] for w in r["window_records"])
        assert all(len(w["nll"]) == len(r["buckets"]) for w in r["window_records"])
    sparse = json.loads((results / "sparse" / "ppl.json").read_text())
    assert sparse["attention"] == "sparse" and sparse["pattern"]["v_size"] == 8 and 0 < sparse["sparse_density"] < 1


def test_niah_json_and_heatmap(results):
    for name in ("dense", "sparse"):
        data = json.loads((results / name / "niah.json").read_text())
        grid = data["result"]
        assert grid["lengths"] == [256, 512] and grid["depths"] == [0, 50, 100]
        assert len(grid["scores"]) == 3 and all(
            len(row) == 2 and all(0 <= v <= 100 for v in row) for row in grid["scores"]
        )
        per_cell = data["settings"]["samples"]
        assert len(grid["records"]) == 6 * per_cell and all(r["prompt_tokens"] <= r["length"] for r in grid["records"])
        assert (results / name / "niah.png").read_bytes()[:8] == PNG_MAGIC
        assert grid["haystack"] == ("documents" if name == "sparse" else "filler")
        for row, bounds, forced in zip(grid["scores"], grid["intervals"], grid["forced"]):
            assert all(lo <= v <= hi for v, (lo, hi) in zip(row, bounds)) and all(f in (0, 100) for f in forced)
        assert [c["prompts"] for c in grid["by_length"]] == [3 * per_cell] * 2  # the depths of a length pooled
        assert [c["generated"] for c in grid["by_length"]] == [3, 3]
        for r in grid["records"]:
            assert len(r["forced_nll"]) == len(r["forced_greedy"]) >= 7 and r["forced_score"] == all(r["forced_greedy"])
            assert r["generated"] == (r["seed"] == 0) and (r["prediction"] is None) != r["generated"]
    assert json.loads((results / "sparse" / "niah.json").read_text())["settings"]["generated"] == 1


def test_ruler_json_and_table(results):
    data = json.loads((results / "dense" / "ruler.json").read_text())
    tasks = data["result"]["tasks"]
    assert len(tasks) == 7 and set(data["result"]["scores"]) == set(tasks)
    assert len(data["result"]["records"]) == 7 and data["result"]["lengths"] == [512]
    table = (results / "dense" / "ruler.md").read_text()
    assert all(t in table for t in tasks) and "average" in table and "Teacher-forced" in table
    res = data["result"]
    assert all(len(res["forced"][t]) == len(res["intervals"][t]) == 1 for t in tasks) and res["average_interval"][0]


def test_infinitebench_json_and_table(results):
    data = json.loads((results / "dense" / "infinitebench.json").read_text())
    res = data["result"]
    assert data["kind"] == "infinitebench" and res["tasks"] == list(INFINITEBENCH) and res["lengths"] == [512]
    assert res["counts"] == {t: [1] for t in INFINITEBENCH} and len(res["records"]) == 4
    for r in res["records"]:
        assert r["metric"] == METRICS[r["task"]] and r["prompt_tokens"] <= 512 - MAX_NEW_TOKENS[r["task"]]
        assert r["score"] == score(r["metric"], r["prediction"], r["answers"])
    table = (results / "dense" / "infinitebench.md").read_text()
    assert all(t in table for t in INFINITEBENCH) and "average" in table
    assert "Teacher-forced" not in table and not any("forced_score" in r for r in res["records"])  # turned off
    assert data["settings"]["teacher_forcing"] is False


def test_report(results, tmp_path):
    out = ok("report", results, "--out-dir", tmp_path)
    assert "report.md" in out
    report = (tmp_path / "report.md").read_text()
    for section in (
        "## Perplexity",
        "## Needle in a haystack",
        "## RULER-style tasks",
        "## InfiniteBench",
        "dense (dense, 1 rank)",
        "sparse (sparse, 1 rank)",
        "Depths pooled per length: generated / teacher-forced",
    ):
        assert section in report
    for png in ("ppl_by_position.png", "niah_heatmaps.png", "ruler_by_length.png", "infinitebench_by_length.png"):
        assert (tmp_path / png).read_bytes()[:8] == PNG_MAGIC and f"({png})" in report
    assert "does not exist" in fails("report", tmp_path / "nothing-here.json")
    (tmp_path / "empty").mkdir()
    assert "no evaluation results" in fails("report", tmp_path / "empty")
    assert "is a file, not a folder" in fails("report", results, "--out-dir", tmp_path / "report.md")


@pytest.mark.slow
def test_official_files_end_to_end(tiny, tmp_path):
    """InfiniteBench and RULER JSONL and a PG-19 folder of books run through the same commands."""
    ib = infinitebench_files(tmp_path / "ib", filler=5)
    base = FAST
    ok("infinitebench", tiny, "--data", ib, "--lengths", "256,512", *base, "--out-dir", tmp_path / "ib-out")
    res = json.loads((tmp_path / "ib-out" / "infinitebench.json").read_text())["result"]
    assert sorted(res["tasks"]) == sorted(INFINITEBENCH) and res["lengths"] == [256, 512]
    assert sum(map(sum, res["counts"].values())) == 6 == len(res["records"])
    for r in res["records"]:
        assert Path(r["file"]).parent == ib and r["task"] in Path(r["file"]).stem
        assert r["prompt_tokens"] == r["full_prompt_tokens"] <= r["length"] - MAX_NEW_TOKENS[r["task"]]
        assert r["length"] == 512 or r["full_prompt_tokens"] + MAX_NEW_TOKENS[r["task"]] <= 256
        assert r["metric"] == METRICS[r["task"]] and r["score"] == score(r["metric"], r["prediction"], r["answers"])
    assert {r["length"] for r in res["records"]} == {256, 512}
    msg = fails("infinitebench", tiny, "--data", ib, "--lengths", "256", *base, "--out-dir", tmp_path / "no")
    assert "are longer than the longest length 256" in msg and "--truncate" in msg
    ok("infinitebench", tiny, "--data", ib, "--lengths", "256", "--truncate", *base, "--out-dir", tmp_path / "cut")
    cut = json.loads((tmp_path / "cut" / "infinitebench.json").read_text())
    assert cut["settings"]["truncate"] and max(r["full_prompt_tokens"] for r in cut["result"]["records"]) > 256
    assert all(r["prompt_tokens"] <= 256 - MAX_NEW_TOKENS[r["task"]] for r in cut["result"]["records"])
    assert "--tasks does not apply with --data" in fails("infinitebench", tiny, "--data", ib, "--tasks", "passkey")
    assert "--truncate does not apply without --data" in fails("ruler", tiny, "--truncate")

    ruler = ruler_files(tmp_path / "ruler")
    ok("ruler", tiny, "--data", ruler, "--lengths", "512", *base, "--out-dir", tmp_path / "r")
    res = json.loads((tmp_path / "r" / "ruler.json").read_text())["result"]
    assert res["tasks"] == ["niah_single_1", "qa_1"] and res["counts"] == {"niah_single_1": [2], "qa_1": [1]}
    assert [r["metric"] for r in res["records"]] == ["substring_all", "substring_all", "substring_any"]
    assert "cannot tell" in fails("infinitebench", tiny, "--data", ruler, "--lengths", "512", *base)

    books = tmp_path / "pg19" / "test"  # PG-19's own layout: <id>.txt per book
    books.mkdir(parents=True)
    for i, line in enumerate(CORPUS.read_text().splitlines()[:6]):
        (books / f"{1000 + i}.txt").write_text(json.loads(line)["text"] * 3)
    ok("ppl", tiny, "--data", books, "--lengths", "256", *FAST, "--out-dir", tmp_path / "pg19-out")
    assert json.loads((tmp_path / "pg19-out" / "ppl.json").read_text())["result"][0]["windows"] == 1


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_training_checkpoint_with_config(tiny, tmp_path):
    """A trainer checkpoint (DCP step folder) + its YAML evaluates like the same weights as a HF directory."""
    import yaml

    from mtraining.train.checkpoint import save_checkpoint
    from mtraining.train.loss import CausalLMLoss

    model = build_model(tiny)
    wrapped = CausalLMLoss(model)
    save_checkpoint(tmp_path / "ckpt", 3, wrapped, torch.optim.AdamW(wrapped.parameters()))
    cfg = {
        "model": {"config": TINY, "dtype": "float32"},
        "data": {"sources": [str(CORPUS)], "tokenizer": str(TOKENIZER), "seq_len": 256, "batch_size": 1},
        "train": {"steps": 1},
        "optim": {"warmup_steps": 0},
        "attention": {"sparse": False, "v_size": 64, "s_size": 128, "local_window": 64, "block_size": 64},
    }
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(cfg))
    args = ["--data", CORPUS, "--pack", "--lengths", "256", *FAST]
    ok("ppl", tmp_path / "ckpt", "--config", tmp_path / "train.yaml", *args, "--out-dir", tmp_path / "a")
    ok("ppl", tiny, *args, "--out-dir", tmp_path / "b")
    a, b = (json.loads((tmp_path / d / "ppl.json").read_text())["result"][0]["ppl"] for d in "ab")
    assert a == pytest.approx(b, rel=1e-6)


def test_dense_layers_stay_dense_like_training(tiny, tmp_path):
    """--dense-layers 0 (attention.dense_layers of training): layer 0 dense, recorded in the JSON."""
    base = ["--data", CORPUS, "--pack", "--lengths", "256", *FAST, *SPARSE]
    ok("ppl", tiny, *base, "--out-dir", tmp_path / "all")
    ok("ppl", tiny, *base, "--dense-layers", "0", "--out-dir", tmp_path / "first")
    every, first = (json.loads((tmp_path / n / "ppl.json").read_text()) for n in ("all", "first"))
    assert every["dense_layers"] == [] and first["dense_layers"] == [0]
    assert every["result"][0]["nll"] != first["result"][0]["nll"]
    assert "layer indices" in fails("ppl", tiny, *base, "--dense-layers", "zero", "--out-dir", tmp_path / "bad")


def test_bad_input_names_the_fix(tiny, tmp_path):
    base = ["--lengths", "256", *FAST, "--out-dir", tmp_path / "out"]
    assert "does not exist" in fails("ppl", tiny, "--data", tmp_path / "missing.jsonl", *base)
    assert "does not exist" in fails("niah", tmp_path / "no-model", *base)
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny / f, bare / f)
    assert "pass --tokenizer PATH" in fails("niah", bare, *base)
    ok("niah", bare, "--tokenizer", TOKENIZER, "--depths", "50", "--max-new-tokens", "2", *base)
    assert "--config TRAIN.yaml" in fails("niah", tmp_path, *base)
    msg = fails("niah", tiny, *base[:-2], "--lengths", "2048", "--out-dir", tmp_path / "out")
    assert "RoPE range" in msg and "--allow-extrapolation" in msg and "max_position_embeddings=1024" in msg
    msg = fails("ruler", tiny, *base, "--memory-limit-gib", "0.001")
    assert "does not fit memory" in msg and "--nproc-per-node" in msg and "--memory-limit-gib" in msg
    assert "no 4096-token window" in fails(
        "ppl", tiny, "--data", CORPUS, *base[2:], "--lengths", "4096", "--allow-extrapolation"
    )
    assert "dense or sparse" in fails("niah", tiny, *base, "--attention", "sparsest")
    assert "flat or hierarchical" in fails("niah", tiny, *base, "--ring", "star")
    assert "--inner-size sizes the inner rings" in fails("niah", tiny, *base, "--inner-size", "2")
    assert "unknown tasks" in fails("ruler", tiny, *base, "--tasks", "niah_single,sudoku")
    assert "use a longer length" in fails("ruler", tiny, *base[2:], "--lengths", "64", "--tasks", "cwe")
    (tmp_path / "a-file").write_text("")  # found before the evaluation runs, not when its results are written
    assert "--out-dir=" in fails("ppl", tiny, "--data", CORPUS, *base[:-2], "--out-dir", tmp_path / "a-file")


@pytest.mark.slow
def test_torchrun_two_ranks_match_one_on_either_ring(tiny, tmp_path):
    """`--nproc 2` relaunches under torchrun (gloo): same perplexity as one process, on the flat ring and on the
    hierarchical ring (--ring hierarchical --inner-size 1: two one-rank "nodes" joined by the outer ring)."""
    args = ["ppl", str(tiny), "--data", str(CORPUS), "--pack", "--lengths", "256", *FAST]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {"two": ["--nproc", "2"], "hier": ["--nproc", "2", "--ring", "hierarchical", "--inner-size", "1"], "one": []}
    for out, extra in runs.items():
        cmd = [sys.executable, "-m", "mtraining.eval.cli", *args, *extra, "--out-dir", str(tmp_path / out)]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
    two, hier, one = (json.loads((tmp_path / d / "ppl.json").read_text()) for d in runs)
    assert two["world_size"] == hier["world_size"] == 2 and one["world_size"] == 1
    assert (two["ring"], hier["ring"], hier["inner_size"]) == ("flat", "hierarchical", 1)
    for other in (two, hier):
        assert other["result"][0]["ppl"] == pytest.approx(one["result"][0]["ppl"], rel=1e-5)


def test_default_labels_tell_checkpoints_apart(tmp_path, monkeypatch):
    """Every `.../export` used to be labelled export-dense: labels now carry the checkpoint's path."""
    from mtraining.eval.loading import checkpoint_name

    monkeypatch.chdir(tmp_path)
    assert checkpoint_name(Path("runs/a/export")) == "runs_a_export"
    assert checkpoint_name(Path("runs/b/export")) == "runs_b_export"
    assert checkpoint_name(tmp_path / "runs" / "b" / "export") == "runs_b_export"
    assert checkpoint_name(Path("/models/Qwen2.5-3B")) == "models_Qwen2.5-3B"


def test_block_columns_reach_the_sparse_pattern(tiny, tmp_path):
    """--block-columns (attention.block_columns of training) adds per-block columns: recorded, denser, other NLL."""
    base = ["--data", CORPUS, "--pack", "--lengths", "256", *FAST, *SPARSE, "--backend", "torch"]
    ok("ppl", tiny, *base, "--out-dir", tmp_path / "lines")
    ok("ppl", tiny, *base, "--block-columns", "8", "--out-dir", tmp_path / "columns")
    lines, columns = (json.loads((tmp_path / n / "ppl.json").read_text()) for n in ("lines", "columns"))
    assert columns["pattern"]["block_columns"] == 8 and "block_columns" not in lines["pattern"]
    assert columns["sparse_density"] > lines["sparse_density"]
    assert columns["result"][0]["nll"] != lines["result"][0]["nll"]


def _train_yaml(tmp_path: Path, **attention) -> Path:
    """A training config whose attention the evaluation should take (sparse, small budgets, layer 0 dense)."""
    import yaml

    cfg = {
        "model": {"config": TINY, "dtype": "float32"},
        "data": {"sources": [str(CORPUS)], "tokenizer": str(TOKENIZER), "seq_len": 256},
        "train": {"steps": 1},
        "optim": {"warmup_steps": 0},
        "attention": {"sparse": True, "block_size": 16, "backend": "torch", "v_size": 16, "s_size": 32,
                      "last_q": 16, "sink_tokens": 2, "local_window": 16, "dense_layers": [0], **attention},
    }  # fmt: skip
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_config_gives_the_evaluation_the_training_attention(tiny, tmp_path):
    """--config TRAIN.yaml: every attention option left out takes the training config's value (sparse, budgets,
    sinks, block size, backend, dense layers); section.key=value overrides change that config; options win."""
    train = _train_yaml(tmp_path)
    base = ["--data", CORPUS, "--pack", "--lengths", "256", "--config", train]
    ok("ppl", tiny, *base, "--out-dir", tmp_path / "a")
    ok("ppl", tiny, "attention.v_size=8", *base, "--out-dir", tmp_path / "b")
    ok("ppl", tiny, "attention.v_size=8", *base, "--v-size", "12", "--dense-layers", "", "--out-dir", tmp_path / "c")
    a, b, c = (json.loads((tmp_path / d / "ppl.json").read_text()) for d in "abc")
    assert (a["attention"], a["block_size"], a["dense_layers"]) == ("sparse", 16, [0])
    assert a["pattern"] == {"v_size": 16, "s_size": 32, "last_q": 16, "sink_tokens": 2, "local_window": 16}
    assert b["pattern"]["v_size"] == 8 and (c["pattern"]["v_size"], c["dense_layers"]) == (12, [])
    assert "pass --config" in fails("ppl", tiny, "attention.v_size=8", *base[:-2])
    assert "did you mean attention.v_size?" in fails("ppl", tiny, "attention.vsize=8", *base)
    assert "dense layers [5] do not exist" in fails("ppl", tiny, *base, "--dense-layers", "5")


def _nproc_ppl(tiny: Path, *extra: str) -> tuple[int, str]:
    """`mtraining eval ppl --nproc 2` in a process of its own: (exit status, output)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "mtraining.eval.cli", "ppl", str(tiny), "--data", str(CORPUS), *FAST, "--nproc", "2"]
    done = subprocess.run([*base, *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert "Traceback" not in out and "ChildFailedError" not in out and "exitcode" not in out, out
    return done.returncode, out


def test_nproc_mistakes_are_refused_before_any_rank_starts(tiny, monkeypatch):
    """--nproc 2: options, the pattern against the model's lengths, ... are checked by the launcher: one message,
    exit 2, no rank started."""
    monkeypatch.setattr("mtraining.train.torchrun.launch", lambda *a, **k: pytest.fail("torchrun was started"))
    base = ["ppl", tiny, "--data", CORPUS, *FAST, "--nproc", "2", "--lengths", "256"]
    for extra, expected in (
        (["--ring", "star"], "error: --ring must be flat or hierarchical, got 'star'"),
        (["--attention", "sparse", "--v-size", "512"], "error: v_size 512"),
        (["--lengths", "2048"], "exceeds the model's RoPE range"),
    ):
        code, out = invoke(*base, *extra)
        assert code == 2 and expected in out and "Traceback" not in out, out


@pytest.mark.slow
def test_an_error_the_ranks_meet_is_printed_once_with_exit_2(tiny, tmp_path):
    """No window of the length in the data is found by the ranks: rank 0 alone says so, and the launcher exits 2."""
    code, out = _nproc_ppl(tiny, "--lengths", "1024", "--out-dir", str(tmp_path / "o"))
    assert code == 2 and out.count("error:") == 1 and "error: no 1024-token window in the data" in out, out


@pytest.mark.filterwarnings("error::FutureWarning")
def test_generation_uses_no_deprecated_transformers_argument(tiny, tmp_path):
    """The prefill and the decoding hand transformers its cache by the name it keeps (past_key_values goes in 5.40)."""
    ok("niah", tiny, "--lengths", "256", "--depths", "50", "--max-new-tokens", "2",
       *FAST, *SPARSE, "--out-dir", tmp_path)  # fmt: skip

"""The path of a real long-context run at toy size: a GGUF checkpoint -> `mtraining convert` -> `mtraining corpus`
over a folder of Python files and a text file -> `mtraining train` (2 gloo ranks, sparse attention, document
masking) -> `mtraining eval ppl` on the held-out documents."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mtraining.cli import app
from tests.gguf_files import write_tiny_gguf

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """
model: {{path: {model}, dtype: float32}}
attention:
  {{sparse: true, layout: striped, block_size: 32, backend: torch, v_size: 16, s_size: 32, last_q: 32,
   sink_tokens: 4, local_window: 32, dense_layers: [0], max_density: null}}
parallel: {{context: 2}}
data:
  sources: [{corpus}/train/code.npy, {corpus}/train/prose.npy]
  seq_len: 512
  document_masking: true
optim: {{lr: 1.0e-3, warmup_steps: 1}}
train: {{steps: 2, device: cpu, activation_checkpointing: false}}
checkpoint: {{dir: null, every: null, export_dir: {out}/export}}
log: {{dir: {out}/log, tensorboard: false}}
"""


def _ok(*args) -> str:
    run = CliRunner().invoke(app, [str(a) for a in args])
    assert run.exit_code == 0, run.output
    return run.stdout


@pytest.mark.slow
def test_gguf_to_corpus_to_sparse_training_to_heldout_perplexity(tmp_path):
    _ok("convert", write_tiny_gguf(tmp_path / "tiny.gguf"), tmp_path / "model")
    site = tmp_path / "site-packages"
    shutil.copytree(ROOT / "mtraining" / "data", site / "mtdata", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copyfile(ROOT / "mtraining" / "parallel" / "layout.py", site / "layout.py")  # a module: one file
    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "tides.txt").write_text("The tide came in over the flats at dusk. " * 40)
    corpus = tmp_path / "corpus"
    args = ["--tokenizer", tmp_path / "model", "--workers", "2", "--heldout-fraction", "0", "--heldout", "code/layout"]
    _ok("corpus", corpus, "--code", site, "--prose", tmp_path / "books", *args)
    manifest = json.loads((corpus / "manifest.json").read_text())
    assert manifest["tokenizer"]["separator"] == "<|im_end|>"  # the converted model's EOS, the trainer's default
    split = {d["name"]: (d["split"], d["tokens"]) for d in manifest["documents"]}
    assert [s for s, _ in split.values()] == ["heldout", "train", "train"] and split["code/layout"][1] > 600

    config = tmp_path / "run.yaml"
    config.write_text(CONFIG.format(model=tmp_path / "model", corpus=corpus, out=tmp_path))
    train = subprocess.run(
        [sys.executable, "-m", "mtraining.cli", "train", config, "--nproc", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "event" not in r]
    assert [r["step"] for r in steps] == [1, 2] and all(0 < r["density"] < 1 for r in steps), train.stdout

    _ok(
        "eval", "ppl", tmp_path / "export", "--data", corpus / "heldout", "--lengths", "512", "--first-bucket", "128",
        "--attention", "sparse", "--v-size", "16", "--s-size", "32", "--last-q", "32", "--local-window", "32",
        "--block-size", "32", "--backend", "torch", "--out-dir", tmp_path / "eval",
    )  # fmt: skip
    result = json.loads((tmp_path / "eval" / "ppl.json").read_text())["result"][0]
    assert result["length"] == 512 and result["windows"] == 1 and 1 < result["ppl"] < 1000

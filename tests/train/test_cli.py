"""The README's main job, shrunk: `mtraining train CONFIG --nproc 2` under torchrun, checkpoint and export."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_train_with_torchrun_two_ranks_writes_metrics_checkpoint_and_export(tmp_path):
    overrides = [
        "parallel.context=2",
        "data.seq_len=256",
        "train.steps=3",
        "optim.warmup_steps=1",
        f"checkpoint.dir={tmp_path / 'ck'}",
        f"checkpoint.export_dir={tmp_path / 'hf'}",
        f"log.dir={tmp_path}",
        "log.every=1",
    ]
    cmd = [sys.executable, "-m", "mtraining.cli", "train", "configs/tiny_cpu.yaml", "--nproc", "2", *overrides]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(0 < r["density"] <= 1 and 0 < r["recall"] <= 1 and r["tokens_per_s"] > 0 for r in rows)
    assert (tmp_path / "ck" / "step_00000003" / ".metadata").is_file()
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "tokenizer.json").is_file()

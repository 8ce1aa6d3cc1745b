"""experiments/extension/induction_init.py in miniature on the CPU: every training path runs and is recorded."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]


def test_every_path_trains_on_the_same_task_and_is_recorded(tmp_path):
    out, work = tmp_path / "paths.json", tmp_path / "work"
    cmd = [sys.executable, "-m", "experiments.extension.induction_init", "--runs", "smoke", "--steps", "50"]
    cmd += ["--batch", "2", "--work", str(work), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"device", "commit", "command"} <= set(result) and result["batch"] == 2
    paths = [r["path"] for r in result["runs"]]
    assert paths == ["plain", "plain-stream", "plain-bf16", "trainer", "trainer-fp32"]
    for run in result["runs"]:
        (loss,) = run["loss_every_50_steps"]
        assert 0 < loss < 2 * math.log(result["vocab"]) and run["parameters"] > 0, run
    models = {p: yaml.safe_load((work / p / "train.yaml").read_text())["model"] for p in ("trainer", "trainer-fp32")}
    assert models["trainer"]["init"] == models["trainer-fp32"]["init"] == "depth_scaled"
    assert models["trainer-fp32"]["dtype"] == "float32"
    data = yaml.safe_load((work / "trainer" / "train.yaml").read_text())["data"]
    assert data["seq_len"] == 128 and data["batch_size"] == 2 and "stage0" in data["sources"][0]

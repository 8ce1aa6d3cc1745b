"""bench/ring_attention.py at a toy size on two gloo ranks (torchrun): every method runs in every schedule and
link, and each record carries the cost model's prediction beside its measured time."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOY = ["--device", "cpu", "--seq-lens", "256", "--heads-q", "4", "--head-dim", "16", "--block-size", "16"]
TOY += ["--v-size", "16", "--s-size", "32", "--local-window", "16", "--last-q", "16", "--iters", "1"]


@pytest.mark.slow
def test_schedules_links_and_predictions(tmp_path):
    out = tmp_path / "ring.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(ROOT / "bench" / "ring_attention.py"), *TOY, "--methods", "dense_zigzag", "sparse_striped"]
    cmd += ["--schedules", "flat", "hierarchical:1", "allgather", "--links", "host", "0.05", "--out", str(out)]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = json.loads(out.read_text())
    runs = {(r["method"], r["schedule"], r["outer_link"]) for r in records}
    slow = "emulated 0.05 GB/s, 5 us"
    for method in ("dense_zigzag", "sparse_striped"):  # the all-gather is a collective: no emulated link
        for schedule, link in [("flat", "host"), ("flat", slow), ("hierarchical", "host"), ("hierarchical", slow)]:
            assert (method, schedule, link) in runs
        assert (method, "allgather", "host") in runs and (method, "allgather", slow) not in runs
    assert len(records) == 10
    for r in records:
        assert r["device"] == "cpu" and r["gpus"] == 2 and not r["note"].startswith("failed"), r["note"]
        assert math.isfinite(r["fwd_bwd_ms"]) and r["fwd_bwd_ms"] > 0
        assert r["predicted_ms"] > 0 and r["predicted_over_measured"] == r["predicted_ms"] / r["fwd_bwd_ms"]
        calibration = r["schedule"] == "flat" and r["outer_link"] == "host"
        assert (r["prediction_basis"] == "calibration") == calibration
        if r["outer_link"] == slow:
            assert r["outer_gbps"] == 0.05 and r["outer_latency_s"] == 5e-6
    sparse = [r for r in records if r["method"] == "sparse_striped"]
    assert len({r["density"] for r in sparse}) == 1 and 0 < sparse[0]["density"] < 1
    assert "predicted ms" in run.stdout

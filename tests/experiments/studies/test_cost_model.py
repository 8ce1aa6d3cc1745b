"""experiments/studies/cost_model.py: the trainer's ring choice against measured ring times, and predictions for larger
clusters."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from experiments.studies import cost_model
from tests.bench.ring_records import issue_records

ROOT = Path(__file__).resolve().parents[3]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "experiments.studies.cost_model", *args],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )


def test_the_trainers_auto_ring_picks_the_faster_measured_ring(tmp_path):
    """--choices on the 4 x H200 measurements: parallel.ring: auto keeps the flat ring over NVLink and takes the
    hierarchical one behind the 5 GB/s link, each pick measured within the trainer's 5% margin of the faster."""
    path = tmp_path / "ring.json"
    path.write_text(json.dumps(issue_records(0.3)))
    run = _cli("--choices", str(path))
    records = json.loads(path.read_text())
    assert all(r["auto_right"] for r in records) and "NO" not in run.stdout
    picks = {(r["seq_len"], r["outer_link"]): r["auto_ring"] for r in records}
    assert picks[(131072, "host")] == picks[(524288, "host")] == "flat"
    assert picks[(131072, "emulated 5 GB/s, 5 us")] == picks[(524288, "emulated 5 GB/s, 5 us")] == "hierarchical"
    assert "2 nodes at 450 GB/s, predicted" in run.stdout  # the host's link judged as NVLink


def test_a_wrong_pick_is_flagged():
    """A hierarchical ring measured far slower than the flat one although the model picks it: auto_right false."""
    records = [r for r in issue_records(0.3) if r["seq_len"] == 131072 and r.get("outer_gbps") == 5]
    for r in records:
        if r["schedule"] == "hierarchical":
            r.update(fwd_bwd_ms=500.0, fwd_ms=150.0, bwd_ms=350.0)
    (case,) = cost_model.auto_choices(records)
    assert case["auto"] == "hierarchical" and not case["right"]
    assert all(r["auto_right"] is False for r in records)


def test_cli_prints_and_writes_predictions(tmp_path):
    out = tmp_path / "cost.json"
    run = _cli("--out", str(out))
    assert "4 x 8 A100-40GB" in run.stdout and "16 x 8 H100" in run.stdout
    assert "MEASURED" in run.stdout and "ASSUMED" in run.stdout
    records = json.loads(out.read_text())["predictions"]
    assert {r["seq_len"] for r in records} == {524288, 1048576}
    for r in records:  # never much worse (one exposed inner accumulator hop per outer step) ...
        assert r["hierarchical_ms"] <= r["flat_ms"] * 1.01
    # ... and far better where sparse steps are too short to hide the inter-node hop
    h100_sparse = [r for r in records if r["cluster"].startswith("16 x 8") and r["kind"] == "sparse"]
    assert all(r["hierarchical_ms"] < r["flat_ms"] / 2 for r in h100_sparse)


def test_cli_annotates_a_saved_run(tmp_path):
    """--annotate writes bench/ring_prediction.py's predictions into a saved run and prints them."""
    path = tmp_path / "ring.json"
    path.write_text(json.dumps(issue_records(0.3)))
    run = _cli("--annotate", str(path))
    records = json.loads(path.read_text())
    assert all(r["predicted_ms"] > 0 for r in records) and "predicted ms" in run.stdout

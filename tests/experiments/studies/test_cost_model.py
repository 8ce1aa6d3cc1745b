"""experiments/studies/cost_model.py: its predictions against measured ring times, and for larger clusters."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.studies import cost_model

ROOT = Path(__file__).resolve().parents[3]

# Issue 32: 4 x H200 as 2 "nodes" x 2 (ring_attention(..., ring="hierarchical", inner_size=2,
# outer_comm=emulated(link)), the flat ring as 4 x 1), sparse striped, Qwen2.5-3B heads, bf16,
# fwd+bwd ms (flat, hierarchical) per link.
MEASURED_4XH200 = {
    131072: {"host": (29.6, 30.8), 25: (32.9, 32.7), 5: (103.6, 52.5)},
    524288: {"host": (227.4, 234.1), 25: (236.5, 238.3), 5: (440.3, 283.4)},
}


def _issue_records(fwd_share: float) -> list[dict]:
    records = []
    for n, links in MEASURED_4XH200.items():
        for link, times in links.items():
            for schedule, ms in zip(("flat", "hierarchical"), times):
                r = dict(gpus=4, heads_q=16, heads_kv=2, head_dim=128, dtype="bfloat16", seq_len=n, inputs="structured")
                r.update(layout="striped", block_size=128, v_size=1024, s_size=6144, local_window=128, last_q=64)
                r.update(
                    method="sparse_striped", schedule=schedule, inner_size=2 if schedule == "hierarchical" else None
                )
                r.update(fwd_ms=ms * fwd_share, bwd_ms=ms * (1 - fwd_share), fwd_bwd_ms=ms, outer_link="host")
                if link != "host":
                    r.update(outer_link=f"emulated {link} GB/s, 5 us", outer_gbps=float(link), outer_latency_s=5e-6)
                records.append(r)
    return records


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "experiments.studies.cost_model", *args],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )


@pytest.mark.parametrize("fwd_share", [0.25, 0.3, 0.35])
def test_model_predicts_the_measured_4xh200_times_within_20_percent(fwd_share):
    """From the flat ring's NVLink time alone (the per-step compute), the model predicts the hierarchical ring
    and both rings over emulated 25 and 5 GB/s links. The issue gives fwd+bwd only: the forward's share is
    assumed (2 x H200 records: 0.26-0.32), and the verdict does not depend on it."""
    records = cost_model.annotate(_issue_records(fwd_share))
    ratios = [r["predicted_over_measured"] for r in records]
    assert all(0.8 <= x <= 1.2 for x in ratios), ratios
    five = {r["schedule"]: r["predicted_ms"] for r in records if r["seq_len"] == 131072 and r.get("outer_gbps") == 5}
    assert five["flat"] / five["hierarchical"] > 1.5  # the slow link: the hierarchy pays, as measured (1.97x)


def test_the_trainers_auto_ring_picks_the_faster_measured_ring(tmp_path):
    """--choices on the 4 x H200 measurements: parallel.ring: auto keeps the flat ring over NVLink and takes the
    hierarchical one behind the 5 GB/s link, each pick measured within the trainer's 5% margin of the faster."""
    path = tmp_path / "ring.json"
    path.write_text(json.dumps(_issue_records(0.3)))
    run = _cli("--choices", str(path))
    records = json.loads(path.read_text())
    assert all(r["auto_right"] for r in records) and "NO" not in run.stdout
    picks = {(r["seq_len"], r["outer_link"]): r["auto_ring"] for r in records}
    assert picks[(131072, "host")] == picks[(524288, "host")] == "flat"
    assert picks[(131072, "emulated 5 GB/s, 5 us")] == picks[(524288, "emulated 5 GB/s, 5 us")] == "hierarchical"
    assert "2 nodes at 450 GB/s, predicted" in run.stdout  # the host's link judged as NVLink


def test_a_wrong_pick_is_flagged():
    """A hierarchical ring measured far slower than the flat one although the model picks it: auto_right false."""
    records = [r for r in _issue_records(0.3) if r["seq_len"] == 131072 and r.get("outer_gbps") == 5]
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

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
                r.update(
                    method="sparse_striped", schedule=schedule, inner_size=2 if schedule == "hierarchical" else None
                )
                r.update(fwd_ms=ms * fwd_share, bwd_ms=ms * (1 - fwd_share), fwd_bwd_ms=ms, outer_link="host")
                if link != "host":
                    r.update(outer_link=f"emulated {link} GB/s, 5 us", outer_gbps=float(link), outer_latency_s=5e-6)
                records.append(r)
    return records


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


def test_cli_prints_and_writes_predictions(tmp_path):
    out = tmp_path / "cost.json"
    run = subprocess.run(
        [sys.executable, "-m", "experiments.studies.cost_model", "--out", str(out)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert "4 x 8 A100-40GB" in run.stdout and "16 x 8 H100" in run.stdout
    assert "MEASURED" in run.stdout and "ASSUMED" in run.stdout
    records = json.loads(out.read_text())["predictions"]
    assert {r["seq_len"] for r in records} == {524288, 1048576}
    for r in records:  # never much worse (one exposed inner accumulator hop per outer step) ...
        assert r["hierarchical_ms"] <= r["flat_ms"] * 1.01
    # ... and far better where sparse steps are too short to hide the inter-node hop
    h100_sparse = [r for r in records if r["cluster"].startswith("16 x 8") and r["kind"] == "sparse"]
    assert all(r["hierarchical_ms"] < r["flat_ms"] / 2 for r in h100_sparse)

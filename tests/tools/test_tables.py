"""tools/tables.py renders every report table from the committed results."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_table_renders_from_the_committed_results():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "tables.py")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "extension_cpu" in proc.stdout and "extension_gpu_base" not in proc.stdout


def test_ring_rows_name_their_schedule_link_and_prediction(monkeypatch):
    """Flat, hierarchical and all-gather rows of one run stay apart, each with the cost model's prediction."""
    sys.path.insert(0, str(ROOT / "tools"))
    import tables

    base = dict(gpus=4, device="NVIDIA H200", commit="abc1234", seq_len=131072, layout="striped", density=0.1)
    base.update(imbalance_max_over_mean=1.0, note="", fwd_ms=10.0, bwd_ms=20.0, fwd_bwd_ms=30.0)
    records = [
        dict(base, method="torch_cp", layout=None, density=1.0, fwd_bwd_ms=120.0),
        dict(base, method="sparse_striped", schedule="flat", outer_link="host", predicted_ms=30.0),
        dict(
            base,
            method="sparse_striped",
            schedule="hierarchical",
            inner_size=2,
            predicted_ms=52.0,
            outer_link="emulated 5 GB/s, 5 us",
        ),
        dict(base, method="sparse_striped", schedule="allgather", outer_link="host"),
    ]
    monkeypatch.setattr(tables, "_load", lambda name: records)
    rows = [line for line in tables.ring_table().splitlines() if "sparse_striped" in line]
    assert [row.split(" | ")[3] for row in rows] == ["flat", "hierarchical:2, emulated 5 GB/s, 5 us", "allgather"]
    assert [row.split(" | ")[9] for row in rows] == ["30.0", "52.0", ""]


def test_backend_rows_sit_side_by_side_with_their_ratio_to_triton(monkeypatch):
    """Each pattern's triton row comes first, then fa4's with its total over triton's."""
    sys.path.insert(0, str(ROOT / "tools"))
    import tables

    base = dict(device="NVIDIA H200", commit="abc1234", command="python3 bench/sparse_attention.py", seq_len=131072)
    base.update(inputs="structured", pattern="estimated", target_density=None, density=0.1, estimate_ms=5.0)
    base.update(sparse_fwd_ms=20.0, sparse_bwd_ms=60.0, sparse_fwd_bwd_ms=80.0, bwd_over_fwd=3.0)
    base.update(dense_fwd_bwd_ms=400.0, flash_attn_4="4.0.0b36")

    def record(backend: str, total: float) -> dict:
        return dict(base, backend=backend, sparse_total_ms=total, speedup_fwd_bwd=400.0 / total, over_ideal=total / 40)

    records = [record("fa4", 60.0), record("triton", 80.0)]
    monkeypatch.setattr(tables, "_load", lambda name: records)
    rows = [
        line.split(" | ") for line in tables.sparse_attention_backends_table(("one",)).splitlines() if "128K" in line
    ]
    assert [(row[3], row[12], row[13], row[14]) for row in rows] == [
        ("triton", "2.00", "2.00", " |"),
        ("fa4", "1.50", "2.00", "0.75 |"),
    ]

"""bench/sessions/: the 4-GPU calls rehearsed at toy sizes on gloo ranks (REHEARSE=1), and the phase runner's
deadline: what a device call leaves under $OUT is what the README says it leaves."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SESSIONS = ROOT / "bench" / "sessions"
PHASES_4GPU = {
    1: ["rings", "rings_1m"],
    2: ["hier", "hier-auto", "hier_1m", "hier_1m-auto", "train_512k_dense"],
    3: ["train_512k_sparse", "train_1m_sparse"],
    4: ["train_1m_dense"],
}


def _bash(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SESSIONS / script), *args],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **env},
    )


def _manifest(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "calls.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("call", sorted(PHASES_4GPU))
def test_the_4gpu_calls_rehearsed_leave_their_records(tmp_path, call):
    out = tmp_path / f"call{call}"
    run = _bash("h200x4.sh", str(call), REHEARSE="1", OUT=str(out), MTRAINING_COMMIT="abc1234")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    phases = _manifest(out)
    assert [p["phase"] for p in phases] == PHASES_4GPU[call]
    assert len(list(out.iterdir())) <= 8  # what comes back from a device call: at most 8 files
    assert (out / f"call{call}.log").exists()
    for p in phases:
        assert p["status"] == "done" and p["rc"] == 0, p
        assert p["gpus"] == 4 and p["commit"] == "abc1234" and p["call"] == call and p["command"]
        if p["phase"].endswith("-auto"):
            continue
        records = json.loads((out / p["out"]).read_text())
        assert records and all(r["gpus"] == 4 and r["commit"] == "abc1234" and r["device"] == "cpu" for r in records)
        if p["phase"].startswith("train"):
            assert all(r["complete"] and r["step_s"] > 0 and r["peak_mem_gb"] > 0 for r in records)
            continue
        ours = [r for r in records if r["method"] != "torch_cp"]  # torch's ring runs on CUDA only
        assert ours and all(not r["note"].startswith("failed") and r["predicted_ms"] > 0 for r in ours)
        if p["phase"].startswith("hier"):
            assert {r["schedule"] for r in records} == {"flat", "hierarchical"}
            assert all(r["auto_ring"] in ("flat", "hierarchical") and "auto_right" in r for r in records)
            assert {r["outer_link"] for r in records} == {"host", "emulated 25 GB/s, 5 us", "emulated 5 GB/s, 5 us"}


def test_phases_end_by_the_deadline_and_say_so(tmp_path):
    """A phase still running at the deadline is stopped there; one that cannot get its minimum is skipped."""
    script = f"source {SESSIONS / 'lib.sh'}; start_call 1; phase nap 1 sleep 60; phase late 30 true"
    started = time.monotonic()
    run = subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "REHEARSE": "1", "OUT": str(tmp_path), "CALL": "7", "DEADLINE": "3"},
    )
    assert run.returncode == 0 and time.monotonic() - started < 20, run.stdout + run.stderr
    nap, late = _manifest(tmp_path)
    assert (nap["phase"], nap["status"], nap["rc"], nap["call"]) == ("nap", "stopped at the deadline", 124, 7)
    assert late["status"].startswith("skipped: ") and late["status"].endswith("s left, needs 30s") and late["rc"] == -1
    assert "== nap: stopped at the deadline" in (tmp_path / "call7.log").read_text()


def test_a_device_call_needs_the_commit_and_a_planned_number(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MTRAINING_COMMIT"}
    run = subprocess.run(["bash", str(SESSIONS / "h200x8.sh"), "1"], capture_output=True, text=True, env=env)
    assert run.returncode == 2 and "set MTRAINING_COMMIT" in run.stdout
    run = _bash("h200x4.sh", "9", REHEARSE="1", OUT=str(tmp_path))
    assert run.returncode == 2 and "CALL must be 1-4" in run.stdout

"""bench/train_throughput.py at a toy size on gloo ranks: both modes train, every step is kept as it comes."""

from __future__ import annotations

import json
import sys
import time

import pytest

from tests.bench.scripts import load_script


@pytest.mark.slow
def test_both_modes_run_and_every_step_is_recorded(tmp_path, monkeypatch, capsys):
    """Dense then sparse (the second run crashed on metrics.jsonl's start event row), with --compile for both."""
    bench = load_script("train_throughput")
    out = tmp_path / "tt.json"
    args = ["--arch", "tiny", "--device", "cpu", "--gpus", "2", "--seq-lens", "256", "--steps", "2", "--warmup", "1"]
    monkeypatch.setattr(sys, "argv", ["train_throughput.py", *args, "--compile", "aot_eager", "--out", str(out)])
    bench.main()
    dense, sparse = json.loads(out.read_text())
    for rec in (dense, sparse):
        assert rec["complete"] and "error" not in rec, rec.get("error")
        assert rec["device"] == "cpu" and rec["gpus"] == 2 and rec["compile"] == "aot_eager"
        assert rec["config"]["train"]["compile"] and rec["config"]["train"]["compile_backend"] == "aot_eager"
        assert [s["step"] for s in rec["steps"]] == [1, 2] and rec["timed_steps"] == 1
        assert rec["step_s"] == rec["steps"][1]["step_s"] > 0 and rec["peak_mem_gb"] > 0
    assert dense["density"] is None and 0 < sparse["density"] <= 1
    printed = capsys.readouterr().out
    assert "     256  dense step 1: step_s=" in printed and "     256 sparse step 2: step_s=" in printed


def test_step_rows_skip_events_and_unfinished_lines(tmp_path):
    bench = load_script("train_throughput")
    path = tmp_path / "metrics.jsonl"
    rows = bench.StepRows(path)
    assert rows.new() == []
    path.write_text('{"event": "start", "step": 0}\n{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert rows.new() == [{"step": 1, "loss": 2.0}]
    with open(path, "a") as f:
        f.write('ss": 1.5}\n')
    assert rows.new() == [{"step": 2, "loss": 1.5}]
    summary = bench.summarize([{"step": 1, "step_s": 3.0, "loss": 2.0, "peak_mem_gb": 1.0}], warmup=2, profiled=False)
    assert summary["step_s"] == 3.0 and summary["timed_steps"] == 1 and summary["mfu"] is None
    assert summary["saved_attention_outputs"] is None  # the trainer did not say


def test_the_summary_says_whether_the_timed_steps_kept_the_attention_outputs():
    bench = load_script("train_throughput")
    step = {"step_s": 1.0, "loss": 2.0, "peak_mem_gb": 1.0}
    auto = [{**step, "step": i, "saved_attention_outputs": float(i > 1)} for i in (1, 2, 3)]
    assert bench.summarize(auto, warmup=1, profiled=False)["saved_attention_outputs"] is True  # decided after step 1
    assert bench.summarize(auto, warmup=0, profiled=False)["saved_attention_outputs"] == "mixed"
    off = [{**step, "step": i, "saved_attention_outputs": 0.0} for i in (1, 2)]
    assert bench.summarize(off, warmup=1, profiled=False)["saved_attention_outputs"] is False


@pytest.mark.slow
def test_a_time_limit_stops_before_a_step_that_would_end_past_it(tmp_path, monkeypatch):
    """The run is killed as soon as its next step could not finish in time (not when the limit strikes, then
    waiting for the trainer to end its step); the steps done are kept and a later run is recorded as not run."""
    bench = load_script("train_throughput")
    out = tmp_path / "tt.json"
    args = ["--arch", "tiny", "--device", "cpu", "--gpus", "2", "--seq-lens", "256", "--steps", "400", "--warmup", "1"]
    args += ["--modes", "sparse", "dense", "--time-limit-s", "45", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["train_throughput.py", *args])
    started = time.monotonic()
    bench.main()
    assert time.monotonic() - started < 60
    sparse, dense = json.loads(out.read_text())
    assert not sparse["complete"] and sparse["error"].startswith("stopped after step "), sparse.get("error")
    assert "the next would end past the time limit" in sparse["error"]
    assert int(sparse["error"].split()[3].rstrip(":")) == len(sparse["steps"]) >= 2
    assert not dense["complete"] and dense["error"] == "not run: --time-limit-s 45 was spent" and "steps" not in dense

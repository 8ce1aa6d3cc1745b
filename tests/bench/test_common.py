"""Benchmark plumbing: the provenance fields every result record starts with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.common import provenance, write_results


def test_provenance_names_device_commit_and_command(monkeypatch):
    monkeypatch.setenv("MTRAINING_COMMIT", "abc1234")
    monkeypatch.setattr("sys.argv", ["bench/loss.py", "--tokens", "8"])
    fields = provenance(on_gpu=False)
    assert fields["device"] == "cpu" and fields["commit"] == "abc1234"
    assert fields["command"].endswith("bench/loss.py --tokens 8") and list(fields) == ["device", "commit", "command"]


def test_results_stopped_mid_write_keep_the_previous_records(tmp_path, monkeypatch):
    """A benchmark killed while it rewrites its JSON (a call's deadline) leaves the last whole version."""
    out = tmp_path / "ring.json"
    write_results("ring", [{"seq_len": 1}], out)
    real = Path.write_text

    def half_then_killed(self, text, *args, **kwargs):
        real(self, text[: len(text) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", half_then_killed)
    with pytest.raises(KeyboardInterrupt):
        write_results("ring", [{"seq_len": 1}, {"seq_len": 2}], out)
    monkeypatch.undo()
    assert json.loads(out.read_text()) == [{"seq_len": 1}]


def test_a_run_keeps_the_records_of_earlier_runs(tmp_path, monkeypatch):
    """A benchmark run rewrites the file with its records so far after the records earlier runs left there (a
    512K run on a lent machine once replaced 30 committed records with its 2)."""
    monkeypatch.setattr("bench.common._EARLIER", {})
    out = tmp_path / "train.json"
    out.write_text(json.dumps([{"commit": "old"}]))
    write_results("train", [{"step": 1}], out)
    write_results("train", [{"step": 1}, {"step": 2}], out)
    assert json.loads(out.read_text()) == [{"commit": "old"}, {"step": 1}, {"step": 2}]
    out.write_text(json.dumps({"not": "a list"}))
    monkeypatch.setattr("bench.common._EARLIER", {})
    with pytest.raises(ValueError, match="not a list"):
        write_results("train", [{"step": 1}], out)

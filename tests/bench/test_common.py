"""Benchmark plumbing: the provenance fields every result record starts with."""

from __future__ import annotations

from bench.common import provenance


def test_provenance_names_device_commit_and_command(monkeypatch):
    monkeypatch.setenv("MTRAINING_COMMIT", "abc1234")
    monkeypatch.setattr("sys.argv", ["bench/loss.py", "--tokens", "8"])
    fields = provenance(on_gpu=False)
    assert fields["device"] == "cpu" and fields["commit"] == "abc1234"
    assert fields["command"].endswith("bench/loss.py --tokens 8") and list(fields) == ["device", "commit", "command"]

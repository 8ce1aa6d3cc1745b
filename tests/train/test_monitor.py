"""Metrics output: metrics.jsonl always, TensorBoard when installed (else one notice), MFU arithmetic."""

from __future__ import annotations

import builtins
import json

import pytest

from mtraining.train.monitor import Monitor, flops_per_token


def test_jsonl_and_a_single_notice_without_tensorboard(tmp_path, monkeypatch, capsys):
    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("no tensorboard")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    monitor = Monitor(True, str(tmp_path), total_steps=2, every=2, progress=False)
    monitor.log(1, {"loss": 2.5, "lr": 1e-3})
    monitor.log(2, {"loss": 2.0, "lr": 1e-3, "density": 0.5})
    monitor.close()
    out = capsys.readouterr()
    assert out.err.count("tensorboard is not installed") == 1
    assert "step 2 loss=2.0000 lr=1.00e-03 density=0.5000" in out.out and "step 1" not in out.out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "loss": 2.5, "lr": 1e-3}, {"step": 2, "loss": 2.0, "lr": 1e-3, "density": 0.5}]


def test_tensorboard_events_when_installed(tmp_path):
    pytest.importorskip("tensorboard")
    monitor = Monitor(True, str(tmp_path), total_steps=1, progress=False)
    monitor.log(1, {"loss": 1.0})
    monitor.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_disabled_monitor_writes_nothing(tmp_path):
    monitor = Monitor(False, str(tmp_path / "logs"), total_steps=1)
    monitor.log(1, {"loss": 1.0})
    monitor.close()
    assert not (tmp_path / "logs").exists()


def test_flops_per_token():
    # 6 N for the matmuls + 6 L Hq D (S + 1) x density for causal attention
    assert flops_per_token(1000, 2, 4, 8, 15, density=1.0) == 6000 + 6 * 2 * 4 * 8 * 16
    assert flops_per_token(1000, 2, 4, 8, 15, density=0.25) == 6000 + 6 * 2 * 4 * 8 * 16 / 4

"""Metrics output: metrics.jsonl always, TensorBoard when installed (else one notice), MFU arithmetic."""

from __future__ import annotations

import builtins
import json
import sys
import types

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
    run = monitor.run_id
    assert rows[0]["event"] == "start" and rows[0]["step"] == 0 and rows[0]["run_id"] == run
    assert rows[1:] == [
        {"step": 1, "loss": 2.5, "lr": 1e-3, "run_id": run},
        {"step": 2, "loss": 2.0, "lr": 1e-3, "density": 0.5, "run_id": run},
    ]


def test_a_resumed_run_keeps_its_id_behind_a_resume_marker(tmp_path):
    first = Monitor(True, str(tmp_path), total_steps=4, tensorboard=False, progress=False)
    first.log(1, {"loss": 3.0})
    first.log(2, {"loss": 2.0})
    first.log(3, {"loss": 1.5})  # after the last checkpoint (step 2): superseded by the resumed run
    first.close()
    second = Monitor(True, str(tmp_path), 4, start_step=2, tensorboard=False, progress=False, resumed_from="ck/step_2")
    second.log(3, {"loss": 1.4})
    second.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert second.run_id == first.run_id and {r["run_id"] for r in rows} == {first.run_id}
    assert [(r.get("event"), r["step"]) for r in rows] == [
        ("start", 0),
        (None, 1),
        (None, 2),
        (None, 3),
        ("resume", 2),
        (None, 3),
    ]
    assert rows[4]["checkpoint"] == "ck/step_2"
    fresh = Monitor(True, str(tmp_path), total_steps=4, tensorboard=False, progress=False)  # step 0: a new run
    assert fresh.run_id != first.run_id
    fresh.close()


@pytest.mark.parametrize("tty", [True, False])
def test_progress_bar_only_on_a_terminal(monkeypatch, capsys, tty):
    monkeypatch.setattr("sys.stderr.isatty", lambda: tty)
    monitor = Monitor(True, None, total_steps=2, every=1)
    monitor.log(1, {"loss": 1.0})
    monitor.close()
    err = capsys.readouterr().err
    assert ("train:" in err) == tty


class _FakeWandb(types.ModuleType):
    """Records what the W&B logger asks of the wandb package."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        fake = self

        class Run:
            def log(self, data, step):
                fake.logged.append((step, data))

            def finish(self):
                fake.finished += 1

        return Run()


def test_wandb_logs_beside_the_jsonl(tmp_path, monkeypatch):
    from mtraining.train.config import WandbSection

    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    settings = WandbSection(project="ext", mode="offline", tags=["512k"])
    monitor = Monitor(
        True, str(tmp_path), 2, tensorboard=False, progress=False, wandb=settings, run_config={"train": {"steps": 2}}
    )
    monitor.log(1, {"loss": 2.0, "recall": float("nan")})
    monitor.close()
    init = fake.inits[0]
    assert init["project"] == "ext" and init["mode"] == "offline" and init["tags"] == ["512k"]
    assert init["id"] == init["name"] == monitor.run_id and init["resume"] == "allow" and init["dir"] == str(tmp_path)
    assert init["config"] == {"train": {"steps": 2}}
    assert fake.logged == [(1, {"train/loss": 2.0})] and fake.finished == 1
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(ValueError, match=r'pip install -e "\.\[wandb\]"'):
        Monitor(True, None, 1, progress=False, wandb=settings)


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

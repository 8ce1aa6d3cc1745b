"""checkpoint.keep: the newest N checkpoints that verify stay, older ones go; one that does not verify stays."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mtraining.models import build_model
from mtraining.train.checkpoint import MANIFEST, checkpoints, save_checkpoint
from mtraining.train.config import ConfigError, parse_config
from mtraining.train.launch import run_local
from mtraining.train.loss import CausalLMLoss
from mtraining.train.retention import prune_checkpoints
from tests.configs import TINY
from tests.train.trainer_runs import RAW, run_trainer


@pytest.fixture
def five(tmp_path) -> Path:
    """Checkpoints of steps 1..5 of a tiny model (one process)."""
    model = CausalLMLoss(build_model(config=TINY))
    optimizer = torch.optim.AdamW(model.parameters())
    for step in range(1, 6):
        with pytest.warns(UserWarning, match="torch.distributed is disabled"):
            save_checkpoint(tmp_path / "ck", step, model, optimizer)
    return tmp_path / "ck"


def _names(root: Path) -> list[str]:
    return [p.name for p in checkpoints(root)]


def test_the_newest_that_verify_are_kept(five):
    lines = prune_checkpoints(five, 2)
    assert _names(five) == ["step_00000005", "step_00000004"]
    assert lines == [f"checkpoint.keep=2: deleted {five / name}" for name in ("step_00000003", "step_00000002", "step_00000001")]  # fmt: skip


def test_a_checkpoint_that_does_not_verify_is_neither_kept_nor_deleted(five):
    shard = next((five / "step_00000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    (five / "step_00000002" / MANIFEST).unlink()  # as an earlier version wrote it
    lines = prune_checkpoints(five, 2)
    assert _names(five) == ["step_00000005", "step_00000004", "step_00000003", "step_00000002"]
    assert any("left" in line and "step_00000002" in line and "no manifest.json" in line for line in lines), lines
    assert lines[-1] == f"checkpoint.keep=2: deleted {five / 'step_00000001'}"


def test_keep_needs_a_checkpoint_dir():
    with pytest.raises(ConfigError, match="checkpoint.keep is set but checkpoint.dir is not"):
        parse_config(RAW, ["checkpoint.keep=2", "attention.sparse=false"])


def test_a_run_keeps_only_the_newest(tmp_path):
    ck = tmp_path / "ck"
    cfg = parse_config(
        RAW,
        ["attention.v_size=16", "attention.s_size=32", "train.steps=3", "checkpoint.every=1", "checkpoint.keep=1"]
        + [f"checkpoint.dir={ck}"],
    )
    run_local(run_trainer, 1, cfg)
    assert _names(ck) == ["step_00000003"]

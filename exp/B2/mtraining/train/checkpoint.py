"""Distributed checkpoints (torch.distributed.checkpoint) with exact resume, and HF export.

A checkpoint is ``DIR/step_NNNNNNNN/``: sharded model and optimizer state plus the step. The data
order and the learning rate are pure functions of the step, so loading one and continuing gives
the same next step as never stopping. A checkpoint counts only once DCP has written its
``.metadata`` (written last), so an interrupted save is never resumed from.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def latest_checkpoint(root: str | Path | None) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    if root is None or not Path(root).is_dir():
        return None
    done = [
        (int(m.group(1)), p)
        for p in Path(root).iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / ".metadata").is_file()
    ]
    return max(done)[1] if done else None


def save_checkpoint(root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> Path:
    """Collective: every rank writes its shards of model and optimizer state after ``step`` steps."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    path = step_dir(root, step)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)}, checkpoint_id=path)
    return path


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Restore model (and optimizer) state in place; returns the step it was saved at.

    Collective when a process group is up; without one (offline export) the model is loaded in this process.
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise ValueError(f"{path} is not a complete checkpoint (no .metadata); pick a step_N folder that has one")
    step = torch.tensor(0)
    if optimizer is None:
        state = {"model": get_model_state_dict(model), "step": step}
        with warnings.catch_warnings():  # DCP warns that it loads in one process: intended here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
        set_model_state_dict(model, state["model"])
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "step": step}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the unsharded model state on CPU (rank 0 gets it; other ranks an empty dict)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

"""Offline export: a distributed checkpoint's weights as a Hugging Face directory, in one process."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch import nn

from ..models import build_model, export_hf
from .checkpoint import load_checkpoint, pick_checkpoint, write_error
from .config import Config
from .loss import CausalLMLoss
from .resume import check_model, model_identity


def load_trained_model(cfg: Config, checkpoint: str | Path, report: Callable[[str], None]) -> tuple[nn.Module, Path]:
    """The config's HF model with the weights of ``checkpoint`` (a step_N folder, or a checkpoint
    directory: its newest checkpoint that verifies), verified and checked to be of this model."""
    hf = build_model(cfg.model.path, cfg.model.config, cfg.model.rope_theta, cfg.model.rope_parameters)
    model = CausalLMLoss(hf)
    path, manifest = pick_checkpoint(checkpoint, report)
    current = model_identity(hf.config, model.state_dict())
    for note in check_model(manifest["run"].get("model"), current, allow_changed=True, where=path.name):
        report(note)
    load_checkpoint(path, model)
    return hf, path


def export_checkpoint(
    cfg: Config, checkpoint: str | Path, out_dir: str | Path, report: Callable[[str], None] = print
) -> Path:
    """Load the model state of ``checkpoint`` (any number of ranks wrote it) and save it under ``out_dir``;
    returns the step folder used."""
    hf, path = load_trained_model(cfg, checkpoint, report)
    try:
        export_hf(hf.state_dict(), hf.config, out_dir, tokenizer=cfg.data.tokenizer or cfg.model.path)
    except Exception as err:  # write_error hands back what is not a full disk or a permission problem
        raise write_error(err, Path(out_dir), "exporting to") from None
    return path

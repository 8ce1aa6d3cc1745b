"""Offline export: a distributed checkpoint's weights as a Hugging Face directory, in one process."""

from __future__ import annotations

from pathlib import Path

from ..models import build_model, export_hf
from .checkpoint import load_checkpoint
from .config import Config
from .loss import CausalLMLoss


def export_checkpoint(cfg: Config, checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Load the model state of ``checkpoint`` (any number of ranks wrote it) and save it under ``out_dir``."""
    hf = build_model(cfg.model.path, cfg.model.config, cfg.model.rope_theta, cfg.model.rope_parameters)
    load_checkpoint(checkpoint, CausalLMLoss(hf))
    return export_hf(hf.state_dict(), hf.config, out_dir, tokenizer=cfg.data.tokenizer or cfg.model.path)

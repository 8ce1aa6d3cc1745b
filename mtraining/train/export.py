"""The final HF export of a run (trained length, RoPE and dtype recorded), and the offline export of a checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from ..models import build_model, export_hf
from ..models.loader import trained_config
from .checkpoint import load_checkpoint
from .config import Config
from .loss import CausalLMLoss

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def export_model(cfg: Config, weights: dict[str, torch.Tensor], hf_config, out_dir: str | Path) -> Path:
    """Write ``weights`` as a HF directory: the config records the trained length (max_position_embeddings at
    least data.seq_len) and RoPE settings; weights in checkpoint.export_dtype (auto: the training dtype)."""
    name = cfg.model.dtype if cfg.checkpoint.export_dtype == "auto" else cfg.checkpoint.export_dtype
    config = trained_config(hf_config, cfg.data.seq_len)
    return export_hf(weights, config, out_dir, tokenizer=cfg.data.tokenizer or cfg.model.path, dtype=DTYPES[name])


def export_checkpoint(cfg: Config, checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Load the model state of ``checkpoint`` (any number of ranks wrote it) and save it under ``out_dir``."""
    hf = build_model(**cfg.model.hf_kwargs())
    load_checkpoint(checkpoint, CausalLMLoss(hf))
    return export_model(cfg, hf.state_dict(), hf.config, out_dir)

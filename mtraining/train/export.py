"""The final HF export of a run (trained length, RoPE and dtype recorded), and the offline export of a
verified checkpoint."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..models import build_model, export_hf
from ..models.loader import trained_config
from .checkpoint import load_checkpoint, pick_checkpoint, replace_folder, write_error
from .config import Config
from .data import tokenizer_path
from .loss import CausalLMLoss
from .outputs import EXPORT_RECORD, check_export_target
from .resume import check_model, model_identity

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def export_model(
    cfg: Config, weights: dict[str, torch.Tensor], hf_config, out_dir: str | Path, key: str = "checkpoint.export_dir"
) -> Path:
    """Write ``weights`` as a HF directory: the config records the trained length (max_position_embeddings at
    least data.seq_len) and RoPE settings; weights in checkpoint.export_dtype (auto: the training dtype).
    The folder is written beside ``out_dir`` and renamed into place with ``EXPORT_RECORD`` last, so an
    export that fails leaves an earlier one whole; ``out_dir`` must be new, empty or an earlier export
    (outputs.check_export_target). A full disk or a permission problem raises ``SaveFailed``."""
    out = Path(out_dir)
    check_export_target(out, cfg, key)
    name = cfg.model.dtype if cfg.checkpoint.export_dtype == "auto" else cfg.checkpoint.export_dtype
    config = trained_config(hf_config, cfg.data.seq_len)
    written = out.with_name(out.name + ".partial")
    try:
        shutil.rmtree(written, ignore_errors=True)  # left by an export that died
        export_hf(weights, config, written, tokenizer=tokenizer_path(cfg), dtype=DTYPES[name])
        record = {"format": 1, "checkpoint_dir": cfg.checkpoint.dir, "dtype": name}
        (written / EXPORT_RECORD).write_text(json.dumps(record, indent=1) + "\n")
        replace_folder(written, out)
    except Exception as err:  # write_error hands back what is not a full disk or a permission problem
        raise write_error(err, out, "exporting to") from None
    return out


def load_trained_model(cfg: Config, checkpoint: str | Path, report: Callable[[str], None]) -> tuple[nn.Module, Path]:
    """The config's HF model with the weights of ``checkpoint`` (a step_N folder, or a checkpoint
    directory: its newest checkpoint that verifies), verified and checked to be of this model."""
    hf = build_model(**cfg.model.hf_kwargs())
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
    """Load the model state of ``checkpoint`` (any number of ranks wrote it) and save it under ``out_dir`` as
    the run's own export would; returns the step folder used."""
    check_export_target(out_dir, cfg, "OUT")
    hf, path = load_trained_model(cfg, checkpoint, report)
    export_model(cfg, hf.state_dict(), hf.config, out_dir, "OUT")
    return path

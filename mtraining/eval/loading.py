"""Load what an evaluation needs: the model, its tokenizer, and the device; check lengths up front.

A checkpoint is either a local Hugging Face directory (config.json + *.safetensors, e.g. what
``mtraining export`` writes), or an mtraining training checkpoint (a ``step_N`` folder, or the
checkpoint directory holding them) together with the training YAML given as ``config``. Models are
built by the trainer's loader (``mtraining.models.build_model``) so they run mtraining attention.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..data.tokenizer import FOLDER_FILES, Tokenizer

if TYPE_CHECKING:
    from ..train.config import Config

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NO_CONFIG = (
    "{path} has no config.json: for a training checkpoint pass --config TRAIN.yaml (the config it was trained "
    "with), or export it first with `mtraining export TRAIN.yaml OUT_DIR`"
)


@dataclass
class Loaded:
    model: nn.Module
    tokenizer: Tokenizer
    name: str
    max_positions: int | None


def load_tokenizer(
    checkpoint: str | Path, tokenizer: str | Path | None = None, fallback: str | Path | None = None
) -> Tokenizer:
    """The tokenizer at ``tokenizer`` (a tokenizer.json or a directory), else in the checkpoint, else ``fallback``;
    prompts get the tokenizer's special tokens (BOS where it adds one)."""
    candidates = [Path(p) for p in (tokenizer, checkpoint, fallback) if p is not None]
    if tokenizer is not None and not Path(tokenizer).exists():
        raise ValueError(f"tokenizer {tokenizer} does not exist; pass a tokenizer.json file or a directory holding one")
    for path in candidates if tokenizer is None else candidates[:1]:
        if path.is_file():
            return Tokenizer.from_file(path, add_special_tokens=True)
        if path.is_dir() and any((path / f).is_file() for f in FOLDER_FILES):
            return Tokenizer.from_folder(path, add_special_tokens=True)
    raise ValueError(
        f"{checkpoint} has no tokenizer ({' / '.join(FOLDER_FILES)}); pass --tokenizer PATH with a tokenizer.json "
        "or the directory of the base model it was trained from (e.g. data/tokenizer.json for the demo models)"
    )


def pick_device(device: str | None) -> torch.device:
    """``device`` or the default: this rank's GPU (LOCAL_RANK) when CUDA is available, else the CPU."""
    if device:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def pick_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _training_checkpoint(path: Path, cfg: Config) -> tuple[nn.Module, str | None]:
    """(model with the checkpoint's weights, tokenizer path from the config) of a training checkpoint."""
    from ..train.data import tokenizer_path
    from ..train.export import load_trained_model

    model, _ = load_trained_model(cfg, path, report=lambda line: print(line, file=sys.stderr))  # verified first
    return model, tokenizer_path(cfg)


def model_config(checkpoint: str | Path, config: Config | None):
    """The Hugging Face config of a checkpoint without loading its weights: its config.json, or the training
    config's model (``config``: a training checkpoint); ValueError naming the fix otherwise."""
    from ..models import build_config

    path = _existing(checkpoint)
    if (path / "config.json").is_file():
        return build_config(path)
    if config is None:
        raise ValueError(_NO_CONFIG.format(path=path))
    return build_config(**config.model.hf_kwargs())


def _existing(checkpoint: str | Path) -> Path:
    """The checkpoint's path; ValueError naming the fix when it does not exist or is a GGUF file."""
    from ..models.loader import refuse_gguf

    path = Path(checkpoint)
    refuse_gguf(path, "checkpoint")
    if not path.exists():
        raise ValueError(
            f"checkpoint {path} does not exist; pass a local Hugging Face directory (config.json + *.safetensors) "
            "or a training checkpoint folder with --config TRAIN.yaml"
        )
    return path


def load(
    checkpoint: str | Path,
    tokenizer: str | Path | None = None,
    config: Config | None = None,
    device: str | None = None,
    dtype: str | None = None,
) -> Loaded:
    """Model (eval mode, on ``device`` in ``dtype``) and tokenizer of a checkpoint; see the module docstring.
    ``config``: the training config of a training checkpoint."""
    from transformers.utils import logging as hf_logging

    from ..models import build_model

    hf_logging.disable_progress_bar()
    path = _existing(checkpoint)
    fallback = None
    if (path / "config.json").is_file():
        model = build_model(path)
    elif config is not None:
        model, fallback = _training_checkpoint(path, config)
    else:
        raise ValueError(_NO_CONFIG.format(path=path))
    tok = load_tokenizer(path, tokenizer, fallback)
    target = pick_device(device)
    model = model.to(device=target, dtype=pick_dtype(dtype, target)).eval()
    return Loaded(model, tok, checkpoint_name(path), getattr(model.config, "max_position_embeddings", None))


def checkpoint_name(path: Path) -> str:
    """A name for a checkpoint in labels and result folders: its path relative to the working directory
    (absolute outside it) with '_' for '/', so runs/a/export and runs/b/export do not collide."""
    full = path.resolve()
    try:
        parts = full.relative_to(Path.cwd()).parts
    except ValueError:
        parts = full.parts[1:]
    return "_".join(parts) or full.name


def check_rope_range(lengths: list[int], extra: int, max_positions: int | None, allow: bool) -> None:
    """ValueError naming the fix when ``length + extra`` exceeds the model's trained positions."""
    if max_positions is None or allow:
        return
    too_long = [n for n in lengths if n + extra > max_positions]
    if too_long:
        extra_note = f" plus {extra} answer tokens" if extra else ""
        raise ValueError(
            f"length {max(too_long)}{extra_note} exceeds the model's RoPE range (max_position_embeddings="
            f"{max_positions} in its config.json); drop lengths above {max_positions - extra}, evaluate a checkpoint "
            "trained for that length (RoPE extended, e.g. model.rope_theta in the training config), or pass "
            "--allow-extrapolation to measure beyond the range anyway"
        )

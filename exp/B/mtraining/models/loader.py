"""Build or load Hugging Face causal LMs that run mtraining attention, and export them back.

No network: a model comes from a local directory (config.json + *.safetensors) or from an
architecture config with random weights. Weights are kept in float32 (the master copy); the
trainer decides the compute dtype.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .adapter import ATTN_IMPLEMENTATION, register

SUPPORTED_TYPES = ("qwen2", "qwen3", "llama", "mistral")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_config(
    path: str | Path | None = None,
    config: dict[str, Any] | None = None,
    rope_theta: float | None = None,
    rope_parameters: dict[str, Any] | None = None,
):
    """The HF config from a local directory or a dict with ``model_type``, RoPE overrides applied."""
    from transformers import AutoConfig

    if (path is None) == (config is None):
        raise ValueError("pass exactly one of path (a local HF directory) or config (a dict with model_type)")
    if path is not None:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is not a Hugging Face model directory: it has no config.json")
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    else:
        fields = dict(config)
        hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    if hf_config.model_type not in SUPPORTED_TYPES:
        raise ValueError(f"model_type {hf_config.model_type!r} is not supported; use one of {SUPPORTED_TYPES}")
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope.update(rope_parameters or {})
    if rope_theta is not None:
        rope["rope_theta"] = float(rope_theta)
    if rope:
        hf_config.rope_parameters = rope
    return hf_config


def build_model(
    path: str | Path | None = None,
    config: dict[str, Any] | None = None,
    rope_theta: float | None = None,
    rope_parameters: dict[str, Any] | None = None,
    attn_implementation: str = ATTN_IMPLEMENTATION,
) -> nn.Module:
    """A float32 ``*ForCausalLM``: weights from ``path`` (local safetensors) or random from ``config``.

    Random init follows the current torch RNG: seed it first for reproducible weights.
    """
    from transformers import AutoModelForCausalLM

    register()
    hf_config = build_config(path, config, rope_theta, rope_parameters)
    if path is not None:
        if not any(Path(path).glob("*.safetensors")):
            raise ValueError(f"{path} has no *.safetensors weights; export or convert the model to safetensors")
        return AutoModelForCausalLM.from_pretrained(
            path, config=hf_config, attn_implementation=attn_implementation, dtype=torch.float32, local_files_only=True
        )
    return AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn_implementation, dtype=torch.float32)


def export_hf(
    state_dict: dict[str, torch.Tensor],
    hf_config,
    out_dir: str | Path,
    tokenizer: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``state_dict`` (full, unsharded) and ``hf_config`` as a HF directory loadable by from_pretrained.

    ``tokenizer`` (a tokenizer.json file, or a HF directory holding tokenizer files) is copied along.
    """
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in state_dict.items()}, strict=True, assign=True)
    model.tie_weights()
    model.config._attn_implementation = "sdpa"
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer = Path(tokenizer)
        files = [tokenizer] if tokenizer.is_file() else [tokenizer / n for n in _TOKENIZER_FILES]
        for file in files:
            if file.is_file():
                shutil.copyfile(file, out_dir / file.name)
    return out_dir

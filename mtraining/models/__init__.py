"""Adapters that route Hugging Face attention through mtraining's dense/sparse/ring attention."""

from .adapter import ATTN_IMPLEMENTATION, bind, mtraining_attention, no_mask, register
from .attention import Attention, PatternStats, StepStats
from .convert import convert_gguf
from .loader import RESIDUAL_OUTPUTS, Init, build_config, build_model, depth_scaled_init, export_hf
from .recall import kept_probability

register()

__all__ = [
    "ATTN_IMPLEMENTATION",
    "RESIDUAL_OUTPUTS",
    "Attention",
    "Init",
    "PatternStats",
    "StepStats",
    "bind",
    "build_config",
    "build_model",
    "convert_gguf",
    "depth_scaled_init",
    "export_hf",
    "kept_probability",
    "mtraining_attention",
    "no_mask",
    "register",
]

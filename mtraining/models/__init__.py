"""Adapters that route Hugging Face attention through mtraining's dense/sparse/ring attention."""

from .adapter import ATTN_IMPLEMENTATION, bind, mtraining_attention, register
from .attention import Attention, PatternStats, StepStats
from .loader import build_config, build_model, export_hf

register()

__all__ = [
    "ATTN_IMPLEMENTATION",
    "Attention",
    "PatternStats",
    "StepStats",
    "bind",
    "build_config",
    "build_model",
    "export_hf",
    "mtraining_attention",
    "register",
]

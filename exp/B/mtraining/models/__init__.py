"""Adapters that route Hugging Face attention through mtraining's dense/sparse/ring attention."""

from .adapter import ATTN_IMPLEMENTATION, AttentionContext, PatternStats, bind, mtraining_attention, register
from .loader import build_config, build_model, export_hf

register()

__all__ = [
    "ATTN_IMPLEMENTATION",
    "AttentionContext",
    "PatternStats",
    "bind",
    "build_config",
    "build_model",
    "export_hf",
    "mtraining_attention",
    "register",
]

"""Single-device math: oracle attention, the vertical-slash pattern, its estimation, Triton kernels."""

from .oracle import attention_oracle, merge_partials
from .pattern import VerticalSlashPattern

__all__ = ["VerticalSlashPattern", "attention_oracle", "merge_partials"]
from .budgets import Budgets, load_budgets
from .estimate import PatternConfig, estimate_pattern, last_query_partial_lse, line_scores, select_lines
from .synthetic import anchor_positions, random_qkv, rope_structured_qkv

__all__ += ["Budgets", "load_budgets", "PatternConfig", "estimate_pattern", "last_query_partial_lse", "line_scores"]
__all__ += ["select_lines", "anchor_positions", "random_qkv", "rope_structured_qkv"]

"""Single-device math: oracle attention, the vertical-slash pattern, its estimation, Triton kernels."""

from .oracle import attention_oracle, merge_partials
from .pattern import (
    Budgets,
    PatternConfig,
    VerticalSlashPattern,
    estimate_pattern,
    last_query_partial_lse,
    line_scores,
    load_budgets,
    select_lines,
)

__all__ = ["VerticalSlashPattern", "attention_oracle", "merge_partials"]
__all__ += ["Budgets", "load_budgets", "PatternConfig", "estimate_pattern", "last_query_partial_lse", "line_scores"]
__all__ += ["select_lines"]

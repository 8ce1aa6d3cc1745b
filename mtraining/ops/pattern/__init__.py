"""The vertical-slash pattern: its definition, its online estimation from q/k, per-head line budgets."""

from .budgets import Budgets, load_budgets
from .estimate import PatternConfig, estimate_pattern, last_query_partial_lse, line_scores, select_lines
from .vertical_slash import VerticalSlashPattern, compact

__all__ = ["Budgets", "load_budgets", "PatternConfig", "estimate_pattern", "last_query_partial_lse", "line_scores"]
__all__ += ["select_lines", "VerticalSlashPattern", "compact"]

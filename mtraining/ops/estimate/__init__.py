"""The pattern's online estimation from q/k (above the sparse op, which it runs): the lines chosen by the last
queries (estimator.py), per-head line budgets (budgets.py), per-block columns (block_columns.py; scored by the
sorted scorer of column_buckets.py or the dense one, each with a Triton kernel for CUDA)."""

from .budgets import Budgets, load_budgets
from .estimator import PatternConfig, estimate_pattern, last_query_partial_lse, line_scores, select_lines

__all__ = ["Budgets", "load_budgets", "PatternConfig", "estimate_pattern", "last_query_partial_lse", "line_scores"]
__all__ += ["select_lines"]

"""Single-device math: oracle attention, the vertical-slash pattern, its estimation, Triton kernels."""

from .oracle import attention_oracle, merge_partials
from .pattern import VerticalSlashPattern

__all__ = ["VerticalSlashPattern", "attention_oracle", "merge_partials"]

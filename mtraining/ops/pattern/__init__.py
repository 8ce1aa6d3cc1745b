"""The vertical-slash pattern's definition (vertical_slash.py): which pairs every path computes. Its estimation
from q/k lives above the sparse op, in ``ops.estimate``."""

from .vertical_slash import VerticalSlashPattern, compact

__all__ = ["VerticalSlashPattern", "compact"]

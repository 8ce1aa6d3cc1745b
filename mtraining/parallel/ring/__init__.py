"""Ring attention over a context-parallel group: flat and hierarchical schedules."""

from .attention import ring_attention

__all__ = ["ring_attention"]

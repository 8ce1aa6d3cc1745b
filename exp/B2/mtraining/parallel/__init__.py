"""Context parallelism: sequence layouts over ranks and the ring attention engine."""

from .layout import ContiguousLayout, Layout, StripedLayout, ZigzagLayout, make_layout
from .ring import ring_attention

__all__ = ["ContiguousLayout", "Layout", "StripedLayout", "ZigzagLayout", "make_layout", "ring_attention"]

"""Context parallelism: sequence layouts over ranks and the ring attention engine."""

from .layout import ContiguousLayout, Layout, StripedLayout, ZigzagLayout, make_layout

__all__ = ["ContiguousLayout", "Layout", "StripedLayout", "ZigzagLayout", "make_layout"]

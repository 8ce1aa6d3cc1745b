"""Context parallelism: sequence layouts over ranks, the ring attention engine and its cost model (``ring_cost``)."""

from . import ring_cost
from .layout import ContiguousLayout, Layout, StripedLayout, ZigzagLayout, make_layout
from .ring import ring_attention

__all__ = [
    "ContiguousLayout",
    "Layout",
    "StripedLayout",
    "ZigzagLayout",
    "make_layout",
    "ring_attention",
    "ring_cost",
]

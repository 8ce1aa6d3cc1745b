"""Ring attention over a context-parallel group: flat and hierarchical schedules, and the all-gather.

``Comm`` is the exchange ``ring_attention(..., outer_comm=)`` wraps (an emulated slow link, for example).
"""

from .attention import ring_attention
from .comm import Comm

__all__ = ["Comm", "ring_attention"]

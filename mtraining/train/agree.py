"""One outcome for all ranks: share what one rank knows, run a setup check everywhere and fail together.

A check that fails on one rank while the others go on to the next collective leaves them waiting
until the timeout; a check that fails on every rank prints the same message once per rank. ``agree``
gathers every rank's error (a small all-gather of strings) and raises the first one on all ranks
as a ``SharedError``, which the command line reports once, from rank 0. ``all_gather`` and
``from_rank0`` are the object collectives underneath (checkpoint commits, the export's outcome).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


class SharedError(ValueError):
    """The same error raised on every rank (reported once, by rank 0)."""


def all_gather(obj: Any) -> list[Any]:
    """Collective: every rank's ``obj`` (picklable), in rank order; ``[obj]`` without a process group."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def from_rank0(obj: Any) -> Any:
    """Collective: rank 0's ``obj`` on every rank; ``obj`` itself without a process group."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree(check: Callable[[], T]) -> T:
    """``check()`` on this rank; if it raised ValueError on any rank, SharedError on all. Collective
    over the default group when one is up."""
    error, result = None, None
    try:
        result = check()
    except ValueError as err:
        error = str(err)
    error = next((e for e in all_gather(error) if e), None)
    if error:
        raise SharedError(error)
    return result

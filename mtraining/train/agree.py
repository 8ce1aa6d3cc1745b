"""One outcome for all ranks: run a setup check everywhere (or on some ranks) and fail together.

A check that fails on one rank while the others go on to the next collective leaves them waiting
until the timeout; a check that fails on every rank prints the same message once per rank. ``agree``
gathers every rank's error (a small all-gather of strings) and raises the first one on all ranks
as a ``SharedError``, which the command line reports once, from rank 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")


class SharedError(ValueError):
    """The same error raised on every rank (reported once, by rank 0)."""


def agree(check: Callable[[], T]) -> T:
    """``check()`` on this rank; if it raised ValueError on any rank, SharedError on all. Collective
    over the default group when one is up with several ranks."""
    error, result = None, None
    try:
        result = check()
    except ValueError as err:
        error = str(err)
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
    if error:
        raise SharedError(error)
    return result

"""One outcome for all ranks: share what one rank knows, run a setup check everywhere and fail together.

A check that fails on one rank while the others go on to the next collective leaves them waiting
until the timeout; a check that fails on every rank prints the same message once per rank. ``agree``
gathers every rank's error (a small all-gather of strings) and raises the first one on all ranks
as a ``SharedError``, which the command line reports once, from rank 0. ``all_gather`` and
``from_rank0`` are the object collectives underneath (checkpoint commits, the export's outcome).
``check_same`` refuses values that differ between ranks (the config of each node, its data), naming
each key that differs and which ranks hold which value.
"""

from __future__ import annotations

import hashlib
import json
import os
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


def node() -> str | None:
    """This rank's node (torchrun's GROUP_RANK), None without torchrun."""
    return os.environ.get("GROUP_RANK")


def which_ranks(ranks: list[int], nodes: list[str | None]) -> str:
    """ "ranks 0-3, 8 (node 0, 2)" for ``ranks`` of a world whose ranks' nodes are ``nodes``."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = "ranks " + ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
    names = sorted({nodes[r] for r in ranks if nodes[r] is not None}, key=int)
    return text + (f" (node {', '.join(names)})" if names else "")


def _shown(value: str | None) -> str:
    """A value as a message shows it: short JSON as it is, a long one (a model's shapes) by its digest."""
    if value is None:
        return "unset"
    return value if len(value) <= 80 else f"<sha256 {hashlib.sha256(value.encode()).hexdigest()[:12]}>"


def check_same(values: dict[str, Any], what: str, fix: str) -> None:
    """Collective: SharedError on every rank unless every rank passes equal ``values`` (compared as JSON),
    naming each key that differs with its value on each group of ranks; ``what`` names the values (e.g.
    "configs"), ``fix`` ends the message."""
    mine = {key: json.dumps(value, sort_keys=True, default=str) for key, value in values.items()}
    every = all_gather((mine, node()))
    parts, nodes = [part for part, _ in every], [n for _, n in every]
    keys = [k for k in dict.fromkeys(k for part in parts for k in part) if len({p.get(k) for p in parts}) > 1]
    if not keys:
        return
    lines = []
    for key in keys[:8]:
        holders: dict[str | None, list[int]] = {}
        for rank, part in enumerate(parts):
            holders.setdefault(part.get(key), []).append(rank)
        lines.append(
            f"{key}: "
            + "; ".join(f"{_shown(value)} on {which_ranks(ranks, nodes)}" for value, ranks in holders.items())
        )
    more = f" and {len(keys) - 8} more keys" if len(keys) > 8 else ""
    raise SharedError(f"the ranks run with different {what} ({' | '.join(lines)}{more}); {fix}")

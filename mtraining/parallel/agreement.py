"""Every rank of a group must make the same collective call: a small all-gathered fingerprint checks it.

Ranks that disagree on the shapes, dtype, layout or pattern of a ring call either compute wrong outputs
without an error (a different layout per rank) or abort inside the communication library (transfers of
different sizes). ``check_ranks_agree`` all-gathers one 64-bit digest per field of the call and raises the
same ValueError on every rank, naming each field that differs and its value on every rank.

The verdict is kept per process group (a weak reference: it dies with the group) and per call (the
fields' values), so after the first call of a shape and layout the hot path pays a dictionary lookup and
no communication. The limit that comes with it: ranks that agreed on a call and later change it on some
ranks only are not caught (those wait in the check while the others go on to the ring).
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Hashable

import torch
import torch.distributed as dist

# Note [ring agreement]
# Every rank of a group makes the same collective call, or every rank raises the same ValueError.
# - Before any transfer, each call all-gathers one 64-bit digest per field (shapes, dtype, layout, pattern
#   grid, config, scale, schedule, backend, whether gradients flow) and compares them.
# - A mismatch names each differing field and every rank's value, on every rank alike: nobody hangs in
#   the communication library and nobody computes with another rank's layout.
# - The verdict is kept per process group and call, so only the first call of a shape communicates.
# - Not caught: ranks that agreed and later change the call on some ranks only; pattern contents, which
#   are global by construction (every rank estimates the same one).
# Callers: ring_attention (ring/attention.py) and estimate_pattern_cp (estimate.py).
_VERIFIED: weakref.WeakKeyDictionary[dist.ProcessGroup, set[tuple]] = weakref.WeakKeyDictionary()
_MAX_VERDICTS = 4096  # per group; the set starts over when full


def _digest(value: object) -> int:
    """A 64-bit digest of ``repr(value)``: the same on every process (unlike ``hash`` of a string)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little", signed=True)


def _hashable(value: object) -> Hashable:
    """The value itself where it hashes (the cheap key of the hot path), else its repr."""
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def check_ranks_agree(
    group: dist.ProcessGroup | None, device: torch.device, what: str, fields: dict[str, object]
) -> None:
    """Return if every rank of ``group`` passes equal ``fields`` (checked once per group and fields),
    else raise the same ValueError on every rank naming what differs. Collective on first use.

    Args:
        group: the process group (None: the default group).
        device: where the digests travel (the ring's device: CUDA under NCCL, CPU under gloo).
        what: the call, for the message (e.g. "ring_attention").
        fields: name -> value of everything the ranks must share; a value is compared by its repr, which
            must identify it (a layout, a config, shapes, numbers, strings).
    """
    group = group if group is not None else dist.group.WORLD
    key = tuple((name, _hashable(value)) for name, value in fields.items())
    verified = _VERIFIED.setdefault(group, set())
    if key in verified:
        return
    mine = torch.tensor([_digest(v) for v in fields.values()], dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    every = torch.stack(gathered)
    differ = (every != every[:1]).any(0).tolist()
    names = [name for name, d in zip(fields, differ) if d]
    if names:
        values: list[dict | None] = [None] * world
        dist.all_gather_object(values, {name: fields[name] for name in names}, group=group)
        detail = "; ".join(
            f"{name}: " + ", ".join(f"rank {r} {v[name]!r}" for r, v in enumerate(values)) for name in names
        )
        raise ValueError(
            f"the {world} ranks disagree on the {what} call ({detail}); every rank must make the same call "
            "(the same shapes, dtype, layout and pattern: its own shard of one global sequence)"
        )
    if len(verified) >= _MAX_VERDICTS:
        verified.clear()
    verified.add(key)

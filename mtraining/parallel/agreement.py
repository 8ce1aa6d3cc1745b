"""Every rank of a group must make the same collective call: a small all-gathered fingerprint checks it.

Ranks that disagree on the shapes, dtype, layout, pattern or documents of a ring call either compute wrong
outputs without an error (a different layout per rank) or wait forever inside the communication library
(transfers of different sizes, or one rank in a collective the others never enter). ``check_ranks_agree``
opens every collective call: it all-gathers one 64-bit digest of the call (its name and every field) and,
where the digests differ, all-gathers the fields themselves to raise the same ValueError on every rank,
naming each field that differs and its value on every rank.

It runs on every call, so a later call that differs on one rank is caught as the first one is; and since
every collective call of this package starts with it, ranks that enter different calls (one estimates
while another runs the ring) meet in two checks of equal size and get the error too, instead of a hang.
Per call it costs one all-gather of one int64 per rank and a host read of the result (a device sync
under NCCL); the digest of a call's fields is kept per value, so equal calls hash nothing again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable

import torch
import torch.distributed as dist

from ..ops.documents import Documents

# Note [ring agreement]
# Every rank of a group makes the same collective call, or every rank raises the same ValueError.
# - Every collective call of this package opens with check_ranks_agree: one all-gather of one 64-bit digest
#   per rank of the call's name and fields (shapes, dtype, layout, pattern grid, config, scale, schedule,
#   backend, documents, whether gradients flow), before any other collective.
# - Where the digests differ, the ranks gather the fields and raise the same error naming each one that
#   differs and every rank's value. Ranks that enter different calls meet in two checks of equal size and
#   fail together instead of hanging.
# - It runs on every call, so a later call that changes on one rank is caught like the first.
# - Not compared: pattern contents (global by construction), the tensors' values, and a rank that skips a
#   call (the others wait; the trainer's watchdog turns the time-out into exit 4).
# Callers: ring_attention (ring/attention.py), estimate_pattern_cp (estimate.py), the model's read of packed
# position ids under context parallelism (models/attention.py).
_DIGESTS: dict[tuple, int] = {}
_MAX_DIGESTS = 4096  # the table starts over when full


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


def documents_field(documents: object) -> object:
    """How a call's ``documents`` enter its fields: None where nothing is masked (None, or one document per
    row), else the boundaries' digest (other objects by type: the call refuses them after the check)."""
    if documents is None:
        return None
    if isinstance(documents, Documents):
        return None if documents.single else documents.digest()
    return type(documents).__name__


def check_ranks_agree(
    group: dist.ProcessGroup | None, device: torch.device, what: str, fields: dict[str, object]
) -> None:
    """Return if every rank of ``group`` makes the call ``what`` with equal ``fields``, else raise the same
    ValueError on every rank naming what differs. Collective, on every call.

    Args:
        group: the process group (None: the default group).
        device: where the digests travel (the ring's device: CUDA under NCCL, CPU under gloo).
        what: the call, for the message (e.g. "ring_attention").
        fields: name -> value of everything the ranks must share; a value is compared by its repr, which
            must identify it (a layout, a config, shapes, numbers, strings).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"{what} is collective over a process group, but torch.distributed is not initialised: call "
            "torch.distributed.init_process_group(...) on every rank first (torchrun, or "
            "mtraining.train.launch.run_local), or on one device call sparse_attention / estimate_pattern"
        )
    key = (what, *((name, type(value), _hashable(value)) for name, value in fields.items()))  # 1 == 1.0: typed
    digest = _DIGESTS.get(key)
    if digest is None:
        digest = _digest((what, [(name, repr(value)) for name, value in fields.items()]))
        if len(_DIGESTS) >= _MAX_DIGESTS:
            _DIGESTS.clear()
        _DIGESTS[key] = digest
    mine = torch.full((1,), digest, dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    if len(set(torch.cat(gathered).tolist())) == 1:
        return
    described: list[dict | None] = [None] * world
    dist.all_gather_object(described, {"call": what, **{n: repr(v) for n, v in fields.items()}}, group=group)
    raise ValueError(_disagreement(what, described))


def _disagreement(what: str, described: list[dict]) -> str:
    """The message for ranks whose calls (name and field values, as reprs) differ."""
    world = len(described)
    calls = [d["call"] for d in described]
    if len(set(calls)) > 1:
        detail = ", ".join(f"rank {r} {c}" for r, c in enumerate(calls))
        return (
            f"the {world} ranks make different collective calls ({detail}); every rank must make the same calls "
            "in the same order (the same model, layers and inputs on every rank)"
        )
    names = [n for n in described[0] if n != "call"]
    names += [n for d in described[1:] for n in d if n not in names and n != "call"]
    differ = [n for n in names if len({d.get(n, "(absent)") for d in described}) > 1]
    detail = "; ".join(
        f"{n}: " + ", ".join(f"rank {r} {d.get(n, '(absent)')}" for r, d in enumerate(described)) for n in differ
    )
    return (
        f"the {world} ranks disagree on the {what} call ({detail}); every rank must make the same call "
        "(the same shapes, dtype, layout, pattern and documents: its own shard of one global sequence)"
    )

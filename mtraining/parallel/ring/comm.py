"""Asynchronous ring exchange: send a buffer to the next rank while receiving one from the previous.

The ring engines double-buffer: while a step computes on one buffer, the next step's data lands in
the other. ``RingComm.start`` posts the send and the receive (``dist.batch_isend_irecv``) and
returns at once; ``Transfer.wait`` is called only when the received data is needed.

On CUDA the transfer is ordered on a dedicated side stream, never on the compute stream:
- at ``start`` the side stream waits for the compute queued so far (the send buffer was written by
  it, and the receive buffer was last read by it: the step before), then the P2P ops are posted
  from the side stream and the side stream waits for their completion and records an event;
- at ``wait`` the compute stream waits for that event only, so compute issued after ``start`` runs
  concurrently with the transfer, and later transfers on the side stream are not waited for.
Every buffer is allocated before the ring loop and outlives it, and the compute stream waits for
the last transfer, so the caching allocator never hands out memory the side stream still uses.
On the CPU (gloo) the ops run on gloo's threads and ``wait`` blocks on them.

A ``RingComm`` is built per ring call (it only looks up the neighbours' global ranks and takes a side
stream from torch's pool), so nothing is cached on process-group objects. Anything with the same
``start`` (``Comm``) can stand in for it, e.g. a benchmark's emulated slow link (bench/links.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor


class Transfer:
    """One posted exchange; ``wait`` makes its received data usable by the compute that follows."""

    def __init__(self, works: list, done: torch.cuda.Event | None, tensors: tuple[Tensor, ...]) -> None:
        self._works = works
        self._done = done
        self._tensors = tensors  # kept alive until waited for: the side stream may still use them

    def wait(self) -> None:
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)
        else:
            for work in self._works:
                work.wait()


class Posted(Protocol):
    """A posted exchange (``Transfer``, or a stand-in's)."""

    def wait(self) -> None: ...


class Comm(Protocol):
    """What the ring schedules need of a communicator: post an exchange with the ring neighbours."""

    def start(self, send: Sequence[Tensor], recv: Sequence[Tensor], tag: int = 0) -> Posted: ...


class RingComm:
    """P2P to this rank's ring neighbours in ``group``: send to rank + 1, receive from rank - 1."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self._next = dist.get_global_rank(self.group, (self.rank + 1) % self.world_size)
        self._prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world_size)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self, send: Sequence[Tensor], recv: Sequence[Tensor], tag: int = 0) -> Transfer:
        """Post send(send[i] -> next) and recv(recv[i] <- prev) for every i; returns immediately."""
        ops = [dist.P2POp(dist.isend, t, self._next, self.group, tag) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self._prev, self.group, tag) for t in recv]
        tensors = (*send, *recv)
        if self._stream is None:
            return Transfer(dist.batch_isend_irecv(ops), None, tensors)
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            works = dist.batch_isend_irecv(ops)
            for work in works:
                work.wait()  # on CUDA: the side stream (not the host) waits for the P2P kernels
            done = torch.cuda.Event()
            done.record(self._stream)
        return Transfer(works, done, tensors)


def spares(like: Tensor, count: int, dtype: torch.dtype | None = None) -> list[tuple[Tensor, Tensor]]:
    """``count`` contiguous receive buffers for a pair shaped like ``like`` (k and v, or dk and dv)."""
    make = functools.partial(torch.empty, like.shape, dtype=dtype or like.dtype, device=like.device)
    return [(make(), make()) for _ in range(count)]

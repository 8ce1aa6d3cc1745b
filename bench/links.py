"""The emulation of a slow link between GPUs in a real ring, for benchmarks and tests.

``Link`` (mtraining/parallel/ring_cost.py) is what the ring cost model predicts with and what ``EmulatedComm`` makes the
hierarchical ring's outer transfers take (``ring_attention(..., ring="hierarchical",
outer_comm=emulated(link))``): a transfer of ``B`` bytes (what this rank sends; the link is full
duplex, one NIC per GPU) is modelled to take ``latency + B / bandwidth``. The real transfer is posted as usual; its completion
is then held back until that modelled time has passed since it was posted, so the transfer takes
max(real, modelled) -- the real one on a fast local link is the smaller:

- CPU (gloo): ``wait`` waits for the real transfer, then sleeps the thread until the deadline;
- CUDA: at ``start`` a delay stream (after the compute queued so far, like the transfer's side
  stream) spins for the modelled time (``torch.cuda._sleep``, calibrated once against CUDA events)
  and records an event; ``wait`` makes the compute stream wait for the real transfer and for it.

Results measured with it must say so: ``Link.label`` (e.g. "emulated 25 GB/s, 5 us") goes into the
``outer_link`` field of a benchmark record.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from mtraining.parallel import ring_cost
from mtraining.parallel.ring import Comm


def emulated(link: ring_cost.Link) -> Callable[[Comm], EmulatedComm]:
    """``outer_comm`` for ``ring_attention``: the hierarchical ring's outer transfers as slow as ``link``."""
    return functools.partial(EmulatedComm, link=link)


@functools.lru_cache(maxsize=8)
def _cycles_per_second(device_index: int) -> float:
    """GPU clock as seen by ``torch.cuda._sleep`` on this device, measured with CUDA events."""
    with torch.cuda.device(device_index):
        cycles = 10_000_000
        torch.cuda._sleep(cycles // 10)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / (start.elapsed_time(end) / 1e3)


class _DelayedTransfer:
    def __init__(self, real, deadline: float | None, event) -> None:
        self._real = real
        self._deadline = deadline
        self._event = event

    def wait(self) -> None:
        self._real.wait()
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        elif self._deadline is not None:
            remaining = self._deadline - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)


class EmulatedComm:
    """A ring communicator (``Comm``) whose transfers complete no earlier than ``link`` would deliver them."""

    def __init__(self, comm: Comm, link: ring_cost.Link) -> None:
        self.comm = comm
        self.link = link
        self._stream = None

    def start(self, send: Sequence[Tensor], recv: Sequence[Tensor], tag: int = 0) -> _DelayedTransfer:
        nbytes = sum(t.numel() * t.element_size() for t in send)
        seconds = self.link.seconds(nbytes)
        posted = time.perf_counter()
        real = self.comm.start(send, recv, tag)
        if send and send[0].is_cuda:
            device = send[0].device
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._stream):
                torch.cuda._sleep(int(seconds * _cycles_per_second(device.index or 0)))
                event = torch.cuda.Event()
                event.record(self._stream)
            return _DelayedTransfer(real, None, event)
        return _DelayedTransfer(real, posted + seconds, None)

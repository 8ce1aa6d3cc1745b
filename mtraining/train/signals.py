"""Preemption on the ranks: SIGTERM asks the run to stop after the current step, every rank at the same one.

A scheduler that preempts a job sends SIGTERM (torchrun passes it to every rank) and kills what is
left after a grace period. Inside ``StopSignal`` SIGTERM only sets a flag, so the step in progress
finishes; ``agreed()`` then takes the maximum of the flag over all ranks (one tiny all-reduce per
step), so ranks that got the signal at different moments still stop after the same step, save a
checkpoint together and exit with ``Preempted.exit_code`` (errors.py).
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist


# Note [stopping together]
# SIGTERM only sets a flag. The trainer asks StopSignal.agreed() once per step, a single all-reduce (MAX)
# of that flag, so every rank sees the stop at the same step, saves a checkpoint together and exits 143.
# A rank that stopped alone would leave the others waiting in a collective.
class StopSignal:
    """Context manager: SIGTERM sets a flag (main thread only; elsewhere it keeps its default action)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.received = False
        self._previous = None

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _handle(self, signum, frame) -> None:
        self.received = True

    def agreed(self) -> bool:
        """Collective: True on every rank once any rank has received SIGTERM (a world of one asks nobody)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.received
        flag = torch.tensor([int(self.received)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

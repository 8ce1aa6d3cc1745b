"""Notice a stalled step and name the rank that stopped responding.

Every rank runs a thread that ticks a heartbeat counter in the process group's store every
``poll_s`` seconds, and counts the steps its rank finished there. When a step of this rank runs
longer than ``min(timeout / 2, max(10 x the median earlier step, 60 s))`` it prints which ranks have
stopped ticking (a paused or dead process) or are a step behind, while the collective they are
awaited in is still waiting; the first step (compilation, warm-up) has no earlier steps and is never
flagged. When the collective then fails (it timed out after ``parallel.timeout_minutes``, or a
peer's connection closed), ``stalled`` turns the error into a ``RankStalled`` that names the step
and those ranks.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from .errors import RankStalled

_PREFIX = "mtraining/watchdog/"
# what gloo and NCCL say when a collective cannot complete
_COLLECTIVE_FAILURES = (
    "Timed out",
    "timed out",
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL",
)


def is_collective_failure(err: BaseException) -> bool:
    """True for the errors of a collective that timed out or lost a peer."""
    return isinstance(err, dist.DistBackendError) or any(s in str(err) for s in _COLLECTIVE_FAILURES)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class StepWatchdog:
    """See the module docstring; ``step_started``/``step_finished`` bracket each training step."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout_s: float,
        store: dist.Store | None = None,
        report: Callable[[str], None] = _stderr,
        factor: float = 10.0,
        floor_s: float = 60.0,
    ) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.poll_s = min(10.0, max(0.2, timeout_s / 30))
        self.factor, self.floor_s, self.report = factor, floor_s, report
        self._store = store
        self._step: int | None = None
        self._started = 0.0
        self._durations: list[float] = []
        self._warned: int | None = None
        self._suspects: str | None = None
        self._silent: list[int] = []
        self._stop = threading.Event()
        self._thread = None
        if store is not None and world_size > 1:
            self._thread = threading.Thread(target=self._loop, name="mtraining-watchdog", daemon=True)
            self._thread.start()

    @classmethod
    def for_default_group(cls, timeout_s: float) -> StepWatchdog:
        """A watchdog on the default process group's store (none for a world of one)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        store = dist.distributed_c10d._get_default_store() if world > 1 else None
        return cls(rank, world, timeout_s, store)

    # ------------------------------------------------------------------ the training loop's side
    def step_started(self, step: int) -> None:
        self._started, self._step = time.monotonic(), step

    def step_finished(self) -> None:
        self._durations.append(time.monotonic() - self._started)
        self._step = None
        if self._store is not None:
            self._store.add(f"{_PREFIX}done/{self.rank}", 1)

    def stalled(self, step: int, err: BaseException) -> RankStalled:
        """The error to raise when a collective of ``step`` failed (``is_collective_failure``)."""
        why = self._suspects or self._find_suspects(step)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return RankStalled(
            f"step {step} stalled: a collective did not complete ({first}); {why}. "
            f"Ranks wait parallel.timeout_minutes={self.timeout_s / 60:g} for each other before giving up"
        )

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.poll_s + 1)

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        beat = f"{_PREFIX}beat/{self.rank}"
        try:
            while not self._stop.wait(self.poll_s):
                self._store.add(beat, 1)
                self._check()
        except Exception:  # the store went away: the job is ending
            return

    def _limit(self) -> float | None:
        """Seconds after which a step counts as stalled; None before any step finished (warm-up)."""
        if not self._durations:
            return None
        typical = statistics.median(self._durations[-20:])
        return min(self.timeout_s / 2, max(self.factor * typical, self.floor_s))

    def _check(self) -> None:
        step, limit = self._step, self._limit()
        if step is None or limit is None or step == self._warned:
            return
        elapsed = time.monotonic() - self._started
        if elapsed < limit:
            return
        self._warned = step
        self._suspects = self._find_suspects(step)
        if self._reports():
            typical = statistics.median(self._durations[-20:])
            self.report(
                f"[rank {self.rank}] step {step} has run {elapsed:.0f} s (earlier steps took {typical:.2g} s): "
                f"{self._suspects}; the job ends when a collective times out "
                f"(parallel.timeout_minutes={self.timeout_s / 60:g})"
            )

    def _counts(self, kind: str) -> list[int]:
        return [self._store.add(f"{_PREFIX}{kind}/{r}", 0) for r in range(self.world_size)]

    def _find_suspects(self, step: int) -> str:
        """Which ranks stopped ticking (two reads of the heartbeats apart) or have not finished the step before."""
        self._silent = []
        if self._store is None:
            return "a rank stopped responding"
        try:
            before = self._counts("beat")
            time.sleep(min(3 * self.poll_s, 5.0))
            after, done = self._counts("beat"), self._counts("done")
        except Exception:
            return "a rank stopped responding"
        self._silent = [r for r in range(self.world_size) if r != self.rank and before[r] == after[r]]
        behind = [r for r in range(self.world_size) if done[r] < max(done)]
        parts = []
        if self._silent:
            parts.append(f"rank {_ranks(self._silent)} stopped responding (no heartbeat: paused or dead)")
        if behind:
            parts.append(f"rank {_ranks(behind)} did not finish step {step - 1}")
        return "; ".join(parts) or "every rank is alive but one is stuck inside the step (a hang or a mismatched call)"

    def _reports(self) -> bool:
        """One rank reports: the lowest that is still responding."""
        alive = [r for r in range(self.world_size) if r not in self._silent]
        return bool(alive) and alive[0] == self.rank


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)

"""The stage machinery of an experiment's driver: one log, atomic JSON files, a clock per stage that refuses to
start one that would end past the call's deadline (--max-minutes), and the refusals that end a run early.

A driver appends its log file to ``LOG`` and sets ``Clock.deadline``; every stage runs inside ``with Clock(...)``.
A stage's output is written whole or not at all (``write_json``), so a stopped call leaves nothing half-made and
the next call skips what exists.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

from bench.common import written

LOG: list[Path] = []
T0 = time.time()


class OutOfTime(Exception):
    """--max-minutes passed: stop before the next stage (its outputs so far are kept)."""


class Refused(ValueError):
    """The command asks for something its work folder cannot give; the message names the fix."""


def say(*parts) -> None:
    """Print (and append to every file of ``LOG``) one line with the wall-clock time and the time since start."""
    line = f"[{time.strftime('%H:%M:%S')} +{time.time() - T0:6.0f}s] " + " ".join(str(p) for p in parts)
    print(line, flush=True)
    for path in LOG:
        with open(path, "a") as f:
            f.write(line + "\n")


def write_json(path: Path, data) -> None:
    """Write atomically: a stage's output exists whole or not at all."""
    with written(path) as tmp:
        tmp.write_text(json.dumps(data, indent=1) + "\n")


def cpu_seconds(children_only: bool = False) -> float:
    """User+sys CPU time of this process and of its finished child processes (ranks, trainings); ``children_only``:
    of the children alone (a training's, without what this process prepares in the background meanwhile)."""
    who = (resource.RUSAGE_CHILDREN,) if children_only else (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, who))


class Clock:
    """CPU time (``cpu_seconds``) and wall time of one stage; refuses to start one that would end past
    --max-minutes (``expected``: how long the stage is expected to take; trainings stop at the deadline)."""

    deadline: float | None = None

    def __init__(self, expected: float = 0.0, children_only: bool = False) -> None:
        self.expected, self.children_only = expected, children_only

    def __enter__(self) -> Clock:
        left = Clock.left()
        if left is not None and self.expected > left:
            raise OutOfTime(
                f"the next stage is expected to take up to {self.expected:.0f}s and {max(left, 0):.0f}s are left"
            )
        self.started, self.before = time.time(), cpu_seconds(self.children_only)
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = round(time.time() - self.started, 1)
        self.cpu_s = round(cpu_seconds(self.children_only) - self.before, 1)

    @staticmethod
    def stop_after(minutes: float | None) -> None:
        """Set the deadline ``minutes`` after this process started (None: no deadline)."""
        Clock.deadline = None if minutes is None else T0 + 60 * minutes

    @staticmethod
    def left() -> float | None:
        """Seconds until the deadline (None without one)."""
        return None if Clock.deadline is None else Clock.deadline - time.time()

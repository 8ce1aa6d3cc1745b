"""CPU work of pipeline.py done while the GPU trains: the corpus files and the evaluation prompts.

``Background`` runs named jobs one after another on a thread of the calling process; their CPU-heavy parts go
to ``Pool``, a spawn process pool of the spare cores (``spare_cores``). ``Parts`` is a manifest of named
files written by such jobs (or in place, without a ``Background``): each is recorded as it completes, and
``parts[name]`` waits for its own. A job that fails raises ``PreparationFailed`` where its result is waited for;
a worker that dies breaks the pool (``BrokenProcessPool``), which fails the jobs instead of hanging them.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

from bench.common import written


class PreparationFailed(RuntimeError):
    """A background job (a corpus file, the prompts) failed; the message names it and its error."""


class Stopped(Exception):
    """The pool was stopped (the run ends): the job gives up at its next round of work."""


class Pool:
    """``workers`` spawn processes; ``map`` (results in order) refuses new work once ``stop`` was called, so a job
    stops between rounds instead of keeping the call alive."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._executor = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        self._stopped = threading.Event()

    def map(self, fn: Callable, jobs: Iterable) -> list:
        if self._stopped.is_set():
            raise Stopped
        return list(self._executor.map(fn, jobs))

    def stop(self) -> None:
        """Refuse new work and cancel what no worker has started (a job waiting for it fails at once)."""
        self._stopped.set()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        self.stop()
        self._executor.shutdown(wait=True)


def spare_cores() -> int:
    """The cores left to the pool: all but one for the training and one for this process (the background thread
    joins and saves what the pool returns), at least one."""
    return max(1, (os.cpu_count() or 1) - 2)


class Background:
    """Jobs run in submission order on one thread of this process (their heavy work on ``pool``); ``wait(name)``
    returns a job's result or raises ``PreparationFailed``. Closing stops what has not finished (between rounds)."""

    def __init__(self, workers: int | None = None) -> None:
        self.pool = Pool(workers or spare_cores())
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="extension-background")
        self._jobs: dict[str, Future] = {}

    def submit(self, name: str, fn: Callable, *args) -> Callable[[], object]:
        """Queue ``fn(*args)`` as job ``name``; returns a function that waits for its result."""
        self._jobs[name] = self._thread.submit(fn, *args)
        return lambda: self.wait(name)

    def wait(self, name: str):
        try:
            return self._jobs[name].result()
        except Exception as e:
            raise PreparationFailed(f"preparing {name} in the background failed: {type(e).__name__}: {e}") from e

    def __enter__(self) -> Background:
        return self

    def __exit__(self, *exc) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)  # jobs not started: dropped
        self.pool.stop()  # the running job: stops at its next round of pool work
        self._thread.shutdown(wait=True)
        self.pool.close()


class Parts(Mapping):
    """A manifest (``folder/manifest.json``: ``made_for`` and one entry per part) of parts made in order by
    ``makers`` (name -> function returning the part's entry, its files written whole or not at all). Parts the
    manifest already records are kept; the others are made, in ``background`` or here and now, and each is
    recorded as soon as it is complete, so a call that stops anywhere leaves a manifest the next call completes.
    ``parts[name]`` waits for that part; ``complete()`` for all of them."""

    def __init__(
        self,
        folder: Path,
        made_for: dict,
        entries: dict,
        makers: dict[str, Callable[[], object]],
        background: Background | None,
        log: Callable[[str, object], None],
    ) -> None:
        self.folder, self.made_for, self._log = folder, made_for, log
        self._entries = dict(entries)
        self._names = list(dict.fromkeys([*entries, *makers]))
        self._waits: dict[str, Callable[[], object]] = {}
        for name, make in makers.items():
            if name in self._entries:
                continue
            if background is None:
                self._make(name, make)
            else:
                self._waits[name] = background.submit(f"corpus {name}", self._make, name, make)

    def _make(self, name: str, make: Callable[[], object]) -> None:
        """Make part ``name`` and record it (one thread makes every part: the manifest has one writer)."""
        self._entries[name] = make()
        with written(self.folder / "manifest.json") as tmp:
            tmp.write_text(json.dumps(self._entries | {"made_for": self.made_for}, indent=1) + "\n")
        self._log(name, self._entries[name])

    def __getitem__(self, name: str):
        if name in self._waits:  # at once when the part is made
            self._waits[name]()
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def complete(self) -> dict:
        """Every part's entry and ``made_for``, as the manifest holds them once every part is written."""
        return {name: self[name] for name in self} | {"made_for": self.made_for}

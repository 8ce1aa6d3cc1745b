"""Run a function on several gloo ranks: one pool of CPU worker processes, started once per test module.

Four workers join one default process group (a FileStore, no ports) and create the subgroups the
tests use, so one start-up (a few seconds) serves every world size:

    world size 1: ranks [0]   2: ranks [1, 3] (non-zero-based: checks group-rank translation)
    world size 3: ranks [0, 1, 2]   4: the default group (passed as ``group=None``)

``pool.run(fn, world_size, *args)`` calls ``fn(group, *args)`` on each member rank and returns the
results in group-rank order. ``fn`` must be importable (module level). Tasks and results travel as
plain pickles (tensors copied, no shared-memory handles). A failure on any rank raises in the
caller with that rank's traceback; a hang (e.g. an unmatched send) times out and restarts the pool.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import shutil
import tempfile
import traceback
from collections.abc import Callable

import torch.multiprocessing as mp

GROUP_RANKS: dict[int, list[int] | None] = {1: [0], 2: [1, 3], 3: [0, 1, 2], 4: None}
NPROCS = 4


def _worker(rank: int, store_path: str, tasks, results) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, NPROCS)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=NPROCS, timeout=datetime.timedelta(seconds=60))
    groups = {size: (dist.new_group(ranks) if ranks is not None else None) for size, ranks in GROUP_RANKS.items()}
    while (task := tasks.get()) is not None:
        try:
            fn, size, args = pickle.loads(task)
            reply = ("ok", fn(groups[size], *args))
        except BaseException:
            reply = ("error", traceback.format_exc())
        results.put((rank, pickle.dumps(reply)))
    dist.destroy_process_group()


class ProcessPool:
    """Persistent gloo workers; see the module docstring."""

    def __init__(self, timeout: float = 120.0) -> None:
        self.timeout = timeout
        self._procs: list = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="mtraining-gloo-")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(NPROCS)]
        store = os.path.join(self._dir, "store")
        self._procs = [
            ctx.Process(target=_worker, args=(r, store, self._tasks[r], self._results), daemon=True)
            for r in range(NPROCS)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable, world_size: int, *args) -> list:
        """fn(group, *args) on each rank of the world_size group; results in group-rank order."""
        if not self._procs:
            self._start()
        ranks = GROUP_RANKS[world_size] or list(range(NPROCS))
        task = pickle.dumps((fn, world_size, args))
        for r in ranks:
            self._tasks[r].put(task)
        replies: dict[int, tuple] = {}
        try:
            while len(replies) < len(ranks):
                rank, reply = self._results.get(timeout=self.timeout)
                replies[rank] = pickle.loads(reply)
        except queue.Empty:
            self.close()
            raise TimeoutError(
                f"ranks {sorted(set(ranks) - set(replies))} did not answer in {self.timeout} s"
            ) from None
        errors = [f"rank {r}:\n{msg}" for r, (status, msg) in sorted(replies.items()) if status == "error"]
        if errors:
            raise AssertionError("\n".join(errors))
        return [replies[r][1] for r in ranks]

    def close(self) -> None:
        """Stop the workers (politely, then by handle) and remove the store."""
        for t in self._tasks if self._procs else []:
            t.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        if self._procs:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._procs = []

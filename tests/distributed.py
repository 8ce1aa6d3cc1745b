"""Run a function on several gloo ranks: one pool of CPU worker processes, started once per test module.

Four workers join one default process group (a FileStore, no ports) and create the subgroups the
tests use, so one start-up (a few seconds) serves every world size:

    world size 1: ranks [0]   2: ranks [1, 3] (non-zero-based: checks group-rank translation)
    world size 3: ranks [0, 1, 2]   4: the default group (passed as ``group=None``)

``pool.run(fn, world_size, *args)`` calls ``fn(group, *args)`` on each member rank and returns the
results in group-rank order. ``fn`` must be importable (module level). Tasks and results travel as
plain pickles (tensors copied, no shared-memory handles). A failure on any rank raises in the
caller with that rank's traceback; a worker that dies is noticed at once, and workers that do not
answer within ``grace_s`` of another's failure (blocked in a collective with it) or within
``timeout`` (a hang, e.g. an unmatched send) are killed and the pool restarts on the next run
(mtraining.train.launch.collect_replies).
"""

from __future__ import annotations

import datetime
import os
import pickle
import shutil
import tempfile
import traceback
from collections.abc import Callable

import torch.multiprocessing as mp

from mtraining.train.launch import collect_replies

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

    def __init__(self, timeout: float = 120.0, grace_s: float = 10.0) -> None:
        self.timeout, self.grace_s = timeout, grace_s
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
        try:
            replies = collect_replies(self._results, self._procs, ranks, self.timeout, self.grace_s)
        except TimeoutError:
            self.close(polite=False)
            raise
        if any(status == "lost" for status, _ in replies.values()):
            self.close(polite=False)  # a dead or stuck worker: the next run starts a fresh pool
        errors = [f"rank {r}:\n{msg}" for r, (status, msg) in sorted(replies.items()) if status != "ok"]
        if errors:
            raise AssertionError("\n".join(errors))
        return [replies[r][1] for r in ranks]

    def close(self, polite: bool = True) -> None:
        """Stop the workers (asked to finish, else by handle) and remove the store."""
        for t in self._tasks if self._procs and polite else []:
            t.put(None)
        for p in self._procs:
            p.join(timeout=10 if polite else 0)
            if p.is_alive():
                p.kill()
                p.join()
        if self._procs:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._procs = []

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
``timeout`` (a hang, e.g. an unmatched send) are killed and the pool restarts on the next run.
The workers are ``mtraining.train.launch.LocalRanks`` (start, dead-rank detection, stop), as in ``run_local``.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable

import torch.multiprocessing as mp

from mtraining.train.launch import LocalRanks, answer, join_gloo, results_in_order

GROUP_RANKS: dict[int, list[int] | None] = {1: [0], 2: [1, 3], 3: [0, 1, 2], 4: None}
NPROCS = 4


def _call(task: bytes, groups: dict) -> object:
    fn, size, args = pickle.loads(task)
    return fn(groups[size], *args)


def _worker(rank: int, store_path: str, results, tasks: list) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch.distributed as dist

    join_gloo(rank, NPROCS, store_path, group_timeout_s=60)
    groups = {size: (dist.new_group(ranks) if ranks is not None else None) for size, ranks in GROUP_RANKS.items()}
    while (task := tasks[rank].get()) is not None:
        results.put((rank, answer(_call, task, groups)))
    dist.destroy_process_group()


class ProcessPool:
    """Persistent gloo workers; see the module docstring."""

    def __init__(self, timeout: float = 120.0, grace_s: float = 10.0) -> None:
        self.timeout, self.grace_s = timeout, grace_s
        self._ranks: LocalRanks | None = None

    def run(self, fn: Callable, world_size: int, *args) -> list:
        """fn(group, *args) on each rank of the world_size group; results in group-rank order."""
        if self._ranks is None:
            self._tasks = [mp.get_context("spawn").Queue() for _ in range(NPROCS)]
            self._ranks = LocalRanks.start(_worker, NPROCS, self._tasks, start_method="spawn")
        ranks = GROUP_RANKS[world_size] or list(range(NPROCS))
        task = pickle.dumps((fn, world_size, args))
        for r in ranks:
            self._tasks[r].put(task)
        try:
            replies = self._ranks.collect(ranks, self.timeout, self.grace_s)
        except TimeoutError:
            self.close(polite=False)
            raise
        if any(status == "lost" for status, _ in replies.values()):
            self.close(polite=False)  # a dead or stuck worker: the next run starts a fresh pool
        return results_in_order(replies, ranks, AssertionError)

    def close(self, polite: bool = True) -> None:
        """Stop the workers (asked to finish, else by handle) and remove the store."""
        if self._ranks is None:
            return
        for t in self._tasks if polite else []:
            t.put(None)
        self._ranks.stop(wait_s=10 if polite else 0)
        self._ranks = None

"""Run a function on several local CPU ranks joined by gloo (tests, notebooks, quick experiments).

``run_local(fn, world_size, *args)`` starts ``world_size`` processes that share one default
process group (a FileStore, no ports), calls ``fn(*args)`` on each and returns the results in rank
order. A failure on any rank raises here with that rank's traceback, as soon as it is known: a rank
that dies without answering (killed, crashed in C++) is noticed within a fraction of a second, and
once one rank has failed the others get ``grace_s`` to answer (a peer blocked in a collective with
the failed rank would otherwise wait out the group's timeout) before they are killed. The "fork" start method
reuses the parent's imports (torch, transformers), so start-up takes well under a second; ``fn``
must then not rely on state the parent created after importing (open process groups, threads).
For real jobs use torchrun (``mtraining train --nproc N``, on one node or several: train/torchrun.py).
``LocalRanks`` (start processes, collect their replies, stop them) is what ``run_local`` and the tests'
persistent worker pool (tests/distributed.py) are built from.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def join_gloo(rank: int, world_size: int, store_path: str, group_timeout_s: float) -> None:
    """Join the default gloo group of ``world_size`` local ranks through a FileStore (no ports)."""
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    timeout = datetime.timedelta(seconds=group_timeout_s)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)


def answer(fn: Callable, *args) -> bytes:
    """A rank's reply: the pickled ("ok", fn(*args)), or ("error", traceback) when it raises."""
    try:
        reply = ("ok", fn(*args))
    except BaseException:
        reply = ("error", traceback.format_exc())
    return pickle.dumps(reply)


@dataclass
class LocalRanks:
    """``world_size`` local processes, each running ``target(rank, store_path, results, *extra)``, that put
    ``(rank, answer(...))`` on ``results``. ``start`` them, ``collect`` their replies, ``stop`` them."""

    procs: list
    results: Any  # a multiprocessing queue of (rank, pickled reply)
    store_path: str
    _dir: str

    @classmethod
    def start(cls, target: Callable, world_size: int, *extra, start_method: str = "fork") -> LocalRanks:
        ctx = mp.get_context(start_method)
        tmp = tempfile.mkdtemp(prefix="mtraining-ranks-")
        results, store = ctx.Queue(), os.path.join(tmp, "store")
        procs = [ctx.Process(target=target, args=(r, store, results, *extra), daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        return cls(procs, results, store, tmp)

    def collect(self, ranks: list[int], timeout: float, grace_s: float) -> dict[int, tuple]:
        """The replies of ``ranks`` (``collect_replies``)."""
        return collect_replies(self.results, self.procs, ranks, timeout, grace_s)

    def stop(self, wait_s: float = 10.0, lost: Iterable[int] = ()) -> None:
        """Wait up to ``wait_s`` for each process to end (not for the ``lost`` ones), kill what is left, and
        remove the store."""
        lost = set(lost)
        for r, p in enumerate(self.procs):
            p.join(timeout=0 if r in lost else wait_s)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(self._dir, ignore_errors=True)


def results_in_order(replies: dict[int, tuple], ranks: list[int], error: type[Exception]) -> list:
    """The values of ``ranks``' replies in that order; ``error`` with every failed rank's message otherwise."""
    errors = [f"rank {r}:\n{msg}" for r, (status, msg) in sorted(replies.items()) if status != "ok"]
    if errors:
        raise error("\n".join(errors))
    return [replies[r][1] for r in ranks]


def _entry(rank: int, store_path: str, results, world_size: int, payload: bytes, group_timeout_s: float) -> None:
    def call() -> Any:
        fn, args = pickle.loads(payload)
        join_gloo(rank, world_size, store_path, group_timeout_s)
        return fn(*args)

    try:
        reply = answer(call)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    results.put((rank, reply))


def run_local(
    fn: Callable,
    world_size: int,
    *args,
    timeout: float = 300.0,
    start_method: str = "fork",
    group_timeout_s: float = 120.0,
    grace_s: float = 10.0,
) -> list:
    """``fn(*args)`` on ``world_size`` gloo ranks; their return values (picklable) in rank order.

    ``group_timeout_s`` is the process group's collective timeout.
    """
    payload = pickle.dumps((fn, args))
    ranks = LocalRanks.start(_entry, world_size, world_size, payload, group_timeout_s, start_method=start_method)
    everyone = list(range(world_size))
    replies: dict[int, tuple] = {}
    try:
        replies = ranks.collect(everyone, timeout, grace_s)
    finally:
        ranks.stop(lost=[r for r in everyone if replies.get(r, ("lost",))[0] == "lost"])
    return results_in_order(replies, everyone, RuntimeError)


def collect_replies(results, procs: list, ranks: list[int], timeout: float, grace_s: float) -> dict[int, tuple]:
    """Gather ``(rank, pickled (status, value))`` replies of ``ranks`` (processes ``procs[rank]``) from
    ``results``, noticing at once a rank that died without answering (a "lost" reply). Once a rank
    has failed, ranks that do not answer within ``grace_s`` are "lost" too; without any failure,
    TimeoutError after ``timeout`` seconds. Kills nothing: the caller cleans up."""
    replies: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    exited: set[int] = set()  # seen dead with nothing queued; dead for sure when seen so twice
    while len(replies) < len(ranks):
        try:
            rank, reply = results.get(timeout=0.2)
            replies[rank] = pickle.loads(reply)
            if replies[rank][0] != "ok":
                deadline = min(deadline, time.monotonic() + grace_s)
            continue
        except queue.Empty:
            pass
        for r in ranks:
            if r in replies or procs[r].exitcode is None:
                continue
            if r in exited:
                replies[r] = ("lost", f"rank {r} died without answering (exit code {procs[r].exitcode})")
                deadline = min(deadline, time.monotonic() + grace_s)
            exited.add(r)
        if time.monotonic() > deadline:
            missing = sorted(set(ranks) - set(replies))
            if all(status == "ok" for status, _ in replies.values()):
                raise TimeoutError(f"ranks {missing} did not answer in {timeout} s")
            for r in missing:
                replies[r] = ("lost", f"rank {r} did not answer within {grace_s} s of the failure above")
    return replies

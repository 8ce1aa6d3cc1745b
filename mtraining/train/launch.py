"""Run a function on several local CPU ranks joined by gloo (tests, notebooks, quick experiments).

``run_local(fn, world_size, *args)`` starts ``world_size`` processes that share one default
process group (a FileStore, no ports), calls ``fn(*args)`` on each and returns the results in rank
order. A failure on any rank raises here with that rank's traceback. The "fork" start method
reuses the parent's imports (torch, transformers), so start-up takes well under a second; ``fn``
must then not rely on state the parent created after importing (open process groups, threads).
For real jobs use torchrun (``mtraining train --nproc N``; ``torchrun_command`` builds its command
line, for one node or several).
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, store_path: str, payload: bytes, results) -> None:
    torch.set_num_threads(1)
    try:
        fn, args = pickle.loads(payload)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120)
        )
        reply = ("ok", fn(*args))
    except BaseException:
        reply = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    results.put((rank, pickle.dumps(reply)))


def run_local(fn: Callable, world_size: int, *args, timeout: float = 300.0, start_method: str = "fork") -> list:
    """``fn(*args)`` on ``world_size`` gloo ranks; their return values (picklable) in rank order."""
    ctx = mp.get_context(start_method)
    tmp = tempfile.mkdtemp(prefix="mtraining-ranks-")
    results = ctx.Queue()
    payload = pickle.dumps((fn, args))
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, os.path.join(tmp, "store"), payload, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    replies: dict[int, tuple] = {}
    try:
        while len(replies) < world_size:
            rank, reply = results.get(timeout=timeout)
            replies[rank] = pickle.loads(reply)
    except queue.Empty:
        missing = sorted(set(range(world_size)) - set(replies))
        raise TimeoutError(f"ranks {missing} did not finish in {timeout} s") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(tmp, ignore_errors=True)
    errors = [f"rank {r}:\n{msg}" for r, (status, msg) in sorted(replies.items()) if status == "error"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [replies[r][1] for r in range(world_size)]


def torchrun_command(
    nproc: int, nnodes: int = 1, node_rank: int | None = None, rdzv_endpoint: str | None = None
) -> list[str]:
    """The torchrun command line (without the program) that starts ``nproc`` ranks on this node.

    One node: a standalone rendezvous on a free local port. Several: every node runs the same
    command with its own ``node_rank``; node 0 hosts the rendezvous at ``rdzv_endpoint`` (host:port),
    and node n's ranks are n*nproc .. n*nproc + nproc - 1 (nodes hold consecutive ranks, which the
    hierarchical ring's inner rings rely on).
    """
    if nproc < 1 or nnodes < 1:
        raise ValueError(f"--nproc and --nnodes must be at least 1, got {nproc} and {nnodes}")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes == 1:
        if node_rank not in (None, 0) or rdzv_endpoint is not None:
            raise ValueError("--node-rank and --rdzv-endpoint are for multi-node jobs: add --nnodes N")
        return cmd + ["--standalone"]
    if node_rank is None or not 0 <= node_rank < nnodes or not rdzv_endpoint:
        raise ValueError(
            f"a job of --nnodes {nnodes} needs, on every node, --node-rank (0 .. {nnodes - 1}, 0 on the node "
            "whose address is the endpoint) and --rdzv-endpoint HOST:PORT (that node's address and a free port)"
        )
    host, sep, port = rdzv_endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--rdzv-endpoint must look like HOST:PORT, e.g. node-0:29500, got {rdzv_endpoint!r}")
    return cmd + [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--rdzv-endpoint={rdzv_endpoint}"]

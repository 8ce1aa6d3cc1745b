"""What the per-call agreement check of the rings costs (``parallel/agreement.py``), and the position-ids read.

Every ``ring_attention`` and ``estimate_pattern_cp`` call opens with ``check_ranks_agree``: one all-gather of one
int64 per rank and a host read of the result. Measured per call, medians over ``--calls`` calls on each rank:

- ``check_us``: the check with a ring call's fields (equal on every call, as in training);
- ``all_gather_us``: one all-gather of one int64 alone (the floor of any per-call check);
- ``ring_ms`` / ``ring_unchecked_ms``: a dense forward ``ring_attention`` call with the check and with it
  replaced by a no-op, alternating (what the check adds to a call, device syncs included);
- ``position_ids_ms``: reading packed documents from position ids under context parallelism (the
  model-side read, once per forward): an agreement check, an all-gather of ``--ids-len`` int64 ids and the
  host read, by ``Attention._position_documents_of``.

Without a launcher it starts ``--world`` gloo ranks on the CPU; under ``torchrun`` it joins the launcher's group
(``--backend nccl`` on GPUs, one per rank)::

    python bench/agreement_check.py                      # 2 gloo ranks; writes bench/results/agreement_check.json
    torchrun --nproc-per-node 2 bench/agreement_check.py --backend nccl --seq 65536 --out /tmp/agree.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import provenance, write_results  # noqa: E402
from mtraining.models import Attention  # noqa: E402
from mtraining.parallel import agreement, make_layout, ring_attention  # noqa: E402
from mtraining.parallel.ring import attention as ring_module  # noqa: E402
from mtraining.train.launch import run_local  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _times_us(fn, calls: int, device: torch.device, warmup: int = 10) -> list[float]:
    """Microseconds of each of ``calls`` calls of fn (after ``warmup``), every call started together on all
    ranks (a barrier) and ended by a device sync."""
    times = []
    for i in range(calls + warmup):
        dist.barrier()
        start = time.perf_counter()
        fn()
        _sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e6)
    return times


def measure(args: argparse.Namespace) -> dict:
    """The figures on this rank (module docstring)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if args.backend == "nccl" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layout = make_layout("striped", args.seq, world, 128)
    q, k, v = (torch.randn(1, layout.local_len, h, 64, dtype=dtype, device=device) for h in (args.heads, 2, 2))
    backend = "auto" if device.type == "cuda" else "torch"
    fields = {"q shape": tuple(q.shape), "dtype": str(q.dtype), "layout": layout, "backend": backend}
    one = torch.zeros(1, dtype=torch.int64, device=device)
    parts = [torch.empty_like(one) for _ in range(world)]

    def gather_one() -> None:
        dist.all_gather(parts, one)
        torch.cat(parts).tolist()

    def ring() -> None:
        ring_attention(q, k, v, None, layout, backend=backend)

    def unchecked() -> None:
        real = ring_module.check_ranks_agree
        ring_module.check_ranks_agree = lambda *a, **kw: None
        try:
            ring()
        finally:
            ring_module.check_ranks_agree = real

    ids_layout = make_layout("striped", args.ids_len, world, 128)
    ids = ids_layout.positions(rank)[None].to(device)
    reader = Attention(group=dist.group.WORLD, layout=ids_layout)
    local_q = torch.empty(1, ids_layout.local_len, 1, 1, device=device)

    def read_ids() -> None:
        reader._position_documents = None  # read again: once per forward in a model
        reader._position_documents_of(ids, local_q)

    def check() -> None:
        agreement.check_ranks_agree(None, device, "ring_attention", fields)

    ring_times, unchecked_times = [], []
    _times_us(ring, 0, device, warmup=3)
    _times_us(unchecked, 0, device, warmup=3)
    for _ in range(args.ring_calls):  # alternating, so load on the machine hits both alike
        ring_times += _times_us(ring, 1, device, warmup=0)
        unchecked_times += _times_us(unchecked, 1, device, warmup=0)
    return {
        "rank": rank,
        "check_us": statistics.median(_times_us(check, args.calls, device)),
        "all_gather_us": statistics.median(_times_us(gather_one, args.calls, device)),
        "ring_ms": statistics.median(ring_times) / 1e3,
        "ring_unchecked_ms": statistics.median(unchecked_times) / 1e3,
        "position_ids_ms": statistics.median(_times_us(read_ids, max(args.calls // 20, 5), device)) / 1e3,
    }


def _on_rank(args: argparse.Namespace) -> dict:
    return measure(args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="gloo ranks to start (without torchrun)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--seq", type=int, default=1024, help="global length of the ring calls")
    parser.add_argument("--heads", type=int, default=4, help="query heads (2 key/value heads, head_dim 64)")
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--ring-calls", type=int, default=30)
    parser.add_argument("--ids-len", type=int, default=131072, help="global length of the position ids read")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ:  # under torchrun
        if args.backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(args.backend)
        mine = measure(args)
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        world = dist.get_world_size()
        dist.destroy_process_group()
        if int(os.environ["RANK"]):
            return
    else:
        if args.backend != "gloo":
            parser.error("--backend nccl needs torchrun (one GPU per rank)")
        ranks, world = run_local(_on_rank, args.world, args), args.world
    record = {**provenance(on_gpu=args.backend == "nccl"), "backend": args.backend, "world": world}
    record |= {"seq": args.seq, "heads": args.heads, "calls": args.calls, "ids_len": args.ids_len, "ranks": ranks}
    for key in ("check_us", "all_gather_us", "ring_ms", "ring_unchecked_ms", "position_ids_ms"):
        record[key] = max(r[key] for r in ranks)  # the slowest rank sets the pace
    path = write_results("agreement_check", [record], args.out)
    print({k: v for k, v in record.items() if k != "ranks"}, "->", path)


if __name__ == "__main__":
    main()

"""What the per-call agreement check of the rings costs (``parallel/agreement.py``), and the position-ids read.

Every ``ring_attention`` and ``estimate_pattern_cp`` call opens with ``check_ranks_agree``: one all-gather of one
int64 per rank and a host read of the result (a device sync under NCCL). Measured on each rank:

- ``check_us``: one check with a ring call's fields (equal on every call, as in training), median of ``--calls``;
- ``all_gather_us``: one all-gather of one int64 and its host read alone (the floor of any per-call check);
- ``layers_ms`` / ``layers_unchecked_ms``: ``--layers`` layer-like steps, each a chain of matrix products
  (the MLP and projections a model queues between attention calls) then the attention as ``models.Attention``
  runs it (``estimate_pattern_cp``, then ``ring_attention`` with that pattern: two checks), synced once at the
  end, with the checks and with them replaced by no-ops, alternated, medians of ``--repeats``. On a GPU the
  difference includes what a check's sync costs when other work is queued before it;
- ``position_ids_ms``: reading packed documents from position ids under context parallelism (the model-side
  read, once per forward): an agreement check, an all-gather of ``--ids-len`` int64 ids and the host read, by
  ``Attention._position_documents_of``.

Internal tool: it times ``mtraining.parallel.agreement`` and replaces the checks that
``mtraining.parallel.estimate`` and ``mtraining.parallel.ring.attention`` call with no-ops.

The figures of the slowest rank are recorded. Without a launcher it starts ``--world`` gloo ranks on the
CPU; under ``torchrun`` it joins the launcher's group (``--backend nccl`` on GPUs, one per rank)::

    python -m experiments.studies.agreement_check         # 2 gloo ranks; writes bench/results/agreement_check.json
    torchrun --nproc-per-node 2 -m experiments.studies.agreement_check --backend nccl --seq 131072 --hidden 2048 \\
        --out /tmp/agree.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.common import provenance, write_results
from mtraining.models import Attention
from mtraining.ops import PatternConfig
from mtraining.parallel import agreement, estimate, make_layout, ring_attention
from mtraining.parallel.ring import attention as ring_module
from mtraining.train.launch import run_local

FIGURES = ("check_us", "all_gather_us", "layers_ms", "layers_unchecked_ms", "position_ids_ms")


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


def _unchecked(fn):
    """fn with the agreement checks of the estimate and the ring replaced by no-ops."""

    def run() -> None:
        real = ring_module.check_ranks_agree
        ring_module.check_ranks_agree = estimate.check_ranks_agree = lambda *a, **kw: None
        try:
            fn()
        finally:
            ring_module.check_ranks_agree = estimate.check_ranks_agree = real

    return run


def measure(args: argparse.Namespace) -> dict:
    """The figures on this rank (module docstring)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if args.backend == "nccl" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = "auto" if device.type == "cuda" else "torch"
    layout = make_layout("striped", args.seq, world, 128)
    q, k, v = (torch.randn(1, layout.local_len, h, 64, dtype=dtype, device=device) for h in (args.heads, 2, 2))
    hidden = torch.randn(layout.local_len, args.hidden, dtype=dtype, device=device)
    weights = [torch.randn(args.hidden, args.hidden, dtype=dtype, device=device) / args.hidden**0.5 for _ in range(4)]
    config = PatternConfig(v_size=256, s_size=256, last_q=64, block_size=128, sink_tokens=4, local_window=128)

    def layers() -> None:
        x = hidden
        for _ in range(args.layers):
            for w in weights:
                x = x @ w
            pattern = estimate.estimate_pattern_cp(q, k, config, None, layout)
            ring_attention(q, k, v, None, layout, pattern=pattern, backend=backend)

    one = torch.zeros(1, dtype=torch.int64, device=device)
    parts = [torch.empty_like(one) for _ in range(world)]

    def gather_one() -> None:
        dist.all_gather(parts, one)
        torch.cat(parts).tolist()

    fields = {"q shape": tuple(q.shape), "dtype": str(q.dtype), "layout": layout, "backend": backend}

    def check() -> None:
        agreement.check_ranks_agree(None, device, "ring_attention", fields)

    ids_layout = make_layout("striped", args.ids_len, world, 128)
    ids = ids_layout.positions(rank)[None].to(device)
    reader = Attention(group=dist.group.WORLD, layout=ids_layout)
    local_q = torch.empty(1, ids_layout.local_len, 1, 1, device=device)

    def read_ids() -> None:
        reader._position_documents = None  # read again: once per forward in a model
        reader._position_documents_of(ids, local_q)

    checked, unchecked = [], []
    _times_us(layers, 0, device, warmup=2)
    _times_us(_unchecked(layers), 0, device, warmup=2)
    for _ in range(args.repeats):  # alternated, so load on the machine hits both alike
        checked += _times_us(layers, 1, device, warmup=0)
        unchecked += _times_us(_unchecked(layers), 1, device, warmup=0)
    return {
        "rank": rank,
        "check_us": statistics.median(_times_us(check, args.calls, device)),
        "all_gather_us": statistics.median(_times_us(gather_one, args.calls, device)),
        "layers_ms": statistics.median(checked) / 1e3,
        "layers_unchecked_ms": statistics.median(unchecked) / 1e3,
        "position_ids_ms": statistics.median(_times_us(read_ids, max(args.calls // 20, 5), device)) / 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="gloo ranks to start (without torchrun)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--seq", type=int, default=1024, help="global length of the attention calls")
    parser.add_argument("--heads", type=int, default=4, help="query heads (2 key/value heads, head_dim 64)")
    parser.add_argument("--hidden", type=int, default=256, help="width of the matrix products between calls")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--ids-len", type=int, default=131072, help="global length of the position ids read")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ:  # under torchrun
        if args.backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(args.backend)
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, measure(args))
        world = dist.get_world_size()
        dist.destroy_process_group()
        if int(os.environ["RANK"]):
            return
    else:
        if args.backend != "gloo":
            parser.error("--backend nccl needs torchrun (one GPU per rank)")
        ranks, world = run_local(measure, args.world, args), args.world
    record = {**provenance(on_gpu=args.backend == "nccl"), "backend": args.backend, "world": world}
    record |= {k: getattr(args, k) for k in ("seq", "heads", "hidden", "layers", "calls", "repeats", "ids_len")}
    record |= {key: max(r[key] for r in ranks) for key in FIGURES}  # the slowest rank sets the pace
    record["ranks"] = ranks
    path = write_results("agreement_check", [record], args.out)
    print({k: v for k, v in record.items() if k != "ranks"}, "->", path)


if __name__ == "__main__":
    main()

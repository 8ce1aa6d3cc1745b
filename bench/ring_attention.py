"""Context-parallel attention benchmark on several GPUs of one host (launch with torchrun).

Methods, on identical inputs in the same run: torch's own context_parallel ring with cuDNN SDPA
(the dense peer), our dense ring (zigzag; ``dense_zigzag``: steps as dense blocks through cuDNN,
ops/dense/; ``dense_zigzag_triton``: the same ring on our Triton kernels with a dense
pattern, the path before cuDNN), our sparse ring on the contiguous layout (the naive baseline) and
on the striped layout (balanced). Method names are ``dense_<layout>[_<cudnn|triton>]`` or
``sparse_<layout>``. Sparse methods estimate the pattern inside the call (v_size/s_size per head),
so their times include estimation; estimate_ms times it alone. Times are medians over iterations
of the max over ranks; bwd_ms = fwd_bwd_ms - fwd_ms; peak_mem_gb is the largest extra memory a rank's
forward + backward allocated above its inputs (CUDA).

Each of our methods runs in every ``--schedules`` entry: ``flat`` (one ring), ``hierarchical:I`` (inner rings
of I ranks inside an outer ring: W / I "nodes"), ``allgather`` (no ring: K/V all-gathered once per call,
``ring_attention(..., ring="allgather")``), and over every ``--links`` entry: ``host`` (the host's own
links: NVLink between GPUs) or a bandwidth in GB/s, an emulated slow link between the "nodes" (bench/links.py, 5 us per transfer):
the hierarchical ring's outer ring, and for ``flat`` every hop (the flat ring runs as W nodes of one rank:
across nodes a flat ring waits for the slow hop on every step). The all-gather runs over the host's links
only. Every record gets the ring cost model's prediction beside its measured time (bench/ring_prediction.py,
calibrated on the flat ring over the host's links of the same method and length).

    torchrun --nproc_per_node 4 bench/ring_attention.py --seq-lens 131072 262144 524288
    torchrun --nproc_per_node 4 bench/ring_attention.py --methods sparse_striped dense_zigzag \\
        --schedules flat hierarchical:2 --links host 25 5
    torchrun --nproc_per_node 2 bench/ring_attention.py --device cpu --seq-lens 512 --heads-q 4 \\
        --head-dim 16 --block-size 16 --v-size 16 --s-size 32 --local-window 16 --last-q 16 --iters 1
        # a plumbing check: gloo ranks, the torch backend

Internal tool: times the context-parallel estimate alone through ``mtraining.parallel.estimate``.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench.* modules
from common import add_attention_shape, provenance, write_results  # noqa: E402

from bench.links import emulated  # noqa: E402
from bench.ring_prediction import annotate, print_annotated  # noqa: E402
from bench.synthetic import random_qkv, rope_structured_qkv  # noqa: E402
from mtraining.ops import (
    PatternConfig,  # noqa: E402
    dense,  # noqa: E402
)
from mtraining.parallel import make_layout, ring_attention, ring_cost  # noqa: E402
from mtraining.parallel.estimate import estimate_pattern_cp  # noqa: E402

GENERATORS = {"structured": rope_structured_qkv, "random": random_qkv}
LINK_LATENCY_S = 5e-6  # of an emulated link, per transfer


class Clock:
    """Milliseconds of fn(), the slowest rank's: CUDA events on a GPU, the wall clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn, iters: int, warmup: int = 2) -> float:
        """Median over iterations of the slowest rank's milliseconds for fn()."""
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(iters):
            dist.barrier()
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                fn()
                ms = (time.perf_counter() - t0) * 1e3
            t = torch.tensor([ms], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times.append(t.item())
        return statistics.median(times)

    def peak_gb(self, fn) -> float | None:
        """The largest memory above what was allocated before, over ranks, while fn() ran (CUDA; None elsewhere)."""
        if self.device.type != "cuda":
            return None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        t = torch.tensor([(torch.cuda.max_memory_allocated() - base) / 1e9], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()


def torch_cp_times(clock: Clock, q, k, v, do, iters: int) -> tuple[float, float, str]:
    """torch's context_parallel + cuDNN SDPA on the full tensors (it shards them itself)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    group = q.shape[2] // k.shape[2]
    # torch's ring takes MHA-shaped inputs; K/V heads are expanded before sharding (noted in the record).
    buffers = [
        q.transpose(1, 2).contiguous(),
        k.transpose(1, 2).repeat_interleave(group, 1).contiguous(),
        v.transpose(1, 2).repeat_interleave(group, 1).contiguous(),
        do.transpose(1, 2).contiguous(),
    ]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(buffers)):
        qh, kh, vh, doh = buffers
        leaves = [t.detach().requires_grad_() for t in (qh, kh, vh)]

        def fwd():
            with torch.no_grad():
                torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True)

        def fwd_bwd():
            torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True).backward(doh)

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            f = clock.timed(fwd, iters)
            fb = clock.timed(fwd_bwd, iters)
    return f, fb, "cudnn, kv heads expanded to q heads"


def ours_times(clock: Clock, q, k, v, do, layout, group, pattern_config, iters: int, schedule: dict) -> dict:
    """fwd_ms, fwd_bwd_ms, estimate_ms (None for dense) and peak_mem_gb of our attention under ``schedule``
    (ring_attention's ring, inner_size, outer_comm)."""
    rank = dist.get_rank()
    ql, kl, vl, dol = (layout.shard(t, rank).contiguous() for t in (q, k, v, do))
    leaves = [t.detach().requires_grad_() for t in (ql, kl, vl)]

    def fwd():
        with torch.no_grad():
            ring_attention(ql, kl, vl, group, layout, pattern_config=pattern_config, **schedule)

    def fwd_bwd():
        ring_attention(*leaves, group, layout, pattern_config=pattern_config, **schedule).backward(dol)

    estimate = None
    if pattern_config is not None:
        estimate = clock.timed(lambda: estimate_pattern_cp(ql, kl, pattern_config, group, layout), iters)
    return dict(
        fwd_ms=clock.timed(fwd, iters),
        fwd_bwd_ms=clock.timed(fwd_bwd, iters),
        estimate_ms=estimate,
        peak_mem_gb=clock.peak_gb(fwd_bwd),
    )


def dense_note(q, k, layout, setting: str, backend: str, schedule: str) -> str:
    """Which path this rank's dense steps take (cuDNN blocks per step, or the Triton kernels)."""
    with dense.dense_backend(setting):
        ops = dense.select_ops(q, k, backend)
    if ops is None:
        return backend
    rank = dist.get_rank()
    if schedule == "allgather":
        blocks = dense.decompose(layout.positions(rank), torch.arange(layout.seq_len))
        return f"{ops.name}: " + ("triton (too many blocks)" if blocks is None else f"{len(blocks)} blocks")
    counts = [dense.decompose(layout.positions(rank), layout.positions(s)) for s in range(layout.world_size)]
    return f"{ops.name} blocks per source rank " + ",".join("triton" if c is None else str(len(c)) for c in counts)


def pattern_stats(q, k, layout, config) -> tuple[float, float]:
    """(density, max/mean over ranks of computed pairs) of the pattern estimated on the full inputs."""
    from bench.imbalance import imbalance_report
    from mtraining.ops import estimate_pattern

    pattern = estimate_pattern(q, k, config)
    return float(pattern.density().mean()), float(imbalance_report(pattern, layout).rank_imbalance)


def schedules(names: list[str], links: list[str], world: int) -> list[dict]:
    """(record fields, ring_attention arguments) of every schedule and link to run; ValueError naming the fix."""
    out = []
    for name in names:
        kind, _, inner = name.partition(":")
        if kind not in ("flat", "hierarchical", "allgather") or (kind == "hierarchical") != bool(inner):
            raise ValueError(f"unknown schedule {name!r}: use flat, hierarchical:<inner ranks> or allgather")
        inner_size = int(inner) if inner else None
        if inner_size is not None and (inner_size < 1 or world % inner_size):
            raise ValueError(f"{name}: the inner size must divide the {world} ranks")
        for link in links:
            fields = dict(schedule=kind, inner_size=inner_size, outer_link=link)
            args: dict = dict(ring=kind, inner_size=inner_size)
            if link != "host":
                if kind == "allgather":
                    continue  # a collective: no link of ours to emulate
                model = ring_cost.Link(float(link) * 1e9, LINK_LATENCY_S)
                fields.update(outer_link=model.label, outer_gbps=float(link), outer_latency_s=LINK_LATENCY_S)
                if kind == "flat":  # every hop on the slow link: W nodes of one rank
                    args.update(ring="hierarchical", inner_size=1)
                args["outer_comm"] = emulated(model)
            out.append((fields, args))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[131072, 262144, 524288])
    p.add_argument("--inputs", nargs="+", default=["structured"], choices=list(GENERATORS))
    p.add_argument(
        "--methods",
        nargs="+",
        default=["torch_cp", "dense_zigzag", "dense_zigzag_triton", "sparse_contiguous", "sparse_striped"],
    )
    p.add_argument(
        "--schedules",
        nargs="+",
        default=["flat"],
        help="flat, hierarchical:<inner ranks>, allgather (our methods run in each; module docstring)",
    )
    p.add_argument(
        "--links",
        nargs="+",
        default=["host"],
        help="host (the host's own links: NVLink between GPUs) or GB/s of an emulated link between nodes, e.g. 25 5",
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: gloo ranks, the torch backend")
    add_attention_shape(p)
    p.add_argument("--local-window", type=int, default=128)
    p.add_argument("--last-q", type=int, default=64)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda" if cuda else "cpu")
    clock = Clock(device)
    group = dist.group.WORLD
    hq, hkv, d, g = args.heads_q, args.heads_kv, args.head_dim, args.block_size
    dtype = torch.bfloat16 if cuda else torch.float32
    config = PatternConfig(
        v_size=args.v_size, s_size=args.s_size, block_size=g, local_window=args.local_window, last_q=args.last_q
    )
    runs = schedules(args.schedules, args.links, world)
    base = dict(
        **provenance(on_gpu=cuda),
        gpus=world,
        heads_q=hq,
        heads_kv=hkv,
        head_dim=d,
        dtype=str(dtype).removeprefix("torch."),
        block_size=g,
        v_size=args.v_size,
        s_size=args.s_size,
        local_window=args.local_window,
        last_q=args.last_q,
    )
    records = []
    for n in args.seq_lens:
        for kind in args.inputs:
            q, k, v = GENERATORS[kind](1, n, hq, hkv, d, dtype=dtype, device=device, seed=0)
            gen = torch.Generator(device=device).manual_seed(1)
            do = torch.randn(q.shape, device=device, dtype=dtype, generator=gen)
            for method in args.methods:
                stats = {}  # density and imbalance of a sparse method: the same for every schedule
                for fields, schedule in [({}, {})] if method == "torch_cp" else runs:
                    rec = dict(base, seq_len=n, inputs=kind, method=method, layout=None, density=1.0, **fields)
                    rec.update(imbalance_max_over_mean=None, estimate_ms=None, peak_mem_gb=None, note="")
                    if cuda:
                        torch.cuda.empty_cache()
                    try:
                        if method == "torch_cp":
                            f, fb, rec["note"] = torch_cp_times(clock, q, k, v, do, args.iters)
                        else:
                            kind_name, layout_name, *rest = method.split("_")
                            sparse = kind_name == "sparse"
                            dense_setting = rest[0] if rest else "auto"  # dense_<layout>: cuDNN blocks where they apply
                            if rest and (sparse or len(rest) > 1 or dense_setting not in ("cudnn", "triton")):
                                raise ValueError(f"unknown method {method!r}: use dense_<layout>[_cudnn|_triton]")
                            layout = make_layout(layout_name, n, world, g)
                            rec["layout"] = layout_name
                            with dense.dense_backend(dense_setting if cuda else "auto"):
                                times = ours_times(
                                    clock, q, k, v, do, layout, group, config if sparse else None, args.iters, schedule
                                )
                            f, fb = times["fwd_ms"], times["fwd_bwd_ms"]
                            rec.update(estimate_ms=times["estimate_ms"], peak_mem_gb=times["peak_mem_gb"])
                            backend = "triton" if cuda else "torch"
                            if not sparse:
                                steps = dense_note(q, k, layout, dense_setting, backend, fields["schedule"])
                                rec["note"] = f"dense steps: {steps}"
                            else:
                                if not stats:
                                    stats = dict(
                                        zip(("density", "imbalance_max_over_mean"), pattern_stats(q, k, layout, config))
                                    )
                                rec.update(stats)
                    except Exception as exc:  # keep the other methods' numbers; say what failed
                        f = fb = float("nan")
                        rec["note"] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
                    rec.update(fwd_ms=f, bwd_ms=fb - f, fwd_bwd_ms=fb)
                    records.append(rec)
                    if rank == 0:
                        annotate(records)
                        write_results("ring_attention", records, args.out)
                        where = (
                            f"{rec.get('schedule', '')}{':' + str(rec['inner_size']) if rec.get('inner_size') else ''}"
                        )
                        print(
                            f"{n:>8} {kind:>10} {method:>18} {where:>14} {rec.get('outer_link', ''):>24} "
                            f"fwd={f:9.2f} bwd={fb - f:9.2f} fwd_bwd={fb:9.2f} density={rec['density']:.3f} "
                            f"peak_gb={rec['peak_mem_gb']} {rec['note']}",
                            flush=True,
                        )
            del q, k, v, do
    if rank == 0:
        print_annotated(annotate(records))
        print(f"wrote {write_results('ring_attention', records, args.out)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Context-parallel attention benchmark on several GPUs of one host (launch with torchrun).

Methods, on identical inputs in the same run: torch's own context_parallel ring with cuDNN SDPA
(the dense peer), our dense ring (zigzag; ``dense_zigzag``: steps as dense blocks through cuDNN,
ops/dense/; ``dense_zigzag_triton``: the same ring on our Triton kernels with a dense
pattern, the path before cuDNN), our sparse ring on the contiguous layout (the naive baseline) and
on the striped layout (balanced). Method names are ``dense_<layout>[_<cudnn|triton>]`` or
``sparse_<layout>``. Sparse methods estimate the pattern inside the call (v_size/s_size per head),
so their times include estimation; estimate_ms times it alone. Times are medians over iterations
of the max over ranks; bwd_ms = fwd_bwd_ms - fwd_ms.

    torchrun --nproc_per_node 4 bench/ring_attention.py --seq-lens 131072 262144 524288

Internal tool: times the context-parallel estimate alone through ``mtraining.parallel.estimate``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench.* modules
from common import provenance, write_results  # noqa: E402

from bench.synthetic import random_qkv, rope_structured_qkv  # noqa: E402
from mtraining.ops import (
    PatternConfig,  # noqa: E402
    dense,  # noqa: E402
)
from mtraining.parallel import make_layout, ring_attention  # noqa: E402
from mtraining.parallel.estimate import estimate_pattern_cp  # noqa: E402

GENERATORS = {"structured": rope_structured_qkv, "random": random_qkv}


def timed(fn, iters: int, warmup: int = 2) -> float:
    """Median over iterations of the slowest rank's milliseconds for fn()."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        t = torch.tensor([start.elapsed_time(end)], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return statistics.median(times)


def torch_cp_times(q, k, v, do, iters: int) -> tuple[float, float, str]:
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
            f = timed(fwd, iters)
            fb = timed(fwd_bwd, iters)
    return f, fb, "cudnn, kv heads expanded to q heads"


def ours_times(q, k, v, do, layout, group, pattern_config, iters: int) -> tuple[float, float, float | None]:
    """(fwd ms, fwd+bwd ms, ms of the pattern estimate alone or None for dense) of our ring."""
    rank = dist.get_rank()
    ql, kl, vl, dol = (layout.shard(t, rank).contiguous() for t in (q, k, v, do))
    leaves = [t.detach().requires_grad_() for t in (ql, kl, vl)]

    def fwd():
        with torch.no_grad():
            ring_attention(ql, kl, vl, group, layout, pattern_config=pattern_config)

    def fwd_bwd():
        ring_attention(*leaves, group, layout, pattern_config=pattern_config).backward(dol)

    estimate = None
    if pattern_config is not None:
        estimate = timed(lambda: estimate_pattern_cp(ql, kl, pattern_config, group, layout), iters)
    return timed(fwd, iters), timed(fwd_bwd, iters), estimate


def dense_note(q, k, layout, setting: str) -> str:
    """Which path this rank's dense ring steps take (cuDNN blocks per step, or the Triton kernels)."""
    with dense.dense_backend(setting):
        ops = dense.select_ops(q, k, "triton")
    if ops is None:
        return "triton"
    rank = dist.get_rank()
    counts = [dense.decompose(layout.positions(rank), layout.positions(s)) for s in range(layout.world_size)]
    return f"{ops.name} blocks per source rank " + ",".join("triton" if c is None else str(len(c)) for c in counts)


def pattern_stats(q, k, layout, config) -> tuple[float, float]:
    """(density, max/mean over ranks of computed pairs) of the pattern estimated on the full inputs."""
    from bench.imbalance import imbalance_report
    from mtraining.ops import estimate_pattern

    pattern = estimate_pattern(q, k, config)
    return float(pattern.density().mean()), float(imbalance_report(pattern, layout).rank_imbalance)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[131072, 262144, 524288])
    p.add_argument("--inputs", nargs="+", default=["structured"], choices=list(GENERATORS))
    p.add_argument(
        "--methods",
        nargs="+",
        default=["torch_cp", "dense_zigzag", "dense_zigzag_triton", "sparse_contiguous", "sparse_striped"],
    )
    p.add_argument("--v-size", type=int, default=1024)
    p.add_argument("--s-size", type=int, default=6144)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    group = dist.group.WORLD
    hq, hkv, d, g = 16, 2, 128, 128
    config = PatternConfig(v_size=args.v_size, s_size=args.s_size, block_size=g)
    base = dict(
        **provenance(),
        gpus=world,
        heads_q=hq,
        heads_kv=hkv,
        head_dim=d,
        dtype="bfloat16",
        v_size=args.v_size,
        s_size=args.s_size,
    )
    records = []
    for n in args.seq_lens:
        for kind in args.inputs:
            q, k, v = GENERATORS[kind](1, n, hq, hkv, d, dtype=torch.bfloat16, device="cuda", seed=0)
            do = torch.randn(
                q.shape, device="cuda", dtype=torch.bfloat16, generator=torch.Generator(device="cuda").manual_seed(1)
            )
            for method in args.methods:
                note, layout_name, dens, imb, est = "", None, 1.0, None, None
                torch.cuda.empty_cache()
                try:
                    if method == "torch_cp":
                        f, fb, note = torch_cp_times(q, k, v, do, args.iters)
                    else:
                        kind_name, layout_name, *rest = method.split("_")
                        sparse = kind_name == "sparse"
                        dense_setting = rest[0] if rest else "auto"  # dense_<layout>: cuDNN blocks where they apply
                        if rest and (sparse or len(rest) > 1 or dense_setting not in ("cudnn", "triton")):
                            raise ValueError(f"unknown method {method!r}: use dense_<layout>[_cudnn|_triton]")
                        layout = make_layout(layout_name, n, world, g)
                        cfg = config if sparse else None
                        with dense.dense_backend(dense_setting):
                            f, fb, est = ours_times(q, k, v, do, layout, group, cfg, args.iters)
                        if not sparse:
                            note = f"dense steps: {dense_note(q, k, layout, dense_setting)}"
                        if sparse:
                            dens, imb = pattern_stats(q, k, layout, config)
                except Exception as exc:  # keep the other methods' numbers; say what failed
                    f = fb = float("nan")
                    note = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
                rec = dict(
                    base,
                    seq_len=n,
                    inputs=kind,
                    method=method,
                    layout=layout_name,
                    density=dens,
                    fwd_ms=f,
                    bwd_ms=fb - f,
                    fwd_bwd_ms=fb,
                    estimate_ms=est,
                    imbalance_max_over_mean=imb,
                    note=note,
                )
                records.append(rec)
                if rank == 0:
                    print(
                        f"{n:>8} {kind:>10} {method:>18} fwd={f:9.2f} bwd={fb - f:9.2f} fwd_bwd={fb:9.2f} "
                        f"density={dens:.3f} imbalance={imb} {note}",
                        flush=True,
                    )
            del q, k, v, do
    if rank == 0:
        print(f"wrote {write_results('ring_attention', records, args.out)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Where the time of one sparse attention call goes on a GPU: the top CUDA kernels of each phase.

Phases (structured inputs, Qwen2.5-3B attention shape, online pattern v_size/s_size):
estimate (pattern estimation), walks (kernel index building), forward, backward (kernels only,
indices cached); with ``--block-columns K`` the estimate also chooses K per-block columns per query block
(``--column-scorer``: sorted or dense). For each phase prints the CUDA time of the phase (CUDA events, median) and the
top kernels by total CUDA time (torch.profiler), and writes them as JSON records.

    python bench/profile_phases.py --seq-lens 131072 262144

Internal tool: times the kernels and index builders of ``mtraining.ops.sparse.launch`` and
``mtraining.ops.sparse.index_kernels`` one by one.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench.* modules
from common import bench_ms, provenance, write_results  # noqa: E402

from bench.synthetic import rope_structured_qkv  # noqa: E402
from mtraining.ops import PatternConfig, estimate_pattern, sparse_attention  # noqa: E402
from mtraining.ops.sparse import launch as tb  # noqa: E402
from mtraining.ops.sparse.index_kernels import chunk_pair_triton, key_walk_triton, query_walk_triton  # noqa: E402


def top_kernels(fn, top: int) -> list[tuple[str, float]]:
    """(kernel name, total ms) of the ``top`` costliest CUDA kernels of one profiled call of fn."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            totals[evt.name[:90]] += evt.device_time / 1e3
    return sorted(totals.items(), key=lambda kv: -kv[1])[:top]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[131072])
    p.add_argument("--v-size", type=int, default=1024)
    p.add_argument("--s-size", type=int, default=6144)
    p.add_argument("--block-columns", type=int, default=0, help="per-block columns chosen by the estimate")
    p.add_argument("--column-scorer", choices=["sorted", "dense"], default="sorted")
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    hq, hkv, d, g = 16, 2, 128, 128
    config = PatternConfig(
        v_size=args.v_size,
        s_size=args.s_size,
        block_size=g,
        block_columns=args.block_columns,
        column_scorer=args.column_scorer,
    )
    records = []
    for n in args.seq_lens:
        q, k, v = rope_structured_qkv(1, n, hq, hkv, d, dtype=torch.bfloat16, device="cuda", seed=0)
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        do = torch.randn_like(q)
        pattern = estimate_pattern(q, k, config)
        pos = torch.arange(n, device="cuda", dtype=torch.int32)
        tiles = tb.tile_config(g, d, q.device)

        def walks():
            pair = chunk_pair_triton(pattern, pos, pos)
            query_walk_triton(pattern, pair)
            key_walk_triton(pattern, pair, tiles.dkdv.block_v)

        out = sparse_attention(qg, kg, vg, pattern)  # builds and caches the walks
        phases = {
            "estimate": lambda: estimate_pattern(q, k, config),
            "walks": walks,
            "forward": lambda: sparse_attention(q, k, v, pattern),
            "backward": lambda: out.backward(do, retain_graph=True),
        }
        for name, fn in phases.items():
            ms = bench_ms(fn, warmup_ms=50, rep_ms=300)
            kernels = top_kernels(fn, args.top)
            records.append(
                dict(
                    **provenance(),
                    seq_len=n,
                    block_columns=args.block_columns,
                    column_scorer=args.column_scorer if args.block_columns else None,
                    density=float(pattern.density().mean()),
                    phase=name,
                    ms=ms,
                    top_kernels=[dict(name=k_, ms=v_) for k_, v_ in kernels],
                )
            )
            print(f"{n:>7} {name:9s} {ms:8.2f} ms", flush=True)
            for k_, v_ in kernels:
                print(f"          {v_:8.2f}  {k_}", flush=True)
        del q, k, v, qg, kg, vg, do, out, pattern
        torch.cuda.empty_cache()
    print(f"wrote {write_results('profile_phases', records, args.out)}")


if __name__ == "__main__":
    main()

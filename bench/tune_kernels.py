"""Tile-size sweep for the sparse attention kernels on one GPU, with per-kernel times.

For a dense pattern and a ~10%-density local+vertical pattern at 128K (Qwen2.5-3B attention shape),
times the forward, dQ, dK/dV (block) and dK/dV (vertical) kernels for each candidate tile config,
from CUDA kernel times recorded by torch.profiler (median of several runs). The winners go into
``mtraining.ops.sparse.launch.tile_config``.

    python bench/tune_kernels.py

Internal tool: sweeps the tiles of ``mtraining.ops.sparse.launch``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import provenance, write_results  # noqa: E402
from sparse_attention import sweep_pattern  # noqa: E402

from mtraining.ops import VerticalSlashPattern, sparse_attention  # noqa: E402
from mtraining.ops.sparse import launch as tb  # noqa: E402

KERNELS = ("_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_block_kernel", "_bwd_dkdv_vertical_kernel")
T = tb.Tiles
CANDIDATES = {
    "fwd": [
        T(128, 128, 64, 8, 3),
        T(128, 128, 64, 8, 2),
        T(128, 128, 64, 8, 4),
        T(128, 64, 64, 8, 3),
        T(128, 64, 64, 4, 3),
        T(64, 128, 64, 4, 3),
        T(64, 64, 64, 4, 4),
    ],
    "dq": [
        T(64, 64, 64, 4, 2),
        T(64, 64, 64, 4, 3),
        T(64, 64, 64, 4, 4),
        T(128, 64, 64, 8, 2),
        T(128, 64, 64, 8, 3),
        T(64, 128, 64, 4, 2),
        T(64, 128, 64, 8, 3),
    ],
    "dkdv": [],
}


def kernel_ms(fn, runs: int = 5) -> dict[str, float]:
    """Median per-kernel CUDA time (ms) of fn, by kernel name, over ``runs`` profiled calls."""
    fn()
    torch.cuda.synchronize()
    per_run: dict[str, list[float]] = defaultdict(list)
    for _ in range(runs):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        totals: dict[str, float] = defaultdict(float)
        for evt in prof.events():
            name = next((k for k in KERNELS if k in evt.name), None)
            if name is not None and evt.device_type == torch.autograd.DeviceType.CUDA:
                totals[name] += evt.device_time / 1e3
        for name, ms in totals.items():
            per_run[name].append(ms)
    return {name: statistics.median(v) for name, v in per_run.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    n, hq, hkv, d, g = args.seq_len, 16, 2, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, n, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    k = torch.randn(1, n, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    v = torch.randn(1, n, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    do = torch.randn_like(q)
    patterns = {
        "dense": VerticalSlashPattern.dense(1, hq, n, g, device="cuda"),
        "sparse10": sweep_pattern(1, hq, n, g, 0.1, 1024),
    }
    base = tb.tile_config(g, d, q.device)
    records = []
    for stage, candidates in CANDIDATES.items():
        for tiles in candidates:
            cfg = tb.TileConfig(**{**base.__dict__, stage: tiles})
            tb.tile_config = lambda *_a, cfg=cfg: cfg
            for name, pattern in patterns.items():
                pattern.index_cache.clear()

                def step():
                    q.grad = k.grad = v.grad = None
                    sparse_attention(q, k, v, pattern).backward(do)

                try:
                    times = kernel_ms(step)
                except triton.runtime.errors.OutOfResources as err:
                    print(f"{stage:5s} {str(tuple(tiles.__dict__.values())):32s} {name:9s} skipped: {err}", flush=True)
                    continue
                rec = dict(
                    **provenance(),
                    seq_len=n,
                    pattern=name,
                    density=float(pattern.density().mean()),
                    stage=stage,
                    tiles=tiles.__dict__,
                    kernel_ms=times,
                )
                records.append(rec)
                shown = " ".join(f"{k.strip('_')}={v:7.2f}" for k, v in sorted(times.items()))
                print(f"{stage:5s} {str(tuple(tiles.__dict__.values())):32s} {name:9s} {shown}", flush=True)
    print(f"wrote {write_results('tune_kernels', records, args.out)}")


if __name__ == "__main__":
    main()

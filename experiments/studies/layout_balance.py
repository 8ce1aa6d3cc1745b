"""Per-rank balance of each context-parallel layout for the pattern estimated on structured inputs.

Computed from the pattern alone (no GPU needed): for each world size and layout, the max/mean over
ranks of the (q, k) pairs the sparse ring computes (``imbalance_report``). The slowest rank sets a
ring's time, so contiguous/striped time is bounded by about contiguous max/mean divided by striped
max/mean when both rings run their pairs equally fast.

    python -m experiments.studies.layout_balance --seq-len 524288 --world-sizes 2 4 8
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.common import provenance, write_results
from bench.imbalance import imbalance_report
from bench.synthetic import rope_structured_qkv
from mtraining.ops import PatternConfig, estimate_pattern
from mtraining.parallel import make_layout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=524288)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--layouts", nargs="+", default=["contiguous", "zigzag", "striped"])
    p.add_argument("--v-size", type=int, default=1024)
    p.add_argument("--s-size", type=int, default=6144)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hq, hkv, d, g = 16, 2, 128, 128
    start = time.perf_counter()
    q, k, _ = rope_structured_qkv(1, args.seq_len, hq, hkv, d, dtype=dtype, device=device, seed=0)
    pattern = estimate_pattern(q, k, PatternConfig(v_size=args.v_size, s_size=args.s_size, block_size=g))
    density = float(pattern.density().mean())
    print(f"pattern estimated on {device} in {time.perf_counter() - start:.0f} s, density {density:.4f}", flush=True)
    records = []
    for world in args.world_sizes:
        for name in args.layouts:
            report = imbalance_report(pattern, make_layout(name, args.seq_len, world, g))
            rec = dict(
                **provenance(),
                seq_len=args.seq_len,
                inputs="structured",
                v_size=args.v_size,
                s_size=args.s_size,
                density=density,
                world_size=world,
                layout=name,
                rank_max_over_mean=float(report.rank_imbalance),
            )
            records.append(rec)
            print(f"W={world} {name:>10}: rank max/mean {rec['rank_max_over_mean']:.4f}", flush=True)
    print(f"wrote {write_results('layout_balance', records, args.out)}")


if __name__ == "__main__":
    main()

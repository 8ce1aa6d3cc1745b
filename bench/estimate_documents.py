"""Time ``estimate_pattern`` with packed documents against the same call without them (seconds, any device).

One sequence packed from documents of log-uniform lengths (``packed_documents.packed_lengths``), random
bf16 (CUDA) or float32 (CPU) q/k, the default budgets; prints the median of ``--repeats`` timed calls
after one warm-up, and the ratio.

    python bench/estimate_documents.py --device cuda --seq-len 524288           # the packed_documents.py shape
    python bench/estimate_documents.py --device cpu --seq-len 32768 --min-doc 256 --max-doc 8192 --heads-q 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
from common import add_attention_shape  # noqa: E402
from packed_documents import packed_lengths  # noqa: E402

from mtraining.ops import Documents, PatternConfig, estimate_pattern  # noqa: E402


def median_ms(fn, repeats: int, device: torch.device) -> float:
    """Median wall time of ``fn`` over ``repeats`` calls after one warm-up, synchronising on CUDA."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=512 * 1024)
    p.add_argument("--min-doc", type=int, default=1024)
    p.add_argument("--max-doc", type=int, default=128 * 1024)
    add_attention_shape(p)
    p.add_argument("--last-q", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = args.seq_len
    lengths = packed_lengths(n, args.min_doc, args.max_doc, args.seed)
    docs = Documents.from_lengths(lengths)
    gen = torch.Generator().manual_seed(args.seed)
    q = torch.randn(1, n, args.heads_q, args.head_dim, generator=gen).to(device, dtype)
    k = torch.randn(1, n, args.heads_kv, args.head_dim, generator=gen).to(device, dtype)
    config = PatternConfig(
        v_size=args.v_size, s_size=args.s_size, last_q=args.last_q, block_size=args.block_size, local_window=128
    )
    docs_ms = median_ms(lambda: estimate_pattern(q, k, config, documents=docs), args.repeats, device)
    nodocs_ms = median_ms(lambda: estimate_pattern(q, k, config), args.repeats, device)
    print(
        f"seq_len={n} documents={len(lengths)} heads={args.heads_q}/{args.heads_kv} head_dim={args.head_dim} "
        f"{dtype} on {device}: estimate_docs_ms={docs_ms:.1f} estimate_nodocs_ms={nodocs_ms:.1f} "
        f"ratio={docs_ms / nodocs_ms:.2f} (median of {args.repeats})"
    )


if __name__ == "__main__":
    main()

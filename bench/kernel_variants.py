"""A/B driver for kernel variants on one GPU: per-kernel times, bwd/fwd and the training call at 128K.

Run it once per variant in the same device call (the variant is whatever ``mtraining`` the Python
path finds first, plus optional tile overrides), so every variant sees the same machine and inputs:

    python bench/kernel_variants.py --variant base --description "kernels of HEAD"
    PYTHONPATH=exp/red:$PYTHONPATH python bench/kernel_variants.py --variant red --description "..."
    python bench/kernel_variants.py --variant atomic --tiles dkdv=64,64,64,4,2,atomic --description "..."

Per pattern (dense and ~10% density on random inputs, the online pattern on structured inputs) it
records the median CUDA time of each attention kernel (torch.profiler); for the online pattern also
the sparse forward and backward (CUDA events) and the training call (estimate + forward + backward,
a new pattern each call). Records are appended to ``--out`` (default
bench/results/kernel_variants.json).

Internal tool: times single kernels through ``mtraining.ops.sparse.launch``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench.* modules
from common import RESULTS_DIR, provenance  # noqa: E402
from sparse_attention import sparse_times, sweep_pattern, training_step_ms  # noqa: E402
from tune_kernels import kernel_ms  # noqa: E402

from bench.synthetic import rope_structured_qkv  # noqa: E402
from mtraining.ops import PatternConfig, VerticalSlashPattern, estimate_pattern, sparse_attention  # noqa: E402
from mtraining.ops.sparse import launch as tb  # noqa: E402


def parse_tiles(spec: str) -> tuple[str, tb.Tiles]:
    """'dkdv=64,64,64,4,2[,atomic]' -> ("dkdv", Tiles(64, 64, 64, 4, 2, "atomic"))."""
    stage, _, values = spec.partition("=")
    if stage not in ("fwd", "dq", "dkdv") or not values:
        raise ValueError(f"--tiles {spec!r}: expected STAGE=BM,BN,BV,WARPS,STAGES[,DQ_MODE] with STAGE fwd, dq or dkdv")
    parts = values.split(",")
    ints = [int(x) for x in parts[:5]]
    return stage, tb.Tiles(*ints, *parts[5:6])


def grad_difference(call, inputs, variant, reference) -> dict[str, float]:
    """max |g_variant - g_reference| / max |g_reference| of dq, dk, dv: the overridden tiles (say,
    another dQ mode) against the default ones, which the GPU tests check against the oracle."""
    grads = []
    for config in (variant, reference):
        tb.tile_config = config
        call()
        grads.append([t.grad.float().clone() for t in inputs])
    tb.tile_config = variant
    return {name: float((a - b).abs().max() / b.abs().max()) for name, a, b in zip(("dq", "dk", "dv"), *grads)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", required=True)
    p.add_argument("--description", required=True)
    p.add_argument("--tiles", action="append", default=[], help="STAGE=BM,BN,BV,WARPS,STAGES[,DQ_MODE]")
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "kernel_variants.json")
    args = p.parse_args()
    n, hq, hkv, d, g = args.seq_len, 16, 2, 128, 128
    overrides = dict(parse_tiles(s) for s in args.tiles)
    default = tb.tile_config

    def tile_config(*a, **kw):
        return tb.TileConfig(**{**default(*a, **kw).__dict__, **overrides})

    tb.tile_config = tile_config
    base = dict(
        **provenance(),
        variant=args.variant,
        description=args.description,
        seq_len=n,
        tiles={k: v.__dict__ for k, v in tb.tile_config(g, d, torch.device("cuda")).__dict__.items()},
    )
    gen = torch.Generator(device="cuda").manual_seed(0)
    rq, rk, rv = (
        torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        for h in (hq, hkv, hkv)
    )
    sq, sk, sv = rope_structured_qkv(1, n, hq, hkv, d, dtype=torch.bfloat16, device="cuda", seed=0)
    config = PatternConfig(v_size=1024, s_size=6144, block_size=g)
    cases = {
        "dense": ((rq, rk, rv), VerticalSlashPattern.dense(1, hq, n, g, device="cuda")),
        "sparse10": ((rq, rk, rv), sweep_pattern(1, hq, n, g, 0.1, 1024)),
        "estimated": ((sq, sk, sv), estimate_pattern(sq, sk, config)),
    }
    do = torch.randn(1, n, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    records = []
    for name, ((q, k, v), pattern) in cases.items():
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

        def call():
            qg.grad = kg.grad = vg.grad = None
            sparse_attention(qg, kg, vg, pattern).backward(do)

        rec = dict(base, pattern=name, density=float(pattern.density().mean()), kernel_ms=kernel_ms(call))
        if overrides:
            rec["grad_rel_err_vs_default_tiles"] = grad_difference(call, (qg, kg, vg), tile_config, default)
        if name == "estimated":
            f, b, fb = sparse_times(q, k, v, do, pattern)
            rec.update(
                sparse_fwd_ms=f,
                sparse_bwd_ms=b,
                sparse_fwd_bwd_ms=fb,
                bwd_over_fwd=b / f,
                training_step_ms=training_step_ms(q, k, v, do, config),
            )
        records.append(rec)
        shown = " ".join(f"{k.strip('_')}={t:7.2f}" for k, t in sorted(rec["kernel_ms"].items()))
        extra = (
            (
                f" fwd={rec['sparse_fwd_ms']:.2f} bwd={rec['sparse_bwd_ms']:.2f} bwd/fwd={rec['bwd_over_fwd']:.2f}"
                f" step={rec['training_step_ms']:.2f}"
            )
            if name == "estimated"
            else ""
        )
        print(f"{args.variant:8s} {name:9s} {shown}{extra} {rec.get('grad_rel_err_vs_default_tiles', '')}", flush=True)
    old = json.loads(args.out.read_text()) if args.out.exists() else []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(old + records, indent=1) + "\n")
    print(f"appended {len(records)} records to {args.out}")


if __name__ == "__main__":
    main()

"""Single-GPU benchmark: vertical-slash sparse attention (estimate + fwd + bwd) vs cuDNN dense attention.

Qwen2.5-3B attention shape by default (16 query heads, 2 KV heads, head_dim 128, bf16, causal).
For each sequence length and input kind it estimates the pattern online (v_size, s_size), times the
estimation, the sparse forward and backward (pattern and kernel indices reused), the whole step as
training runs it (estimate + forward + backward with a new pattern and new kernel indices every
call: sparse_total_ms, what the speedup is computed from), and cuDNN SDPA on the same inputs in the
same run.
A density sweep times hand-made local + vertical patterns of about 1%, 3%, 10%, 30% density.
``--block-columns K ...`` also times the estimated lines plus K per-block columns per query block
(``PatternConfig.block_columns``: their estimate and their kernel stage), next to the lines alone, once per
``--column-scorers`` (sorted: candidates from sorted hash codes; dense: every pair scored).
``--backends triton fa4`` times each pattern on each ``sparse_attention`` backend in the same run, beside the
same cuDNN figures (one record per backend, its name in ``backend``); "fa4" (FlashAttention-4's block-sparse
kernels for the selected blocks, ``pip install flash-attn-4``) does not compute per-block columns: those rows
are left out for it, and the run says so.

    python bench/sparse_attention.py --seq-lens 32768 65536 131072 262144
    python bench/sparse_attention.py --seq-lens 131072 524288 --backends triton fa4 --inputs structured
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench.* modules
from common import add_attention_shape, bench_ms, provenance, write_results  # noqa: E402

from mtraining.ops import VerticalSlashPattern, sparse_attention  # noqa: E402

BACKENDS = ("triton", "fa4")
"""The ``sparse_attention`` backends this benchmark times (``--backends``)."""


def dense_times(q, k, v, do) -> tuple[float, float]:
    """cuDNN SDPA fwd and fwd+bwd ms; K/V heads expanded outside the timed region."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2).detach().requires_grad_()
    kh = k.transpose(1, 2).repeat_interleave(group, 1).detach().requires_grad_()
    vh = v.transpose(1, 2).repeat_interleave(group, 1).detach().requires_grad_()
    doh = do.transpose(1, 2)

    def fwd():
        return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True)

    def fwd_bwd():
        fwd().backward(doh)

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        with torch.no_grad():
            f = bench_ms(fwd)
        fb = bench_ms(fwd_bwd)
    return f, fb


def sparse_times(q, k, v, do, pattern, backend: str = "auto") -> tuple[float, float, float]:
    """Sparse fwd, bwd (on a retained graph) and fwd+bwd ms on ``backend``."""
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    with torch.no_grad():
        f = bench_ms(lambda: sparse_attention(q, k, v, pattern, backend=backend))
    out = sparse_attention(qg, kg, vg, pattern, backend=backend)
    b = bench_ms(lambda: out.backward(do, retain_graph=True), warmup_ms=50)
    del out

    def fwd_bwd():
        sparse_attention(qg, kg, vg, pattern, backend=backend).backward(do)

    fb = bench_ms(fwd_bwd)
    return f, b, fb


def training_step_ms(q, k, v, do, config, backend: str = "auto") -> float:
    """Estimate + forward + backward on ``backend`` as a training step runs them: a new pattern every call, so
    its kernel indices (and block lists) are built inside the timed region too."""
    from mtraining.ops import estimate_pattern

    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def step():
        sparse_attention(qg, kg, vg, estimate_pattern(q, k, config), backend=backend).backward(do)

    return bench_ms(step)


def sweep_pattern(b: int, h: int, n: int, g: int, density: float, n_verticals: int) -> VerticalSlashPattern:
    """Local block diagonals plus spread verticals, sized to roughly the target density."""
    nb = -(-n // g)
    n_diags = max(1, round(density * nb / 2))
    diag = torch.zeros(b, h, nb, dtype=torch.bool, device="cuda")
    diag[..., :n_diags] = True
    vert = torch.zeros(b, h, n, dtype=torch.bool, device="cuda")
    vert[..., :: max(1, n // n_verticals)] = True
    return VerticalSlashPattern.from_masks(diag, vert, g)


def run(args) -> list[dict]:
    from bench.synthetic import random_qkv, rope_structured_qkv
    from mtraining.ops import PatternConfig, estimate_pattern

    generators = {"structured": rope_structured_qkv, "random": random_qkv}
    hq, hkv, d, g = args.heads_q, args.heads_kv, args.head_dim, args.block_size
    base = dict(
        **provenance(),
        heads_q=hq,
        heads_kv=hkv,
        head_dim=d,
        dtype="bfloat16",
        block_size=g,
    )
    if "fa4" in args.backends:
        base["flash_attn_4"] = metadata.version("flash-attn-4")
    records: list[dict] = []
    scorers = [(0, "sorted")] + [(c, scorer) for c in args.block_columns for scorer in args.column_scorers]
    configs = {
        (columns, scorer): PatternConfig(
            v_size=args.v_size, s_size=args.s_size, block_size=g, block_columns=columns, column_scorer=scorer
        )
        for columns, scorer in scorers
    }
    for n in args.seq_lens:
        for kind in args.inputs:
            q, k, v = generators[kind](1, n, hq, hkv, d, dtype=torch.bfloat16, device="cuda", seed=0)
            do = torch.randn_like(q)
            dense_f, dense_fb = dense_times(q, k, v, do)
            cases = [("estimated", args.v_size, args.s_size, None, key) for key in configs]
            if n in args.sweep_lens and kind == "structured":
                cases += [("sweep", None, None, target, (0, "sorted")) for target in args.sweep]
            for source, v_size, s_size, target, (columns, scorer) in cases:
                if source == "estimated":
                    config = configs[columns, scorer]
                    est_ms = bench_ms(lambda: estimate_pattern(q, k, config), warmup_ms=50, rep_ms=300)
                    pattern = estimate_pattern(q, k, config)
                else:
                    config, est_ms = None, 0.0
                    pattern = sweep_pattern(1, hq, n, g, target, 1024)
                density = float(pattern.density().mean())
                for backend in args.backends:
                    if backend == "fa4" and columns:
                        print(f"{n:>7} {kind:>10} cols={columns}: fa4 does not compute per-block columns, left out")
                        continue
                    f, b, fb = sparse_times(q, k, v, do, pattern, backend)
                    total = training_step_ms(q, k, v, do, config, backend) if config is not None else fb
                    rec = dict(
                        base,
                        backend=backend,
                        seq_len=n,
                        inputs=kind,
                        pattern=source,
                        target_density=target,
                        v_size=v_size,
                        s_size=s_size,
                        block_columns=columns,
                        column_scorer=scorer if columns else None,
                        density=density,
                        estimate_ms=est_ms,
                        sparse_fwd_ms=f,
                        sparse_bwd_ms=b,
                        sparse_fwd_bwd_ms=fb,
                        sparse_total_ms=total,
                        dense_fwd_ms=dense_f,
                        dense_fwd_bwd_ms=dense_fb,
                        speedup_fwd_bwd=dense_fb / total,
                        over_ideal=total / (density * dense_fb),
                        bwd_over_fwd=b / f,
                        dense_tflops_fwd_bwd=3.5 * 4 * n * n / 2 * d * hq / dense_fb / 1e9,
                    )
                    records.append(rec)
                    print(
                        f"{n:>7} {kind:>10} {source:>9} {backend:>6} cols={columns:>4}{'/' + scorer if columns else ''} "
                        f"dens={density:6.3f} est={est_ms:6.2f} fwd={f:7.2f} "
                        f"bwd={b:7.2f} fb={fb:7.2f} dense_fb={dense_fb:7.2f} speedup={rec['speedup_fwd_bwd']:5.2f} "
                        f"over_ideal={rec['over_ideal']:4.2f} bwd/fwd={b / f:4.2f}",
                        flush=True,
                    )
                del pattern
            del q, k, v, do
            torch.cuda.empty_cache()
    return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 65536, 131072, 262144])
    p.add_argument("--inputs", nargs="+", default=["structured", "random"], choices=["structured", "random"])
    add_attention_shape(p)
    p.add_argument("--sweep", type=float, nargs="*", default=[0.01, 0.03, 0.1, 0.3])
    p.add_argument("--sweep-lens", type=int, nargs="*", default=[131072])
    p.add_argument("--block-columns", type=int, nargs="*", default=[], help="per-block column counts to time too")
    p.add_argument(
        "--column-scorers", nargs="+", default=["sorted"], choices=["sorted", "dense"], help="with --block-columns"
    )
    p.add_argument(
        "--backends", nargs="+", default=["triton"], choices=BACKENDS, help="sparse_attention backends to time"
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/sparse_attention.py needs a CUDA GPU")
    path = write_results("sparse_attention", run(args), args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Packed documents on one GPU: sparse attention with document masking against dense attention with
document masking and against sparse attention across documents (today), plus per-rank balance.

One sequence of ``--seq-len`` tokens (default 512K) packed from documents of log-uniform lengths in
[--min-doc, --max-doc] (default 1K-128K; the last one cut to fit), Qwen2.5-3B attention shape, bf16,
structured inputs (``rope_structured_qkv``), patterns estimated online at the default budgets (with the
documents, and without them for the unmasked case). Timed forward + backward on the same inputs:
- ``sparse_docs``: ``sparse_attention(..., documents=)`` with the documents' pattern;
- ``dense_docs``: our dense path with documents (cuDNN per document through ops/dense) and, as an
  independent baseline, cuDNN SDPA called once per document;
- ``sparse_nodocs``: today's sparse attention across documents with its own pattern, with
  ``documents=None`` and with one document per sequence (``Documents.from_lengths([N])``: must cost the same);
- ``dense_causal`` (with ``--dense-causal``; the whole causal grid, the slowest case): dense causal over the sequence.
Goals (issue 16): one document per sequence no slower than today; ``sparse_docs`` within 1.3x of
(masked density x ``dense_docs``); per-rank imbalance <= 1.1 on the striped layout. The per-rank figures
come from emulated ranks on this GPU: each rank's ring steps (``parallel.ring.plan_ring``: skipped steps
cost nothing) timed in turn, no communication, next to the exact pair counts (``bench/imbalance.py``).

    python bench/packed_documents.py --out $OUT/packed_documents.json
    python bench/packed_documents.py --check --device cpu --seq-len 2048 --min-doc 16 --max-doc 512 --block-size 16

Internal tool: plans each rank's steps with ``mtraining.parallel.ring.plan`` and picks the backend
with ``mtraining.ops.sparse.attention``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench.* modules
from common import add_attention_shape, bench_ms, command_line, commit, device_name, write_results  # noqa: E402

from bench.imbalance import imbalance_report  # noqa: E402
from bench.synthetic import rope_structured_qkv  # noqa: E402
from mtraining.ops import Documents, PatternConfig, attention_oracle, estimate_pattern, sparse_attention  # noqa: E402
from mtraining.ops.sparse import attention_delta  # noqa: E402
from mtraining.ops.sparse.attention import resolve_backend  # noqa: E402
from mtraining.parallel import make_layout  # noqa: E402
from mtraining.parallel.ring.plan import plan_ring  # noqa: E402

LAYOUTS = ("striped", "zigzag", "contiguous")
CHECK_TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 2e-2}  # relative error against the float64 oracle


def packed_lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    """Document lengths, log-uniform in [lo, hi], drawn until they fill n tokens (the last one cut to fit)."""
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < n:
        size = math.exp(math.log(lo) + float(torch.rand(1, generator=gen)) * (math.log(hi) - math.log(lo)))
        lengths.append(min(int(size), n - sum(lengths)))
    return lengths


def per_document_sdpa(q, k, v, lengths: list[int]):
    """Dense attention with document masking as one cuDNN SDPA causal call per document (K/V heads expanded)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[2] // k.shape[2]
    outs, start = [], 0
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for n in lengths:
            rows = slice(start, start + n)
            qh = q[:, rows].transpose(1, 2)
            kh, vh = (t[:, rows].transpose(1, 2).repeat_interleave(group, 1) for t in (k, v))
            outs.append(torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(1, 2))
            start += n
    return torch.cat(outs, 1)


def fwd_bwd(attend: Callable, q, k, v, do) -> Callable[[], None]:
    """A closure running attend(q, k, v) forward and backward (fresh leaves: no graph kept between calls)."""
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def run() -> None:
        attend(qg, kg, vg).backward(do)

    return run


def emulated_rank_ms(q, k, v, do, pattern, layout, documents, timer) -> list[float]:
    """Per rank of ``layout``: the time of its ring steps (forward then backward, one after another, on this
    device, no communication) with ``documents``; skipped steps cost nothing, as in the ring."""
    backend = resolve_backend("auto", q.device)
    scale = q.shape[-1] ** -0.5
    shards = [[layout.shard(t, r) for t in (q, k, v, do)] for r in range(layout.world_size)]
    times = []
    for rank in range(layout.world_size):
        qr, _, _, dor = shards[rank]
        plan = plan_ring(qr, qr, pattern, layout, rank, scale, backend, documents)

        def steps() -> None:
            out = lse = None
            for src in range(layout.world_size):
                out, lse = plan.attend(src, qr, shards[src][1], shards[src][2], torch.float32, out, lse)
            if out is None:
                return
            out = out.to(qr.dtype)  # as the ring's autograd op keeps it for the backward
            delta = attention_delta(dor, out)
            for src in range(layout.world_size):
                plan.grads(src, dor, qr, shards[src][1], shards[src][2], out, lse, delta)

        times.append(timer(steps))
    return times


def check(q, k, v, pattern, documents: Documents, lengths: list[int]) -> dict:
    """Relative errors (max |x - ref| / max |ref|) of the sparse and dense paths with documents against the
    float64 oracle, forward and backward; the per-document SDPA baseline on the dense oracle."""
    dt = CHECK_TOLERANCE[q.dtype]
    do = torch.randn_like(q)
    errors = {}
    for name, pat in (("sparse_docs", pattern), ("dense_docs", None)):
        qd, kd, vd = (t.double().detach().requires_grad_() for t in (q, k, v))
        ref, _ = attention_oracle(qd, kd, vd, pat, documents=documents)
        ref_grads = torch.autograd.grad(ref, (qd, kd, vd), do.double())
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        out = sparse_attention(qg, kg, vg, pat, documents=documents)
        grads = torch.autograd.grad(out, (qg, kg, vg), do)
        for what, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
            errors[f"{name}_{what}"] = _relative(got, want)
        if name == "dense_docs":
            sdpa = per_document_sdpa(q, k, v, lengths) if q.is_cuda else None
            if sdpa is not None:
                errors["sdpa_per_document_out"] = _relative(sdpa, ref)
    errors["passed"] = all(e < dt for key, e in errors.items() if key != "passed")
    return errors


def run(args) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cuda = device.type == "cuda"
    timer = bench_ms if cuda else _cpu_ms
    n, g, hq, hkv, d = args.seq_len, args.block_size, args.heads_q, args.heads_kv, args.head_dim
    lengths = packed_lengths(n, args.min_doc, args.max_doc, args.seed)
    docs = Documents.from_lengths(lengths)
    one = Documents.from_lengths([n])
    q, k, v = rope_structured_qkv(1, n, hq, hkv, d, dtype=dtype, device=device, seed=args.seed)
    do = torch.randn_like(q)
    config = PatternConfig(
        v_size=min(args.v_size, n), s_size=min(args.s_size, n), block_size=g, last_q=min(64, args.min_doc),
        local_window=min(128, args.min_doc), sink_tokens=4,
    )  # fmt: skip
    record: dict = dict(
        device=device_name() if cuda else "cpu",
        commit=commit(),
        command=command_line(),
        seq_len=n,
        heads_q=hq,
        heads_kv=hkv,
        head_dim=d,
        dtype=str(dtype).removeprefix("torch."),
        block_size=g,
        documents=len(lengths),
        document_lengths=lengths,
        pattern_config=dict(v_size=config.v_size, s_size=config.s_size, last_q=config.last_q),
    )
    pattern_docs = estimate_pattern(q, k, config, documents=docs)
    pattern_all = estimate_pattern(q, k, config)
    within = sum(x * (x + 1) / 2 for x in lengths)
    record.update(
        masked_density=float(pattern_docs.density(docs).mean()),  # of the pairs within documents
        document_pair_fraction=within / (n * (n + 1) / 2),  # pairs within documents / causal pairs
        unmasked_density=float(pattern_all.density().mean()),
    )
    record["check"] = check(q, k, v, pattern_docs, docs, lengths) if args.check else None
    record["estimate_docs_ms"] = timer(lambda: estimate_pattern(q, k, config, documents=docs))
    record["estimate_nodocs_ms"] = timer(lambda: estimate_pattern(q, k, config))
    cases = {
        "sparse_docs": lambda a, b, c: sparse_attention(a, b, c, pattern_docs, documents=docs),
        "sparse_nodocs": lambda a, b, c: sparse_attention(a, b, c, pattern_all),
        "sparse_one_document": lambda a, b, c: sparse_attention(a, b, c, pattern_all, documents=one),
        "dense_docs": lambda a, b, c: sparse_attention(a, b, c, None, documents=docs),
    }
    if args.dense_causal:
        cases["dense_causal"] = lambda a, b, c: sparse_attention(a, b, c, None)
    if cuda:
        cases["sdpa_per_document"] = lambda a, b, c: per_document_sdpa(a, b, c, lengths)
    for name, attend in cases.items():
        record[f"{name}_fwd_bwd_ms"] = timer(fwd_bwd(attend, q, k, v, do))
        print(f"{name:>22}: {record[f'{name}_fwd_bwd_ms']:9.2f} ms fwd+bwd", flush=True)
    ideal = record["masked_density"] * record["dense_docs_fwd_bwd_ms"]
    record["sparse_docs_over_ideal"] = record["sparse_docs_fwd_bwd_ms"] / ideal
    record["one_document_over_today"] = record["sparse_one_document_fwd_bwd_ms"] / record["sparse_nodocs_fwd_bwd_ms"]
    balance = {}
    for name in args.layouts:
        layout = make_layout(name, n, args.world, g)
        report = imbalance_report(pattern_docs, layout, docs)
        times = emulated_rank_ms(q, k, v, do, pattern_docs, layout, docs, timer)
        balance[name] = dict(
            pair_rank_imbalance=report.rank_imbalance,
            pair_lockstep_imbalance=report.lockstep_imbalance,
            rank_pairs=report.rank_totals.tolist(),
            rank_fwd_bwd_ms=times,
            time_rank_imbalance=max(times) / (sum(times) / len(times)),
        )
        print(f"{name:>22}: pairs max/mean {report.rank_imbalance:.3f}, time max/mean "
              f"{balance[name]['time_rank_imbalance']:.3f} over {args.world} emulated ranks", flush=True)  # fmt: skip
    record["balance"] = balance
    record["goals"] = dict(
        one_document_no_slower=record["one_document_over_today"] <= 1.02,
        within_1_3x_of_ideal=record["sparse_docs_over_ideal"] <= 1.3,
        striped_imbalance_le_1_1=balance.get("striped", {}).get("time_rank_imbalance", math.inf) <= 1.1,
    )
    return record


def _relative(got, want) -> float:
    """max |got - want| / max |want| in float64."""
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max())


def _cpu_ms(fn: Callable[[], object]) -> float:
    """Milliseconds of one call on the CPU (after one warm-up call): the CPU check's timer."""
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=512 * 1024)
    p.add_argument("--min-doc", type=int, default=1024)
    p.add_argument("--max-doc", type=int, default=128 * 1024)
    add_attention_shape(p)
    p.add_argument("--world", type=int, default=4, help="emulated context-parallel ranks")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--check", action="store_true", help="also check against the float64 oracle (small sizes)")
    p.add_argument("--dense-causal", action="store_true", help="also time dense causal attention over the sequence")
    p.add_argument("--out", type=Path, default=None, help="a folder or .json file (default bench/results/)")
    args = p.parse_args(argv)
    if args.seq_len % (2 * args.world * args.block_size):
        p.error(f"--seq-len must be a multiple of 2 x world x block size = {2 * args.world * args.block_size}")
    if not 1 <= args.min_doc <= args.max_doc:
        p.error("need 1 <= --min-doc <= --max-doc")
    record = run(args)
    out = args.out / "packed_documents.json" if args.out is not None and args.out.suffix != ".json" else args.out
    print(f"wrote {write_results('packed_documents', [record], out)}")
    return record


if __name__ == "__main__":
    main()

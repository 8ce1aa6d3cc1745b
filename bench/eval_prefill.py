"""Where the time of an evaluation prefill goes: ``Engine.respond`` against the bare model forward it wraps.

The real-model experiment reads a model through ``mtraining.eval.engine.Engine.respond``: one prefill of the prompt
and its teacher-forced answer through the attention under test. On an H200 such a prefill of SmolLM2-135M took
3.5 s (dense) and 5.2 s (sparse) at 64K against 0.2-0.3 s at 32K. For each arm and length this times, on random
token ids, a prompt of ``length - PROMPT_GAP`` tokens plus ``--answer-tokens`` (as NIAH's: seldom a multiple of the
block) through:

- ``engine``: ``respond(prompt, 1, reference=answer)``, warm (the same shape again) and ``engine_new_shape``
  (a prompt one token shorter per call, ``tokens`` its first's: every call a new shape, as the evaluation's);
- ``prefill``: the engine's own forward (``Engine._prefill``) with its KV cache and documents;
- ``cache``: the same with the cache alone; ``forward``: neither; ``aligned``: neither, at the nearest multiple of
  the block size.

engine - prefill is the engine's own work (scoring, host reads), prefill - cache the documents, cache - forward
the cache, forward - aligned the length's alignment, and sparse against dense at ``aligned`` the attention.
Each case keeps its first (cold) call apart from the median of ``--repeats`` warm ones; ``--profile`` adds one
profiled ``respond`` per arm and length (top ops by device time on CUDA, by CPU time otherwise, the table saved
beside ``--out``). Records stream to ``--out`` after every case, so a run cut short keeps what it measured.

    python bench/eval_prefill.py --model <export> --lengths 32768 65536 --profile --out $OUT/eval_prefill.json
    python bench/eval_prefill.py --random .gguf/tok/config.json --lengths 65536   # SmolLM2's shape, no weights needed
    python bench/eval_prefill.py --tiny --lengths 512 1024 --repeats 1   # CPU plumbing check

Internal tool: calls ``mtraining.eval.engine``'s ``Engine._prefill`` and ``Engine._sequence``, so the bare forwards
are the engine's own (its attention, cache and documents). bench/ cannot import experiments/
(tests/test_boundaries.py): ``ADAPTIVE`` holds the experiment's adaptive arm at its GPU settings, and
tests/bench/test_eval_prefill.py checks it against ``experiments.real_extension.evaluation.spec``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: mtraining
from common import RESULTS_DIR, provenance, write_results  # noqa: E402
from train_throughput import ARCHS  # noqa: E402

from mtraining.eval.engine import AttentionSpec, Engine  # noqa: E402

BLOCK = 128  # the experiment's block size (and the layout's unit on one process)
TINY_BLOCK = 32  # the tiny model's: enough blocks at a few hundred tokens for a pattern to leave some out
PROMPT_GAP = 34  # NIAH's 64K prompts held 65490-65502 tokens: 34-46 short of the length
ADAPTIVE = dict(threshold=0.9, v_size=4096, s_size=4096, last_q=64, local_window=128, sink_tokens=4)
TINY_PATTERN = dict(threshold=0.9, v_size=16, s_size=32, last_q=32, local_window=32, sink_tokens=4)
TOP = 25  # ops printed and recorded per profile


def attention_spec(arm: str, tiny: bool = False) -> AttentionSpec:
    """The evaluation's attention for ``arm`` (dense, or sparse: the adaptive setting; the tiny model's budgets)."""
    pattern = (TINY_PATTERN if tiny else ADAPTIVE) if arm == "sparse" else {}
    block = TINY_BLOCK if tiny else BLOCK
    return AttentionSpec(
        sparse=arm == "sparse", layout="striped", block_size=block, backend="auto", pattern=dict(pattern)
    )


def load_model(args: argparse.Namespace) -> torch.nn.Module:
    """``--model`` as the evaluation loads it (bf16 on CUDA), ``--random``'s shape with random weights on the same
    device and dtype, or train_throughput's random tiny Qwen2 (float32, CPU)."""
    from mtraining.eval.loading import load, pick_device, pick_dtype
    from mtraining.models import build_model

    torch.manual_seed(0)
    if args.tiny:
        return build_model(config=ARCHS["tiny"]).eval()
    if args.random is not None:
        device = pick_device(None)
        return build_model(config=json.loads(args.random.read_text())).to(device, pick_dtype(None, device)).eval()
    return load(args.model).model


def timed(fn: Callable[[int], object], repeats: int, sync: Callable[[], None]) -> dict:
    """Seconds of call 0 (cold) and of calls 1..repeats (warm), each between two syncs; ``fn`` takes the call's
    index."""
    times = []
    for i in range(repeats + 1):
        sync()
        started = time.perf_counter()
        fn(i)
        sync()
        times.append(time.perf_counter() - started)
    return {"first_s": times[0], "median_s": statistics.median(times[1:]), "times": times}


def top_ops(fn: Callable[[], object], on_cuda: bool, table: Path) -> list[dict]:
    """The ``TOP`` ops of one profiled call of ``fn`` by self device time (CUDA) or self CPU time; the profiler's
    table is written to ``table``."""
    key = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])) as prof:
        fn()
        if on_cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    table.write_text(events.table(sort_by=key, row_limit=60) + "\n")
    ranked = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:TOP]
    return [
        {"name": e.key, "calls": e.count, "self_ms": getattr(e, key) / 1e3, "cpu_ms": e.self_cpu_time_total / 1e3}
        for e in ranked
    ]


def measure(
    model: torch.nn.Module, arm: str, length: int, args: argparse.Namespace, emit: Callable[[dict], None]
) -> None:
    """Every case of ``arm`` at ``length``, each handed to ``emit`` as it ends."""
    device = next(model.parameters()).device
    on_cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else lambda: None
    vocab = model.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(length)
    prompt = torch.randint(1, vocab, (length - PROMPT_GAP,), generator=gen).tolist()
    answer = torch.randint(1, vocab, (args.answer_tokens,), generator=gen).tolist()
    spec = attention_spec(arm, args.tiny)
    seq = len(prompt) + len(answer)
    aligned = max(spec.block_size, round(seq / spec.block_size) * spec.block_size)
    ids = torch.tensor(prompt + answer)
    aligned_ids = torch.randint(1, vocab, (aligned,), generator=gen)

    def prefill(tokens: torch.Tensor, cache: bool, documents: bool) -> Callable[[int], object]:
        """The engine's forward of ``tokens``, with a fresh KV cache and the engine's documents where asked."""
        from transformers import DynamicCache

        def run(_: int) -> object:
            docs = engine._sequence(len(prompt), len(answer))[1] if documents else None
            return engine._prefill(tokens, DynamicCache(config=model.config) if cache else None, docs)

        return run

    cases = {
        "engine": (seq, lambda _: engine.respond(prompt, 1, reference=answer)),
        "engine_new_shape": (seq - 1, lambda i: engine.respond(prompt[: len(prompt) - 1 - i], 1, reference=answer)),
        "prefill": (seq, prefill(ids, cache=True, documents=True)),
        "cache": (seq, prefill(ids, cache=True, documents=False)),
        "forward": (seq, prefill(ids, cache=False, documents=False)),
        "aligned": (aligned, prefill(aligned_ids, cache=False, documents=False)),
    }
    for case, (tokens, fn) in cases.items():
        engine = Engine(model, spec)  # a fresh engine per case: its phases and densities are the case's
        if on_cuda:
            torch.cuda.reset_peak_memory_stats()
        found = timed(fn, args.repeats, sync)
        density = statistics.fmean(engine.densities) if engine.densities else None
        peak = torch.cuda.max_memory_allocated() / 2**30 if on_cuda else None
        phases = asdict(engine.phases) if case.startswith("engine") else None
        emit(
            dict(arm=arm, length=length, case=case, tokens=tokens, density=density, peak_gb=peak, phases=phases) | found
        )
    if args.profile:
        engine = Engine(model, spec)
        out = args.out or RESULTS_DIR / "eval_prefill.json"
        table = out.with_name(f"{out.stem}_profile_{arm}_{length}.txt")
        ops = top_ops(lambda: engine.respond(prompt, 1, reference=answer), on_cuda, table)
        emit(dict(arm=arm, length=length, case="profile", tokens=seq, table=table.name, top=ops))
        print(f"  top ops by {'device' if on_cuda else 'CPU'} time (table: {table}):")
        for op in ops[:12]:
            print(f"    {op['self_ms']:10.2f} ms {op['calls']:6d}x  {op['name'][:90]}")


def summary(records: list[dict]) -> None:
    """Each arm and length's medians as differences (module docstring) and the aligned forward's (sparse against
    dense: the attention)."""
    median = {(r["arm"], r["length"], r["case"]): r["median_s"] for r in records if "median_s" in r}
    order = ("engine", "prefill", "cache", "forward", "aligned")
    names = ("engine's own", "documents", "cache", "alignment")
    for arm, length in dict.fromkeys((a, n) for a, n, _ in median):
        s = [median.get((arm, length, c)) for c in order]
        parts = [f"{name} {a - b:+.3f}" for name, a, b in zip(names, s, s[1:]) if a is not None and b is not None]
        print(f"{length:>8} {arm:>6}: " + ", ".join(parts) + (f", aligned {s[-1]:.3f} s" if s[-1] is not None else ""))


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="a Hugging Face folder the evaluation loads (an export)")
    source.add_argument("--random", type=Path, help="a Hugging Face config.json: its shape with random weights")
    source.add_argument("--tiny", action="store_true", help="a random two-layer Qwen2 (CPU plumbing check)")
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536])
    p.add_argument("--arms", nargs="+", choices=("dense", "sparse"), default=["dense", "sparse"])
    p.add_argument("--repeats", type=int, default=3, help="warm calls per case (after one cold call)")
    p.add_argument("--answer-tokens", type=int, default=8, help="the teacher-forced answer's length")
    p.add_argument("--profile", action="store_true", help="profile one respond per arm and length")
    p.add_argument("--out", type=Path, default=None, help="the JSON (default bench/results/eval_prefill.json)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.answer_tokens < 0:
        p.error("--repeats must be at least 1 and --answer-tokens at least 0")
    if min(args.lengths) < PROMPT_GAP + args.repeats + 2:
        p.error(f"--lengths must exceed {PROMPT_GAP + args.repeats + 1} (the prompt is the length less {PROMPT_GAP})")
    budget = max(ADAPTIVE["v_size"], ADAPTIVE["s_size"])
    if "sparse" in args.arms and not args.tiny and min(args.lengths) < 2 * budget:
        p.error(
            f"the sparse arm keeps up to {budget} lines a head: --lengths of at least {2 * budget} (the experiment's)"
        )
    model = load_model(args)
    on_cuda = next(model.parameters()).device.type == "cuda"
    head = provenance(on_gpu=on_cuda) | {
        "gpus": torch.cuda.device_count(),
        "model": str(args.model or args.random or "tiny"),
    }
    head |= {"answer_tokens": args.answer_tokens, "repeats": args.repeats}
    records: list[dict] = []

    def emit(record: dict) -> None:
        records.append(head | record)
        write_results("eval_prefill", records, args.out)
        if "median_s" in record:
            density = "" if record["density"] is None else f"  density {record['density']:.3f}"
            peak = "" if record["peak_gb"] is None else f"  peak {record['peak_gb']:.1f} GB"
            print(
                f"{record['length']:>8} {record['arm']:>6} {record['case']:<16} {record['tokens']:>7} tokens  "
                f"first {record['first_s']:.3f} s  median {record['median_s']:.3f} s{density}{peak}",
                flush=True,
            )

    print(f"{head['device']}, commit {head['commit']}: {head['model']}")
    for length in args.lengths:
        for arm in args.arms:
            measure(model, arm, length, args, emit)
    summary(records)
    return records


if __name__ == "__main__":
    main()

"""What one NIAH prompt costs the evaluation: building it, its prefill (the whole prompt and the reference answer
through the attention under test) and its dense decoding, per length and attention.

Prompts are ``mtraining eval niah``'s (``tasks.generate("niah_single")``, real filler with ``--haystack``), answered
by ``answers.answer`` with teacher forcing, as the CLI does; the engine's dense decoding is timed apart, so the
prefill is the rest of the response. ``--build-only`` lengths time prompt building alone (the tokenizer, on the
host), e.g. at 64K where a CPU prefill would take too long. On a GPU the times are synchronised by the answers
(the engine returns Python lists), and the first prompt of each attention includes compiling its kernels.

    python -m experiments.studies.eval_cost MODEL_DIR --haystack heldout.jsonl --lengths 1K,2K --prompts 3 \\
        --sparse v_size=128,s_size=256,last_q=64,local_window=64 --block-size 64 --out bench/results/eval_cost_cpu.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.common import provenance, write_results
from mtraining.eval.answers import answer
from mtraining.eval.documents import Haystack, load_documents
from mtraining.eval.engine import AttentionSpec, Engine
from mtraining.eval.loading import load
from mtraining.eval.runtime import parse_lengths
from mtraining.eval.tasks import generate


def pattern_of(text: str) -> dict:
    """'v_size=128,s_size=256' -> {"v_size": 128, "s_size": 256} (numbers as int or float, paths as text)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        try:
            out[key] = int(value)
        except ValueError:
            try:
                out[key] = float(value)
            except ValueError:
                out[key] = value
    return out


def build(tokenizer, haystack: Haystack, length: int, seed: int):
    started = time.perf_counter()
    sample = generate("niah_single", length, seed, tokenizer.count, haystack, depth=0.5)
    return sample, time.perf_counter() - started


def timed_answers(engine: Engine, tokenizer, samples: list) -> list[dict]:
    """Per sample: the response's seconds, the dense decode's seconds and steps, the scores."""
    decode = {"s": 0.0, "steps": 0}
    inner = engine._decode

    def timed_decode(cache, first, max_new_tokens, stop_ids):
        started = time.perf_counter()
        tokens = inner(cache, first, max_new_tokens, stop_ids)
        decode["s"] += time.perf_counter() - started
        decode["steps"] += len(tokens) - 1
        return tokens

    engine._decode = timed_decode
    rows = []
    for sample in samples:
        decode.update(s=0.0, steps=0)
        started = time.perf_counter()
        got = answer(engine, tokenizer, sample)
        total = time.perf_counter() - started
        rows.append(
            {
                "prompt_tokens": sample.prompt_tokens,
                "respond_s": round(total, 3),
                "prefill_s": round(total - decode["s"], 3),
                "decode_s": round(decode["s"], 3),
                "decode_steps": decode["steps"],
                "found": sample.answers[0] in got.prediction,
                "forced_all_greedy": got.forced.all_greedy,
                "forced_nll": round(sum(got.forced.nll) / len(got.forced.nll), 4),
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path, help="a Hugging Face model folder with its tokenizer")
    p.add_argument("--haystack", type=Path, nargs="+", required=True, help="held-out documents for the filler")
    p.add_argument("--lengths", default="1K,2K")
    p.add_argument("--build-only", default="", help="lengths whose prompts are only built (e.g. 64K)")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--sparse", default="v_size=128,s_size=256,last_q=64,local_window=64")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    loaded = load(args.model, None, None, args.device, args.dtype)
    tokenizer = loaded.tokenizer
    haystack = Haystack(load_documents(args.haystack), seed=0)
    records = []
    for length in parse_lengths(args.build_only) if args.build_only else []:
        times = [build(tokenizer, haystack, length, seed)[1] for seed in range(args.prompts)]
        records.append({**provenance(), "length": length, "build_s": [round(t, 3) for t in times]})
        print(records[-1], flush=True)
    for length in parse_lengths(args.lengths):
        built = [build(tokenizer, haystack, length, seed) for seed in range(args.prompts)]
        for attention in ("dense", "sparse"):
            pattern = pattern_of(args.sparse) if attention == "sparse" else {}
            spec = AttentionSpec(
                sparse=attention == "sparse", block_size=args.block_size, backend=args.backend, pattern=pattern
            )
            engine = Engine(loaded.model, spec)
            rows = timed_answers(engine, tokenizer, [s for s, _ in built])
            records.append(
                {
                    **provenance(),
                    "model": str(args.model),
                    "length": length,
                    "attention": attention,
                    "pattern": pattern,
                    "block_size": args.block_size,
                    "dtype": str(next(loaded.model.parameters()).dtype).removeprefix("torch."),
                    "build_s": [round(t, 3) for _, t in built],
                    "density": engine.densities,
                    "prompts": rows,
                }
            )
            print({k: v for k, v in records[-1].items() if k not in ("command",)}, flush=True)
    if args.out:
        print("wrote", write_results("eval_cost", records, args.out))


if __name__ == "__main__":
    main()

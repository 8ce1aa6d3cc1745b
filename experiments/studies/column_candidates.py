"""How many pairs the sorted column scorer walks, on a model's own Q/K or on synthetic ones (CPU is enough).

The sorted scorer (mtraining/ops/estimate/column_buckets.py) scores, per row and hash table, the keys of the
row's bucket before its block: its work is the sum of those windows. With balanced hashes a window holds
1 / 2^bits of the keys before the block; real keys crowd into fewer buckets. This script hashes the Q/K of
some layers exactly as ``select_block_columns`` does (same planes, seeded by the layer), and records per
layer and head: the windows' sum against the keys before the rows' blocks (``slot_fraction``, per table;
``skew`` = that times 2^bits: 1 for balanced hashes), window-length quantiles, the largest bucket's share of
the keys, and how many windows exceed each ``--caps`` value. Windows grow with the position, so at a length
L' the same text gives windows about L'/L longer and the same slot fraction. With ``--agreement K`` it also
chooses K columns per block on the layer's lines (``--v-size``, ``--s-size``) with the dense scorer and
with the sorted one at each cap (torch), and records the share of the dense scorer's columns the sorted
one keeps (``kept_cap_<cap>``; ``kept_cap_none``: no cap).

Internal tool: it reads the hashing of ``mtraining.ops.estimate.hashing``, the chooser of
``mtraining.ops.estimate.block_columns`` and the windows of ``mtraining.ops.estimate.column_buckets`` directly,
since those are what it measures.

    python -m experiments.studies.column_candidates --model /path/to/hf-folder --tokens corpus/train/code.npy --offset 1000000 \
        --seq-len 8192 --layers 3 11 19 27 --agreement 128 --caps 256 512 1024 \
        --out bench/results/column_candidates_smollm2_code.json
    python -m experiments.studies.column_candidates --synthetic structured --seq-len 8192 --out bench/results/column_candidates_structured.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from bench.common import provenance, write_results
from mtraining.ops import PatternConfig, estimate_pattern
from mtraining.ops.estimate.block_columns import select_block_columns
from mtraining.ops.estimate.column_buckets import row_windows, sort_keys
from mtraining.ops.estimate.hashing import hashed_heads


def model_qk(folder: Path, tokens: Tensor, layers: list[int]) -> dict[int, tuple[Tensor, Tensor]]:
    """Post-RoPE (q [1, S, Hq, D], k [1, S, Hkv, D]) of ``layers`` of the Hugging Face model in ``folder`` on
    ``tokens`` [S] (float32, CPU; the layers after the last asked are not run)."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    captured: dict[int, tuple[Tensor, Tensor]] = {}

    def capture(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if module.layer_idx in layers:
            captured[module.layer_idx] = (query.transpose(1, 2).clone(), key.transpose(1, 2).clone())
        group = query.shape[1] // key.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1), is_causal=True, scale=scaling
        )
        return out.transpose(1, 2), None

    AttentionInterface.register("capture_qk", capture)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="capture_qk", dtype=torch.float32)
    model.model.layers = model.model.layers[: max(layers) + 1]
    with torch.no_grad():
        model.model(input_ids=tokens[None].long())
    return captured


def window_stats(q: Tensor, k: Tensor, layer: int, block_size: int, tables: int, bits: int, caps: list[int]) -> list:
    """Per query head: the windows of every row (no documents, no cap) and what the module docstring lists."""
    n = q.shape[1]
    _, _, q_codes, k_codes = hashed_heads(q, k, tables, bits, layer)
    pos = torch.arange(n)
    win = row_windows(sort_keys(k_codes), q_codes, pos, None, None, block_size, None)
    width = (win.hi - win.lo).long()[0]  # [H, T, S]
    before = (pos // block_size * block_size).sum().item()  # keys before the rows' blocks, summed over rows
    codes = k_codes[0]  # [H, N, T]
    largest = [max(int(torch.bincount(codes[h, :, t]).max()) for t in range(tables)) for h in range(codes.shape[0])]
    stats = []
    for h in range(width.shape[0]):
        w = width[h].flatten().double()
        fraction = w.sum().item() / (tables * before)
        stats.append(
            dict(
                layer=layer,
                head=h,
                slot_fraction=fraction,
                skew=fraction * (1 << bits),
                window_p50=w.quantile(0.5).item(),
                window_p99=w.quantile(0.99).item(),
                window_max=w.max().item(),
                largest_bucket_share=largest[h] / n,
                over_cap={str(c): (w > c).double().mean().item() for c in caps},
            )
        )
    return stats


def agreement(q: Tensor, k: Tensor, layer: int, per_block: int, config: PatternConfig, caps: list[int]) -> list:
    """Per query head: the share of the dense scorer's columns that the sorted one keeps, at each cap."""
    lines = estimate_pattern(q, k, config, layer_idx=layer)
    n, scale = k.shape[1], q.shape[-1] ** -0.5
    kw = dict(tables=config.column_tables, bits=config.column_bits, seed=layer, backend="torch")

    def chosen(scorer: str, cap: int | None) -> Tensor:  # [B, H, blocks, N + 1] one-hot
        cols = select_block_columns(q, k, lines, per_block, scale, scorer=scorer, cap=cap, **kw)
        return torch.zeros(*cols.shape[:-1], n + 1).scatter_(-1, cols.long(), 1.0)[..., :n]

    dense = chosen("dense", None)
    kept = {}
    for cap in [None, *caps]:
        both = (chosen("sorted", cap) * dense).sum((0, 2, 3)) / dense.sum((0, 2, 3)).clamp(min=1)
        kept[f"kept_cap_{cap or 'none'}"] = both.tolist()
    return [{name: values[h] for name, values in kept.items()} for h in range(q.shape[2])]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a Hugging Face model folder (Q/K of its layers on --tokens)")
    p.add_argument("--tokens", type=Path, help="a token file of `mtraining corpus` (.npy)")
    p.add_argument("--offset", type=int, default=0, help="first token taken from --tokens")
    p.add_argument("--layers", type=int, nargs="+", default=[0])
    p.add_argument("--synthetic", choices=["structured", "random"], help="bench.synthetic inputs instead of a model")
    p.add_argument("--heads-q", type=int, default=16)
    p.add_argument("--heads-kv", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--bits", type=int, default=8)
    p.add_argument("--caps", type=int, nargs="*", default=[256, 1024, 4096])
    p.add_argument("--agreement", type=int, default=0, help="columns per block to compare the scorers at (0: no)")
    p.add_argument("--v-size", type=int, default=1024)
    p.add_argument("--s-size", type=int, default=2048)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if (args.model is None) == (args.synthetic is None):
        raise SystemExit("give either --model (with --tokens) or --synthetic")
    if args.model is not None:
        if args.tokens is None:
            raise SystemExit("--model needs --tokens (a .npy token file)")
        ids = np.load(args.tokens, mmap_mode="r")[args.offset : args.offset + args.seq_len]
        if ids.shape[0] < args.seq_len:
            raise SystemExit(f"{args.tokens} holds fewer than {args.seq_len} tokens from offset {args.offset}")
        qk = model_qk(args.model, torch.from_numpy(ids.astype(np.int64)), args.layers)
        source = dict(model=str(args.model), tokens=str(args.tokens), offset=args.offset)
    else:
        from bench.synthetic import random_qkv, rope_structured_qkv

        make = rope_structured_qkv if args.synthetic == "structured" else random_qkv
        q, k, _ = make(1, args.seq_len, args.heads_q, args.heads_kv, args.head_dim, dtype=torch.float32, seed=0)
        qk = {layer: (q, k) for layer in args.layers}
        source = dict(synthetic=args.synthetic)
    records = []
    config = PatternConfig(
        v_size=args.v_size,
        s_size=args.s_size,
        block_size=args.block_size,
        column_tables=args.tables,
        column_bits=args.bits,
    )
    for layer, (q, k) in sorted(qk.items()):
        stats = window_stats(q, k, layer, args.block_size, args.tables, args.bits, args.caps)
        if args.agreement:
            stats = [dict(r, **a) for r, a in zip(stats, agreement(q, k, layer, args.agreement, config, args.caps))]
        records += stats
        worst = max(r["skew"] for r in records if r["layer"] == layer)
        print(f"layer {layer:>3}: skew mean {np.mean([r['skew'] for r in records if r['layer'] == layer]):.2f} "
              f"max {worst:.2f}", flush=True)  # fmt: skip
    base = dict(
        **provenance(on_gpu=False),
        **source,
        seq_len=args.seq_len,
        block_size=args.block_size,
        tables=args.tables,
        bits=args.bits,
        agreement_per_block=args.agreement or None,
        v_size=args.v_size if args.agreement else None,
        s_size=args.s_size if args.agreement else None,
        heads_q=q.shape[2],
        heads_kv=k.shape[2],
        head_dim=q.shape[3],
    )
    path = write_results("column_candidates", [dict(base, **r) for r in records], args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Would columns chosen per query block bring back the questions that the last rows' pattern misses? CPU, inference.

The vertical-slash pattern keeps one set of vertical columns per head, chosen by the last ``last_q`` rows: a
question asked ``--tail`` tokens before the end keeps its evidence only if those rows attend to it too
(query_position.py: v30 retrieval 99% -> 44%). This tries the remedy that DESIGN names, on the same
documents and model: each block of ``BLOCK`` query rows also keeps ``k`` columns of its own, ranked by one of
(score work per head: S = length, D = head dim)

- ``pooled``: the block's mean query against every key (S^2 D / BLOCK);
- ``keyblocks``: each row against each key block's mean key, softmax, summed over the block's rows: whole key
  blocks (S^2 D / BLOCK);
- ``bounds``: the same with each key block's upper bound of the row's score (per dimension the larger of
  q x max k and q x min k, as Quest bounds a page of keys) (2 S^2 D / BLOCK);
- ``keyblocksmax``, ``boundsmax``: the same two with the largest of the rows' probabilities in place of their
  sum, so that one confident row counts as much as a diffuse block;
- ``rows4``: the dense softmax of every 4th row, summed (S^2 D / 4);
- ``lshTxB`` (``lsh``: 8x6): only the pairs whose query and key share a bucket in any of T random-hyperplane
  sign hashes of B bits, each scored against the mass the pattern keeps in its row (exp(score - the row's LSE over the
  pattern)), summed: for random vectors S^2 T / 2^B pairs (8x6: S^2 D / 8), found by sorting the codes; the
  result records the share of causal pairs that were candidates;
- ``exact``: the dense softmax of every row, summed: an upper bound on what any per-block choice finds (S^2 D).

Columns the pattern already keeps at the block's last row are not picked again. Attention with the extra
columns runs as a float32 masked softmax over the pattern's pairs plus the block's columns (a reference, not a
kernel: small sizes only); density counts every kept causal pair.

Internal tool: it stands in for ``mtraining.models.attention``'s sparse call and hashes with
``mtraining.ops.estimate.hashing``, so a change to either may need a change here.

    python -m experiments.extension.local_verticals --work runs/extension_cpu --docs 50   # bench/results/extension_cpu_local_verticals.json
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from bench.common import RESULTS_DIR, provenance
from mtraining.models import attention as attention_module
from mtraining.ops.estimate.hashing import bucket_mates, hash_codes, hash_planes
from mtraining.ops.pattern import VerticalSlashPattern

from ..common.stages import write_json
from . import query_position, report
from .settings import SCALES

BLOCK = 64  # query rows per block that share their own columns (and keys per key block)
BLOCK_METHODS = ("keyblocks", "bounds", "keyblocksmax", "boundsmax")  # the choices that score whole key blocks
HOW = ("pooled", *BLOCK_METHODS, "rows4", "exact")  # and lshTxB (module docstring)


def _by_block(x: Tensor, fill: float = 0.0) -> Tensor:
    """x [B, H, S, ...] as [B, H, nb, BLOCK, ...]: dim 2 cut into blocks of BLOCK, the last padded with ``fill``."""
    s = x.shape[2]
    pad = math.ceil(s / BLOCK) * BLOCK - s
    padded = torch.cat([x, x.new_full((*x.shape[:2], pad, *x.shape[3:]), fill)], dim=2)
    return padded.view(*x.shape[:2], -1, BLOCK, *x.shape[3:])


def _block_means(x: Tensor) -> Tensor:
    """The mean of each block of rows of x [B, H, S, D]: [B, H, nb, D] (the last block over its real rows)."""
    counts = _by_block(torch.ones(1, 1, x.shape[2])).sum(3)[0, 0]  # [nb]
    return _by_block(x).sum(3) / counts[:, None]


def block_columns(
    q: Tensor, k: Tensor, kept: Tensor, scale: float, per_block: int, how: str, mates: Tensor | None = None
) -> Tensor:
    """Boolean [B, H, S, S]: ``per_block`` extra columns for every block of ``BLOCK`` rows, causal.

    q [B, S, H, D], k [B, S, H, D] (K/V heads already repeated to the query heads); ``kept`` [B, H, S, S] the
    pattern's pairs. Each block ranks the keys before its first row that the pattern does not keep at its last
    row, as ``how`` says (module docstring); lsh methods take their bucket mates ([B, H, S, S], ``same_bucket``)
    from ``mates`` when the caller has them.
    """
    b, s, h, _ = q.shape
    nb = math.ceil(s / BLOCK)
    qh, kh = q.float().transpose(1, 2), k.float().transpose(1, 2)  # [B, H, S, D]
    pos = torch.arange(s)
    block_start = torch.arange(nb) * BLOCK  # [nb]
    block_last = (block_start + BLOCK - 1).clamp(max=s - 1)
    before = pos[None, :] < block_start[:, None]  # [nb, S] keys strictly before the block
    if how == "pooled":
        score = _block_means(qh) @ kh.transpose(-1, -2) * scale  # [B, H, nb, S]
    elif how.removesuffix("max") in ("keyblocks", "bounds"):
        if how.startswith("keyblocks"):  # the mean key of each key block
            logits = qh @ _block_means(kh).transpose(-1, -2) * scale  # [B, H, S, nb]
        else:  # an upper bound of each row's best score in the key block: per dimension the larger of q*max, q*min
            k_max = _by_block(kh, float("-inf")).amax(3)  # [B, H, nb, D]
            k_min = _by_block(kh, float("inf")).amin(3)
            upper = torch.maximum(qh[:, :, :, None, :] * k_max[:, :, None], qh[:, :, :, None, :] * k_min[:, :, None])
            logits = upper.sum(-1) * scale  # [B, H, S, nb]
        logits = logits.masked_fill(torch.arange(nb)[None, :] >= (pos // BLOCK)[:, None], float("-inf"))
        probs = logits.softmax(-1).nan_to_num(0.0)  # the first block's rows have no key block before them
        per_row = _by_block(probs)  # [B, H, nb, BLOCK, nb]
        block_score = per_row.amax(3) if how.endswith("max") else per_row.sum(3)
        score = block_score.repeat_interleave(BLOCK, dim=-1)[..., :s]  # [B, H, nb, S]
    elif how in ("exact", "rows4") or how.startswith("lsh"):
        logits = qh @ kh.transpose(-1, -2) * scale  # [B, H, S, S]
        logits = logits.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        if how.startswith("lsh"):  # only the pairs that share a hash bucket, against the mass the pattern keeps
            if mates is None:
                mates = same_bucket(qh, kh, *lsh_shape(how))
            pattern_lse = logits.masked_fill(~kept, float("-inf")).logsumexp(-1, keepdim=True)
            probs = (logits - pattern_lse).exp() * mates
        else:
            probs = logits.softmax(-1)
        if how == "rows4":
            probs = probs * (pos % 4 == 3)[:, None]
        score = _by_block(probs).sum(3)  # [B, H, nb, S]
        if how.startswith("lsh"):  # a key no row of the block met is no candidate
            score = score.masked_fill(score == 0, float("-inf"))
    else:
        raise ValueError(f"how must be one of {', '.join(HOW)}, got {how!r}")
    taken = kept[:, :, block_last, :]  # [B, H, nb, S]: the pattern's columns at each block's last row
    score = score.masked_fill(~before | taken, float("-inf"))
    top = score.topk(min(per_block, s), dim=-1)
    chosen = torch.zeros(b, h, nb, s, dtype=torch.bool).scatter_(-1, top.indices, top.values > float("-inf"))
    rows = chosen.repeat_interleave(BLOCK, dim=2)[:, :, :s]  # [B, H, S, S]
    return rows & (pos[None, :] <= pos[:, None])


def lsh_shape(how: str) -> tuple[int, int]:
    """(tables, bits) of an ``lshTxB`` method name (``lsh``: 8 tables of 6 bits)."""
    match = re.fullmatch(r"lsh(?:(\d+)x(\d+))?", how)
    if match is None:
        raise ValueError(f"an lsh method is lsh or lshTxB (T tables of B bits), got {how!r}")
    return (int(match[1]), int(match[2])) if match[1] else (8, 6)


def same_bucket(q: Tensor, k: Tensor, tables: int = 8, bits: int = 6, seed: int = 0) -> Tensor:
    """Boolean [B, H, S, S]: does row i's query share a bucket with key j in any of ``tables`` sign hashes of
    ``bits`` random hyperplanes (per head; the library's, mtraining/ops/estimate/block_columns.py)? q, k [B, H, S, D]."""
    planes = hash_planes(q.shape[1], q.shape[-1], tables, bits, seed)
    return bucket_mates(hash_codes(q, planes, bits), hash_codes(k, planes, bits))


def masked_attention(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Float32 softmax attention over the pairs ``keep`` [B, H, S, S]: out [B, S, H, D] in q's dtype, lse [B, H, S]."""
    logits = q.float().transpose(1, 2) @ k.float().transpose(1, 2).transpose(-1, -2) * scale
    logits = logits.masked_fill(~keep, float("-inf"))
    lse = logits.logsumexp(-1)
    out = (logits - lse[..., None]).exp() @ v.float().transpose(1, 2)
    return out.transpose(1, 2).to(q.dtype), lse


class LocalColumns:
    """A stand-in for ``sparse_attention`` in mtraining.models.attention: the pattern plus per-block columns."""

    def __init__(self, per_block: int, how: str, original: Callable) -> None:
        self.per_block, self.how, self.original = per_block, how, original
        self.kept_pairs = 0.0
        self.causal_pairs = 0.0
        self.candidate_pairs = 0.0  # lsh methods: causal pairs that shared a bucket

    def __call__(self, q, k, v, pattern: VerticalSlashPattern | None, softmax_scale=None, return_lse=False, **kw):
        if pattern is None:
            return self.original(q, k, v, pattern, softmax_scale=softmax_scale, return_lse=return_lse, **kw)
        documents = kw.get("documents")
        if (documents is not None and not documents.single) or kw.get("reuse") is not None:
            raise ValueError("local columns are measured on single documents at inference only")
        s, groups = q.shape[1], q.shape[2] // k.shape[2]
        scale = softmax_scale or q.shape[-1] ** -0.5
        k_full, v_full = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
        pos = torch.arange(s)
        keep = pattern.pair_mask(pos, pos)
        if self.per_block > 0:
            mates = None
            if self.how.startswith("lsh"):
                mates = same_bucket(q.float().transpose(1, 2), k_full.float().transpose(1, 2), *lsh_shape(self.how))
                self.candidate_pairs += float((mates & (pos[None, :] <= pos[:, None])).sum())
            keep = keep | block_columns(q, k_full, keep, scale, self.per_block, self.how, mates)
        self.kept_pairs += float(keep.sum())
        self.causal_pairs += keep.shape[0] * keep.shape[1] * s * (s + 1) / 2
        out, lse = masked_attention(q, k_full, v_full, keep, scale)
        return (out, lse) if return_lse else out

    @property
    def density(self) -> float:
        return self.kept_pairs / self.causal_pairs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--work", type=Path, required=True, help="the CPU scale's work folder of python -m experiments.extension"
    )
    p.add_argument("--model", default="dense", help="which extension reads (dense or sparse-<budget>)")
    p.add_argument("--docs", type=int, default=50)
    p.add_argument("--tail", type=int, default=256, help="filler tokens after the questions (> last_q)")
    p.add_argument("--per-block", default="0,16,64,128", help="extra columns per block of 64 query rows")
    p.add_argument("--how", default=",".join(HOW), help="how each block ranks keys (module docstring)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "extension_cpu_local_verticals.json")
    args = p.parse_args()
    scale = SCALES["cpu"]
    budget = scale.budget(scale.default_budget)
    try:
        export = query_position.exported(args.work, args.model)
        variants = query_position.held_out(scale, args.docs, args.tail, args.seed)
    except ValueError as err:
        p.error(str(err))
    # key-block methods take whole blocks: they run only where the count is a number of blocks
    settings = [("dense", 0, "")] + [
        (f"{budget.name}+{n}-{how}" if n else budget.name, n, how)
        for n in (int(x) for x in args.per_block.split(","))
        for how in (args.how.split(",") if n else [""])
        if how not in BLOCK_METHODS or n % BLOCK == 0
    ]
    for how in args.how.split(","):
        if how and how not in HOW:
            lsh_shape(how)  # a bad name fails before any evaluation
    original = attention_module.sparse_attention
    rows = {}
    try:
        for label, per_block, how in settings:
            for where, documents in variants.items():
                stand_in = LocalColumns(per_block, how or "pooled", original)
                attention_module.sparse_attention = stand_in
                row = query_position.score(export, scale, None if label == "dense" else budget, documents)
                row["density"] = None if label == "dense" else stand_in.density  # the pattern's and the block's pairs
                row["lsh_candidates"] = (
                    stand_in.candidate_pairs / stand_in.causal_pairs if how.startswith("lsh") else None
                )
                rows[f"{label}/{where}"] = row
                dens = "" if row["density"] is None else f", density {row['density']:.3f}"
                print(f"{label}/{where}: {row['retrieval']['percent']:.1f}%{dens} ({row['wall_s']:.0f}s)", flush=True)
    finally:
        attention_module.sparse_attention = original
    differences, ppl_changes = {}, {}
    for label, _, _ in settings[1:]:
        pairs = {where: (rows[f"{label}/{where}"], rows[f"dense/{where}"]) for where in variants}
        differences[label] = {w: report.difference(a["documents"], b["documents"]) for w, (a, b) in pairs.items()}
        ppl_changes[label] = {w: report.ppl_change(a["ppl"], b["ppl"]) for w, (a, b) in pairs.items()}
        print(
            f"{label}: last-bucket perplexity vs dense "
            + ", ".join(f"{w} {c['change_percent']:+.2f}%" for w, c in ppl_changes[label].items()),
            flush=True,
        )
    write_json(
        args.out,
        dict(
            name=args.out.stem,
            **provenance(on_gpu=False),
            model=args.model,
            length=scale.long,
            tail=args.tail,
            documents=args.docs,
            budget=budget.name,
            block=BLOCK,
            rows=rows,
            minus_dense=differences,
            ppl_vs_dense=ppl_changes,
        ),
    )


if __name__ == "__main__":
    main()

"""How dense must the vertical-slash pattern be for perplexity parity? Inference only, one extended model.

The sparse extensions of pipeline.py lose last-bucket perplexity at 8 L0 mostly through what
the pattern keeps at inference (the dense extension evaluated sparse loses as much). This scores one
extended model (default: the dense extension) at one length on the experiment's held-out recall
documents (the same documents for every setting), dense and with each setting of a sweep, and gives
last-bucket perplexity against dense (paired bootstrap interval), measured density and retrieval.
The settings separate two explanations of the gap: estimation (the lines are scored by the last
``last_q`` queries only, so more or all queries would close it) and structure (no vertical-slash
pattern of that density holds what the queries need, so only a denser one closes it). A reference
without lines (``TopK``: each query keeps its own highest-scoring keys, picked from the full scores)
says how sparse the attention itself is.

    python -m experiments.extension.density --scale cpu --work runs/extension_cpu --docs 100

Each setting's evaluation is cached in ``<work>/density/`` (a rerun scores only new settings).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path

from bench.common import RESULTS_DIR, provenance

from ..common.stages import Clock, write_json
from . import evaluation, report
from .settings import DENSER, SCALES, SWEEP, Budget, Scale


@dataclass(frozen=True)
class Setting:
    """A sparse budget and how many of the last queries estimate its lines (None: every query)."""

    name: str
    budget: Budget
    last_q: int | None = 64

    def estimating(self, scale: Scale, length: int) -> Scale:
        """``scale`` with this setting's estimation queries at ``length``."""
        return replace(scale, last_q=self.last_q or length)

    def pattern(self, scale: Scale, length: int) -> dict:
        """The PatternConfig fields of this setting at ``length``."""
        return self.budget.pattern(length, self.estimating(scale, length))


@dataclass(frozen=True)
class TopK:
    """The content-addressed reference: in the sparse layers each query keeps its own ``fraction`` of its
    causal keys, those with the highest scores (from the full score matrix: a bound, not a kernel)."""

    name: str
    fraction: float

    def pattern(self, scale: Scale, length: int) -> dict:
        return {"top_fraction": self.fraction}


_V30, _V50 = (next(b for b in SWEEP if b.name == name) for name in ("v30", "v50"))
_V35, _V45 = DENSER
_FULL = dict(v=1.0, s=1.0)  # caps at the whole length: a threshold alone decides
SETTINGS = (
    Setting("v30", _V30),  # the default budget, as the experiment runs it
    # estimation: the same budget, its lines scored by more queries
    Setting("v30-q256", _V30, 256),
    Setting("v30-qall", _V30, None),
    # structure: denser budgets, more verticals or more slashes
    Setting("v1/4", _V35),
    Setting("v1/2", Budget("v1/2", v=1 / 2, s=1 / 16)),
    Setting("v1/8-s1/4", _V45),
    Setting("v1/4-s1/4", Budget("v1/4-s1/4", v=1 / 4, s=1 / 4)),
    Setting("v1/2-s1/2", Budget("v1/2-s1/2", v=1 / 2, s=1 / 2)),
    # slashes first: v50 of the experiment's sweep, then more block diagonals
    Setting("v50", _V50),
    Setting("v1/32-s1/2", Budget("v1/32-s1/2", v=1 / 32, s=1 / 2)),
    Setting("v1/32-s3/4", Budget("v1/32-s3/4", v=1 / 32, s=3 / 4)),
    # threshold mode: the fewest lines holding this share of the estimated mass, uncapped
    Setting("t95", Budget("t95", threshold=0.95, **_FULL)),
    Setting("t99", Budget("t99", threshold=0.99, **_FULL)),
    Setting("t99-qall", Budget("t99", threshold=0.99, **_FULL), None),
    Setting("full", Budget("full", **_FULL)),  # every line: must equal dense
    TopK("top-0.25", 0.25),
    TopK("top-0.05", 0.05),
    TopK("top-0.02", 0.02),
    TopK("top-0.01", 0.01),
    TopK("top-1", 1.0),  # every key: must equal dense
)


def evaluate(export: Path, scale: Scale, setting: Setting | TopK | None, docs: list, length: int) -> dict:
    """Dense (``setting`` None) or sparse retrieval and per-bucket losses of ``docs`` at ``length``, timed.

    One process: the pattern is global, so the striped ring of pipeline.py computes the same
    pairs (its recorded losses of the same documents agree to rounding)."""
    with Clock() as clock:
        if isinstance(setting, TopK):
            result = evaluate_top(export, scale, setting.fraction, docs, length)
        else:
            budget = None if setting is None else setting.budget
            estimating = scale if setting is None else setting.estimating(scale, length)
            result = evaluation.evaluate_recall(str(export), estimating, budget, {length: docs})
    n = str(length)
    return dict(
        pattern=None if setting is None else setting.pattern(scale, length),
        density=result["density"][n],
        documents=result["tasks"]["recall"][n]["documents"],
        ppl=result["ppl"][n],
        wall_s=clock.wall_s,
        cpu_s=clock.cpu_s,
    )


def evaluate_top(export: Path, scale: Scale, fraction: float, docs: list, length: int) -> dict:
    """``evaluation.evaluate_recall``'s record for ``TopK``: the model run by Hugging Face with
    ``_TopScorer.attention`` (layer 0 dense, as ``evaluation.spec``) instead of an ``Engine``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from mtraining.eval.loading import load
    from mtraining.eval.retrieval import run_retrieval
    from mtraining.models import no_mask

    scorer = _TopScorer(load(str(export), device="cpu", dtype=scale.dtype).model, fraction)
    name = f"top_fraction_{fraction}"
    AttentionInterface.register(name, scorer.attention)
    AttentionMaskInterface.register(name, no_mask)
    scorer.model.config._attn_implementation = name
    result = run_retrieval(scorer, docs, scale.depths, scale.first_bucket, show_progress=False)
    n, record = str(length), evaluation.retrieval_record(result)
    return {
        "tasks": {"recall": {n: {k: record[k] for k in ("documents", "grid")}}},
        "ppl": {n: record["ppl"]},
        "density": {n: sum(scorer.kept) / len(scorer.kept)},
    }


class _TopScorer:
    """``Engine.token_scores`` for ``run_retrieval``, with each query of the sparse layers keeping its top keys."""

    def __init__(self, model, fraction: float) -> None:
        self.model, self.fraction = model, fraction
        self.kept: list[float] = []  # kept fraction of causal pairs, per sparse layer call

    def attention(self, module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0, **kwargs):
        """Hugging Face's attention signature: [B, H, S, D] in, ([B, S, H, D], None) out; causal, no mask."""
        import torch

        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        scores = (query @ key.transpose(-1, -2)) * scaling
        seq = scores.shape[-1]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        if module.layer_idx != 0:
            keep_per_row = torch.ceil(self.fraction * torch.arange(1, seq + 1, device=scores.device)).long()
            ranked = scores.sort(-1, descending=True).values
            least = ranked.gather(-1, (keep_per_row - 1).view(1, 1, seq, 1).expand(*scores.shape[:2], seq, 1))
            keep = causal & (scores >= least)  # ties at the cut are all kept
            self.kept.append(float(keep.sum() / (causal.sum() * scores.shape[0] * scores.shape[1])))
            scores = scores.masked_fill(~keep, float("-inf"))
        return (torch.softmax(scores, -1) @ value).transpose(1, 2).contiguous(), None

    def token_scores(self, ids):
        """float32 [L - 1] -log p(ids[i + 1] | ids[: i + 1]) and int64 [L - 1] the greedy predictions."""
        import torch

        ids = ids.long().flatten()
        with torch.no_grad():
            logits = self.model(input_ids=ids[None]).logits[0, :-1].float()
        return torch.nn.functional.cross_entropy(logits, ids[1:], reduction="none"), logits.argmax(-1)


def summarise(dense: dict, sparse: dict[str, dict]) -> list[dict]:
    """Per setting: density, last-bucket perplexity and its change against dense, retrieval and its difference."""
    rows = []
    for name, ev in {"dense": dense, **sparse}.items():
        row = dict(
            setting=name,
            pattern=ev["pattern"],
            density=ev["density"],
            ppl_last_bucket=report.ppl_curve(ev["ppl"])[-1]["ppl"],
            retrieval=report.accuracy(ev["documents"]),
            wall_s=ev["wall_s"],
            cpu_s=ev["cpu_s"],
        )
        if ev is not dense:
            row["ppl_vs_dense"] = report.ppl_change(ev["ppl"], dense["ppl"])
            row["retrieval_minus_dense"] = report.difference(ev["documents"], dense["documents"])
            row["within_ppl"] = row["ppl_vs_dense"]["change_percent"] <= report.PPL_PERCENT
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [s.name for s in SETTINGS]
    p.add_argument("--scale", choices=[n for n, s in SCALES.items() if s.task == "recall"], default="cpu")
    p.add_argument("--work", type=Path, required=True, help="the work folder of python -m experiments.extension")
    p.add_argument("--model", default="dense", help="the extension to score (a folder of <work>/extend)")
    p.add_argument("--length", type=int, default=None, help="default: the scale's longest (8 L0)")
    p.add_argument("--docs", type=int, default=100, help="the first this many held-out documents of that length")
    p.add_argument("--settings", default=",".join(names), help=f"comma-separated, of {names}")
    p.add_argument(
        "--seed", type=int, default=0, help="the --seed of python -m experiments.extension (its held-out documents)"
    )
    p.add_argument("--out", type=Path, default=None, help="default: bench/results/extension_<scale>_density.json")
    args = p.parse_args()
    scale = SCALES[args.scale]
    length = args.length or scale.long
    chosen = [n.strip() for n in args.settings.split(",") if n.strip()]
    if unknown := sorted(set(chosen) - set(names)):
        p.error(f"unknown settings {unknown}; use some of {names}")
    if length not in scale.lengths:
        p.error(f"--length must be one of the scale's evaluation lengths {scale.lengths}")
    export = args.work / "extend" / args.model / "export"
    if not (export / "model.safetensors").is_file():
        p.error(f"no exported model in {export}: run python -m experiments.extension --work {args.work} first")
    docs = evaluation.recall_documents(scale, args.seed)[length]
    if not 1 <= args.docs <= len(docs):
        p.error(f"--docs must be in 1..{len(docs)} (the scale's held-out documents)")
    docs = docs[: args.docs]
    cache = args.work / "density" / f"{args.model}-{length}-{args.docs}docs"
    evaluations = {}  # setting name -> evaluate()'s record
    for setting in [None, *(s for s in SETTINGS if s.name in chosen)]:
        name = "dense" if setting is None else setting.name
        path = cache / (name.replace("/", "") + ".json")
        wanted = None if setting is None else setting.pattern(scale, length)
        if not path.exists() or json.loads(path.read_text())["pattern"] != wanted:  # new, or its budget changed
            write_json(path, evaluate(export, scale, setting, docs, length))
        evaluations[name] = json.loads(path.read_text())
    rows = summarise(evaluations.pop("dense"), evaluations)
    for r in rows:
        change = r.get("ppl_vs_dense", {}).get("change_percent", 0.0)
        print(
            f"{r['setting']}: density {r['density'] or 1:.3f}, ppl {r['ppl_last_bucket']:.3f} ({change:+.2f}%), "
            f"retrieval {r['retrieval']['percent']:.1f}%, {r['wall_s']:.0f}s wall, {r['cpu_s']:.0f}s cpu"
        )
    result = dict(
        name=f"extension_{scale.name}_density",
        **provenance(on_gpu=False),
        model=args.model,
        length=length,
        documents=args.docs,
        rows=rows,
    )
    write_json(args.out or RESULTS_DIR / f"extension_{scale.name}_density.json", result)


if __name__ == "__main__":
    main()

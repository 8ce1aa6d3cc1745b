"""Does a sparse pattern estimated from a packed sample's last queries miss the other documents' needles?

The CPU scale's base of the context-extension experiment (pipeline.py; trained dense at L0 on
one recall document per sample, reused from ``--work`` when there) reads held-out samples of 8 L0
tokens that pack ``factor`` (8) associative-recall documents of L0 tokens each (recall_corpus
``eval_set``: queries at the end of each document), at the base's own RoPE base (each document is L0
long, where the base retrieves). Each answer is scored teacher-forced (the greedy prediction before it,
as ``mtraining.eval.retrieval``) per document position in the sample (1: first ... 8: last) under:

- dense_masked: dense attention with document masking (each document alone: the reference);
- dense_unmasked: dense without masking (each document also sees the earlier ones);
- sparse_unmasked: the budget's vertical-slash pattern (``Budget.pattern(8 L0, scale)``, layer 0 dense, as
  in training) without masking: estimated from the sample's last ``last_q`` queries, the last document's;
- sparse_masked: the same budget with masking: estimated from every document's last queries.
- sparse_masked_<b> (``--masked-budgets``): masked at sparser budgets. A budget is scaled to the sample's length,
  so with masking it keeps a far larger share of the pairs the attention computes (those within documents, 1/8
  of the causal pairs here): these give masked conditions near the unmasked one's density.

The sparse conditions also record the pattern's density (of the pairs the attention computes: within
documents when masked), its held-out recall (``models.recall.pattern_recall`` on ``last_q`` rows drawn at
random; per document's keys when masked) and, per document position, its *answer-row recall*: the attention
probability the pattern keeps on the rows that predict the answers (the rows that must reach the needles),
over the sparse layers and query heads, computed as ``pattern_recall`` computes a row's. One process, torch backend, the scale's dtype (float32 on
the CPU), no context parallelism. Writes ``packed_recall.json`` (``--out``) and prints a table.

    python -m experiments.extension.packed_recall                          # cpu scale: the base (~9 min) once, then ~8 min
    python -m experiments.extension.packed_recall --scale toy --work /tmp/w --out /tmp/o --samples 2
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from bench.common import RESULTS_DIR, provenance
from mtraining.eval.engine import Engine
from mtraining.models import Attention, kept_probability
from mtraining.ops import Documents

from . import evaluation, pipeline
from .recall_corpus import eval_set
from .report import accuracy, difference
from .settings import SCALES, Budget, Scale

CONDITIONS = {  # name: (sparse, document masking)
    "dense_masked": (False, True),
    "dense_unmasked": (False, False),
    "sparse_unmasked": (True, False),
    "sparse_masked": (True, True),
}
# paired differences per document position (same samples): what sparse attention costs, without and with masking
DIFFERENCES = {
    "sparse_unmasked - dense_unmasked": ("sparse_unmasked", "dense_unmasked"),
    "sparse_masked - dense_masked": ("sparse_masked", "dense_masked"),
}


@dataclass(frozen=True)
class Packed:
    """One sample: ``ids`` of its documents back to back, each document's ``length``, and per document the
    answer positions in the sample."""

    ids: list[int]
    lengths: list[int]
    answers: list[list[int]]


def packed_samples(scale: Scale, samples: int, seed: int) -> list[Packed]:
    """``samples`` samples of ``scale.factor`` held-out recall documents of L0 tokens each (8 L0 in all)."""
    per = scale.factor
    docs = eval_set(scale.vocab, scale.l0, samples * per, scale.eval_shape, scale.depths, seed)
    out = []
    for i in range(samples):
        group = docs[i * per : (i + 1) * per]
        starts = [j * scale.l0 for j in range(per)]
        out.append(
            Packed(
                ids=[t for d in group for t in d.ids],
                lengths=[len(d.ids) for d in group],
                answers=[[s + a for a in d.answers] for s, d in zip(starts, group)],
            )
        )
    assert all(len(p.ids) == scale.long for p in out)
    return out


@dataclass(eq=False)
class _Probe(Attention):
    """An ``Attention`` that also measures, per sparse layer, the attention probability its pattern keeps on the
    query ``rows`` (global positions, ascending), averaged over query heads, as ``pattern_recall`` computes it
    (keys from each row's document start when the forward has documents)."""

    rows: torch.Tensor | None = None
    kept: dict[int, torch.Tensor] = field(default_factory=dict)

    def _decide(self, config, layer, q, k, scale, now, documents):
        pattern = super()._decide(config, layer, q, k, scale, now, documents)
        if pattern is not None and self.rows is not None:
            kept = kept_probability(q.detach(), k.detach(), pattern, self.rows, scale, documents=documents)
            self.kept[layer] = kept[0].mean(0)
        return pattern


class ProbeEngine(Engine):
    """An ``Engine`` whose prefills also measure the pattern's recall on the rows in ``rows`` (set before each
    prefill): ``row_recall`` gets, per prefill, {sparse layer: kept probability per row}."""

    rows: torch.Tensor | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.row_recall: list[dict[int, torch.Tensor]] = []

    def _attention(self, seq_len: int) -> Attention:
        base = super()._attention(seq_len)
        probe = _Probe(**{f.name: getattr(base, f.name) for f in fields(Attention) if f.init}, rows=self.rows)
        self.row_recall.append(probe.kept)
        return probe


def base_export(scale: Scale, work: Path, seed: int) -> Path:
    """The scale's base (pipeline.py's corpus and curriculum), trained unless ``work`` has it."""
    data = pipeline.corpus(scale, work, seed)
    export, _ = pipeline.base_model(scale, work, data, seed)
    return export


def score(engine: ProbeEngine, samples: list[Packed], masked: bool) -> list[list[dict]]:
    """Per document position, per sample: {"hits", "answers"} (teacher-forced greedy answers, as
    ``mtraining.eval.retrieval``), each sample one prefill (``documents`` when ``masked``); sparse, also
    "answer_recall": the pattern's kept probability on the rows that predict the document's answers (mean over
    its answers, the query heads and the sparse layers)."""
    by_position: list[list[dict]] = [[] for _ in samples[0].lengths]
    for sample in samples:
        ids = torch.as_tensor(sample.ids)
        documents = Documents.from_lengths(sample.lengths) if masked else None
        engine.rows = torch.tensor(sorted(p - 1 for answers in sample.answers for p in answers))
        _, predicted = engine.token_scores(ids, documents)
        layers = list(engine.row_recall[-1].values()) if engine.row_recall else []
        kept = dict(zip(engine.rows.tolist(), torch.stack(layers).mean(0).tolist())) if layers else None
        for k, answers in enumerate(sample.answers):
            found = sum(int(predicted[p - 1]) == sample.ids[p] for p in answers)
            record = {"hits": found, "answers": len(answers)}
            if kept is not None:
                record["answer_recall"] = sum(kept[p - 1] for p in answers) / len(answers)
            by_position[k].append(record)
    return by_position


def condition(model, scale: Scale, budget: Budget, samples: list[Packed], sparse: bool, masked: bool) -> dict:
    """One condition's records and figures (accuracy per position and overall; density and recall when sparse)."""
    started, cpu = time.time(), time.process_time()
    engine = ProbeEngine(model, evaluation.spec(scale, budget if sparse else None, scale.long), None, record="recall")
    records = score(engine, samples, masked)
    return dict(
        attention="sparse" if sparse else "dense",
        document_masking=masked,
        by_position=[
            accuracy(docs) | {"position": k + 1, "answer_recall": _answer_recall(docs)}
            for k, docs in enumerate(records)
        ],
        overall=accuracy([d for docs in records for d in docs]),
        density=_mean(engine.densities),
        recall=_mean(engine.recalls),
        densities=engine.densities,
        recalls=engine.recalls,
        records=records,
        wall_s=round(time.time() - started, 1),
        cpu_s=round(time.process_time() - cpu, 1),
    )


def run(
    scale: Scale,
    work: Path,
    out: Path,
    samples: int,
    seed: int,
    budget_name: str | None = None,
    masked_budgets: tuple[str, ...] = (),
    model: Path | None = None,
) -> dict:
    """Every condition on the same packed samples (and, masked, at each of ``masked_budgets``); writes
    ``out/packed_recall.json`` (reading ``model``, an export with its own RoPE base, instead of the base:
    ``packed_recall_<its run folder>.json``) and returns it."""
    budget = scale.budget(budget_name or scale.default_budget)
    export = model if model is not None else base_export(scale, work, seed)
    result_name = "packed_recall" if model is None else f"packed_recall_{model.parent.name}"
    loaded = evaluation.load_export(str(export), scale)
    packed = packed_samples(scale, samples, seed)
    plan = {name: (budget, sparse, masked) for name, (sparse, masked) in CONDITIONS.items()}
    plan |= {f"sparse_masked_{b}": (scale.budget(b), True, True) for b in masked_budgets}
    conditions = {}
    for name, (b, sparse, masked) in plan.items():
        conditions[name] = condition(loaded.model, scale, b, packed, sparse, masked)
        conditions[name]["budget"] = b.name if sparse else None
        conditions[name]["pattern"] = b.pattern(scale.long, scale) if sparse else None
        pipeline.say(f"{name}: {_row(conditions[name])}")
    differences = {
        name: [difference(conditions[a]["records"][k], conditions[b]["records"][k]) for k in range(scale.factor)]
        for name, (a, b) in DIFFERENCES.items()
    }
    result = dict(
        name=result_name,
        **provenance(on_gpu=scale.device == "cuda"),
        scale=scale.name,
        model=str(export),
        rope_theta=loaded.model.config.rope_parameters["rope_theta"],  # the model's own (the base's: documents are L0)
        sample_length=scale.long,
        document_length=scale.l0,
        documents_per_sample=scale.factor,
        samples=samples,
        queries_per_document=len(scale.depths),
        depths=list(scale.depths),
        budget=asdict(budget),
        pattern=budget.pattern(scale.long, scale),
        dense_layers=[0],
        backend=scale.backend,
        dtype=scale.dtype,
        processes=1,
        context_parallel=False,
        conditions=conditions,
        differences=differences,
        wall_s=round(sum(c["wall_s"] for c in conditions.values()), 1),
        cpu_s=round(sum(c["cpu_s"] for c in conditions.values()), 1),
    )
    pipeline.write_json(out / f"{result_name}.json", result)
    print(table(result))
    return result


def table(result: dict) -> str:
    """Markdown table: % found per document position (1: first), overall with its 95% interval, density, recall;
    then the sparse conditions' answer-row recall per document position."""
    k = result["documents_per_sample"]
    head = ["condition", *[f"doc {i + 1}" for i in range(k)], "all [95% CI]", "density", "recall"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, c in result["conditions"].items():
        lines.append(f"| {name} | {_row(c)} |")
    for name, c in result["conditions"].items():
        if c["attention"] == "sparse":
            cells = [f"{p['answer_recall']:.3f}" for p in c["by_position"]]
            lines.append(f"| {name}: answer-row recall | {' | '.join(cells)} | | | |")
    return "\n".join(lines)


def _row(c: dict) -> str:
    low, high = c["overall"]["interval"]
    cells = [f"{p['percent']:.0f}" for p in c["by_position"]]
    cells.append(f"{c['overall']['percent']:.1f} [{low:.1f}, {high:.1f}]")
    cells += [f"{c[key]:.3f}" if c[key] is not None else "-" for key in ("density", "recall")]
    return " | ".join(cells)


def _answer_recall(docs: list[dict]) -> float | None:
    """Mean of the documents' answer-row recall (None for dense attention)."""
    return _mean([d["answer_recall"] for d in docs if "answer_recall" in d])


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", choices=[n for n, s in SCALES.items() if s.task == "recall"], default="cpu")
    p.add_argument("--work", type=Path, default=None, help="the base's folder (default: runs/extension_<scale>)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--samples", type=int, default=40, help="packed samples (each: factor documents x their queries)")
    p.add_argument("--budget", default=None, help="sparse budget (default: the scale's default)")
    p.add_argument("--masked-budgets", default="", help="also masked at these budgets, e.g. v3,v10")
    p.add_argument(
        "--model", type=Path, default=None, help="read this export (e.g. an extension's) instead of the base"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    scale = SCALES[args.scale]
    work = (args.work or pipeline.ROOT / "runs" / f"extension_{scale.name}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    masked = tuple(b.strip() for b in args.masked_budgets.split(",") if b.strip())
    model = args.model.resolve() if args.model is not None else None
    run(scale, work, args.out, args.samples, args.seed, args.budget, masked, model)


if __name__ == "__main__":
    main()

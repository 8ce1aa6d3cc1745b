"""Where a sparse extension's training-loss gap sits: answer tokens or the rest.

The training loss of pipeline.py is the mean cross-entropy over every token of the training
documents (filler, needles, queries), under the run's own attention. A sparse run can lose there
without losing retrieval. This scores held-out documents of the extension's training shape
(recall task; seeds disjoint from training and evaluation) teacher-forced with each extended model,
in dense and in its own sparse attention, and splits the mean NLL by token kind: the retrieval
answers (the value after ``Q key``), the queried keys (a random pick among the needles), and the
rest (filler, needles, ``Q``).

    python -m experiments.extension.losses --scale cpu --work runs/extension_cpu --docs 20
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.common import RESULTS_DIR, provenance

from ..common.stages import write_json
from .evaluation import spec
from .recall_corpus import make_document
from .settings import SCALES, Budget, Scale

KINDS = ("answer", "queried key", "rest")


def losses(export: Path, scale: Scale, budget: Budget | None, documents: list) -> dict:
    """Mean NLL per token kind (and over all tokens) of ``documents`` with ``budget``'s attention (None: dense)."""
    import torch

    from mtraining.eval.engine import Engine
    from mtraining.eval.loading import load

    loaded = load(str(export), device="cpu", dtype=scale.dtype)
    engine = Engine(loaded.model, spec(scale, budget, scale.long), None)
    sums, counts = dict.fromkeys(KINDS, 0.0), dict.fromkeys(KINDS, 0)
    for doc in documents:
        nll, _ = engine.token_scores(torch.as_tensor(doc.ids))
        kind = ["rest"] * nll.numel()  # prediction i is of token i + 1
        for p in doc.answers:
            kind[p - 1], kind[p - 2] = "answer", "queried key"
        for k, x in zip(kind, nll.tolist()):
            sums[k] += x
            counts[k] += 1
    out = {k: {"nll": sums[k] / counts[k], "tokens": counts[k]} for k in KINDS}
    out["all"] = {"nll": sum(sums.values()) / sum(counts.values()), "tokens": sum(counts.values())}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", choices=[n for n, s in SCALES.items() if s.task == "recall"], default="cpu")
    p.add_argument("--work", type=Path, required=True, help="the work folder of python -m experiments.extension")
    p.add_argument("--docs", type=int, default=20)
    p.add_argument("--out", type=Path, default=None, help="default: bench/results/extension_<scale>_losses.json")
    args = p.parse_args()
    scale = SCALES[args.scale]
    shape = scale.extension
    docs = [make_document(f"losses-{i}", scale.long, scale.vocab, shape.pairs, shape.pairs) for i in range(args.docs)]
    runs = {}
    for budget in (None, *scale.budgets):
        model = "dense" if budget is None else f"sparse-{budget.name}"
        export = args.work / "extend" / model / "export"
        for label, attention in ((f"{model}/dense", None), (f"{model}/{model}", budget)):
            if label not in runs:
                runs[label] = losses(export, scale, attention, docs)
                print(label, {k: round(v["nll"], 3) for k, v in runs[label].items()}, flush=True)
    result = dict(
        name=f"extension_{scale.name}_losses",
        **provenance(on_gpu=False),
        documents=args.docs,
        length=scale.long,
        shape={"pairs": shape.pairs, "queries": shape.pairs},
        losses=runs,
    )
    write_json(args.out or RESULTS_DIR / f"extension_{scale.name}_losses.json", result)


if __name__ == "__main__":
    main()

"""Evaluate one model of the context-extension experiment at every length, with dense or sparse attention.

Through ``mtraining.eval``: the model is loaded with ``loading.load`` and run by an ``Engine`` per
length (dense, or dynamic sparse with the budget scaled to that length, layer 0 dense as in
training; on several gloo ranks through the striped ring when the scale has them).

- recall task: held-out associative-recall documents scored teacher-forced (``run_retrieval``);
  the same pass gives each document's loss per position bucket (perplexity by position);
- text task: ``run_niah`` (depth x length grid), ``run_ruler`` (every task) and perplexity of
  held-out documents (``run_ppl``, one document at a time so documents can be paired).

The result of every task at every length is a list of per-document records ``{"hits", "answers"}``
in a fixed order (the same documents for every model), so the report can pair two models.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path

from extension_corpus import eval_set
from extension_report import accuracy
from extension_settings import Budget, Scale


def spec(scale: Scale, budget: Budget | None, length: int):
    """The AttentionSpec of ``length``: dense, or sparse at the budget scaled to it (layer 0 dense)."""
    from mtraining.eval.engine import AttentionSpec

    return AttentionSpec(
        sparse=budget is not None,
        layout="striped",
        block_size=scale.block_size,
        backend=scale.backend,
        pattern=budget.pattern(length, scale) if budget is not None else {},
        prefill_granule=scale.block_size,  # generation: the whole prompt but its last partial block is prefilled
        dense_layers=(0,),
    )


def recall_documents(scale: Scale, seed: int) -> dict[int, list]:
    """(ids, answer positions, depths) of the held-out recall documents at each length."""
    return {
        n: [
            (d.ids, d.answers, d.depths)
            for d in eval_set(scale.vocab, n, scale.eval_docs, scale.eval_shape, scale.depths, seed)
        ]
        for n in scale.lengths
    }


def evaluate_recall(export: str, scale: Scale, budget: Budget | None, documents: dict[int, list]) -> dict:
    """On every rank of a gloo group (or alone): retrieval and per-bucket losses at each length."""
    import torch.distributed as dist

    from mtraining.eval.engine import Engine
    from mtraining.eval.retrieval import run_retrieval

    loaded = load_export(export, scale)
    group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
    out = {"tasks": {"recall": {}}, "ppl": {}, "density": {}}
    for n, docs in documents.items():
        engine = Engine(loaded.model, spec(scale, budget, n), group)
        record = retrieval_record(run_retrieval(engine, docs, scale.depths, scale.first_bucket, show_progress=False))
        out["tasks"]["recall"][str(n)] = {k: record[k] for k in ("documents", "grid")}
        out["ppl"][str(n)] = record["ppl"]
        out["density"][str(n)] = _mean(engine.densities)
    return out


def retrieval_record(result: dict) -> dict:
    """The parts of ``run_retrieval``'s result that the experiment keeps for one length: per-document hits
    (``documents``), the depth grid and per-document bucket losses (``ppl``), in the report's format."""
    return {
        "documents": [{"hits": d["hits"], "answers": d["answers"]} for d in result["documents"]],
        "grid": {"depths": result["depths"], "scores": [row[0] for row in result["scores"]]},
        "ppl": [{"buckets": d["buckets"], "nll": d["nll"]} for d in result["documents"]],
    }


def evaluate_text(export: str, scale: Scale, budget: Budget | None, heldout: Path, seed: int) -> dict:
    """NIAH grid, RULER-style tasks and per-document perplexity at each length (one process)."""
    from mtraining.eval.answers import Prompting
    from mtraining.eval.documents import load_documents
    from mtraining.eval.engine import Engine
    from mtraining.eval.ppl import run_ppl
    from mtraining.eval.ruler import run_ruler

    loaded = load_export(export, scale)
    tok = loaded.tokenizer
    docs = load_documents([heldout])
    cache = _prompt_cache(export)
    out = {"tasks": {"niah": {}, "ruler": {}}, "ppl": {}, "density": {}}
    for n in scale.lengths:
        engine = Engine(loaded.model, spec(scale, budget, n), None)
        niah = _niah(engine, tok, scale, n, scale.niah_samples, seed, cache)
        out["tasks"]["niah"][str(n)] = {k: niah[k] for k in ("documents", "grid")}
        prompting = Prompting(samples=scale.ruler_samples, seed=seed, show_progress=False, cache=cache)
        ruler = run_ruler(engine, tok, scale.ruler_tasks, [n], prompting)
        out["tasks"]["ruler"][str(n)] = {
            "documents": [{"hits": r["score"], "answers": 1} for r in ruler["records"]],
            "by_task": {t: v[0] for t, v in ruler["scores"].items()},
        }
        out["ppl"][str(n)] = []
        for doc in docs:
            (row,) = run_ppl(engine, tok, [doc], [n], 1, scale.first_bucket, show_progress=False)
            out["ppl"][str(n)].append(
                {
                    "buckets": [[b["start"], b["end"]] for b in row["buckets"]],
                    "nll": [b["nll"] * b["tokens"] for b in row["buckets"]],
                }
            )
        out["density"][str(n)] = _mean(engine.densities)
    return out


def check_base(export: str, scale: Scale, seed: int) -> dict:
    """The base's retrieval at L0 with dense attention on ``scale.base_check`` held-out prompts (recall: documents)
    of its first task, in one process: {"task", "documents" (the records of ``evaluate_*`` for that cell),
    "accuracy" (``extension_report.accuracy``), and for NIAH "examples" (answers and what was generated)}."""
    from mtraining.eval.engine import Engine

    if scale.task == "recall":
        docs = {scale.l0: recall_documents(scale, seed)[scale.l0][: scale.base_check]}
        found = evaluate_recall(export, scale, None, docs)["tasks"]["recall"][str(scale.l0)]["documents"]
        return {"task": "recall", "documents": found, "accuracy": accuracy(found)}
    loaded = load_export(export, scale)
    engine = Engine(loaded.model, spec(scale, None, scale.l0), None)
    samples = -(-scale.base_check // len(scale.depths))  # per depth, rounded up
    cell = _niah(engine, loaded.tokenizer, scale, scale.l0, samples, seed, _prompt_cache(export))
    found = cell["documents"]
    return {"task": "niah", "documents": found, "accuracy": accuracy(found), "examples": cell["examples"]}


def _niah(engine, tokenizer, scale: Scale, length: int, samples: int, seed: int, cache: dict) -> dict:
    """NIAH at ``length``, ``samples`` prompts per depth: per-prompt records and the depth grid."""
    from mtraining.eval.answers import Prompting
    from mtraining.eval.niah import run_niah

    prompting = Prompting(samples=samples, seed=seed, show_progress=False, cache=cache)
    niah = run_niah(engine, tokenizer, [length], [100 * d for d in scale.depths], prompting)
    return {
        "documents": [{"hits": r["score"], "answers": 1} for r in niah["records"]],
        "grid": {"depths": scale.depths, "scores": [row[0] for row in niah["scores"]]},
        "examples": [{"answers": r["answers"], "prediction": r["prediction"]} for r in niah["records"][:5]],
    }


def _prompt_cache(export: str) -> dict:
    """Prompts built once per process: every model of the experiment has the corpus' tokenizer."""
    return _PROMPTS.setdefault(hashlib.sha256((Path(export) / "tokenizer.json").read_bytes()).hexdigest(), {})


_PROMPTS: dict[str, dict] = {}  # tokenizer.json's SHA-256 -> Prompting.cache


def load_prompts(path: Path) -> None:
    """Prompts an earlier process of this run built (``save_prompts``): a resumed run does not build them again
    (a minute and more at 32K)."""
    if path.exists():
        for tokenizer, built in pickle.loads(path.read_bytes()).items():
            _PROMPTS.setdefault(tokenizer, {}).update(built)


def save_prompts(path: Path) -> None:
    """Every prompt built in this process so far, for ``load_prompts`` (written whole, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(".part")
    part.write_bytes(pickle.dumps(_PROMPTS))
    os.replace(part, path)


def load_export(export: str, scale: Scale):
    """``mtraining.eval.loading.load`` of an export on the scale's device (CUDA or the CPU) in its dtype."""
    from mtraining.eval.loading import load

    return load(export, device="cuda" if scale.device == "cuda" else "cpu", dtype=scale.dtype)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None

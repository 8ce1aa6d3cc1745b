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

import functools
import hashlib
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from bench.common import written

from .recall_corpus import eval_set
from .report import accuracy
from .settings import Budget, Scale

if TYPE_CHECKING:
    from ..common.background import Pool


def spec(scale: Scale, budget: Budget | None, length: int):
    """The AttentionSpec of ``length``: dense, or sparse at the budget scaled to it (layer 0 dense)."""
    from mtraining.eval.engine import AttentionSpec

    return AttentionSpec(
        sparse=budget is not None,
        layout="striped",
        block_size=scale.block_size,
        backend=scale.backend,
        pattern=budget.pattern(length, scale) if budget is not None else {},
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
            "documents": [prompt_record(r) for r in ruler["records"]],
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
    "accuracy" (``report.accuracy``), and for NIAH "examples" (answers and what was generated)}."""
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
        "documents": [prompt_record(r) for r in niah["records"]],
        "grid": {"depths": scale.depths, "scores": [row[0] for row in niah["scores"]]},
        "examples": [{"answers": r["answers"], "prediction": r["prediction"]} for r in niah["records"][:5]],
    }


def prompt_record(record: dict) -> dict:
    """What the report keeps of one NIAH or RULER prompt: its score as hits of one answer (the statistics' unit),
    and for reading failures later its cell (depth or task), the expected answers and the model's prediction."""
    cell = {k: record[k] for k in ("depth", "task") if k in record}
    return {
        "hits": record["score"],
        "answers": 1,
        **cell,
        "expected": record["answers"],
        "prediction": record["prediction"],
    }


def _prompt_cache(export: str) -> dict:
    """Prompts built once per process: every model of the experiment has the corpus' tokenizer. Prompts being
    built in the background (``expect_prompts``) are waited for first."""
    while _COMING:
        _merge(_COMING.pop(0)())
    return _PROMPTS.setdefault(_fingerprint(Path(export) / "tokenizer.json"), {})


_PROMPTS: dict[str, dict] = {}  # tokenizer.json's SHA-256 -> Prompting.cache
_COMING: list[Callable[[], dict]] = []  # waits for prompts being built in the background (``build_prompts``)


def _fingerprint(tokenizer: Path) -> str:
    return hashlib.sha256(tokenizer.read_bytes()).hexdigest()


def _merge(prompts: dict[str, dict]) -> None:
    for tokenizer, built in prompts.items():
        _PROMPTS.setdefault(tokenizer, {}).update(built)


def load_prompts(path: Path) -> None:
    """Prompts an earlier process of this run built (``save_prompts``): a resumed run does not build them again
    (a minute and more at 32K)."""
    if path.exists():
        _merge(pickle.loads(path.read_bytes()))


def expect_prompts(wait: Callable[[], dict]) -> None:
    """Prompts being built elsewhere: the first evaluation calls ``wait`` (``build_prompts``'s result) and uses them."""
    _COMING.append(wait)


def save_prompts(path: Path) -> None:
    """Every prompt built in this process so far and those already in ``path``, for ``load_prompts`` (written
    whole, then renamed)."""
    load_prompts(path)  # the background's, if this process has not waited for them
    with written(path) as tmp:
        tmp.write_bytes(pickle.dumps(_PROMPTS))


NIAH_TITLE = "needle in a haystack"  # run_niah's title, the first field of its cache keys


def evaluation_prompts(scale: Scale, seed: int) -> list[tuple]:
    """The cache keys of every prompt the text task's evaluations at ``scale.lengths`` ask for (the base checks ask
    for some of them), as ``mtraining.eval.answers.score_samples`` keys them for ``_niah`` and ``run_ruler``:
    (title, the cell's values, the seed)."""
    niah = [
        (NIAH_TITLE, n, 100 * d, s)
        for n in scale.lengths
        for d in scale.depths
        for s in range(seed, seed + scale.niah_samples)
    ]
    ruler = [
        ("ruler", t, n, s)
        for t in scale.ruler_tasks
        for n in scale.lengths
        for s in range(seed, seed + scale.ruler_samples)
    ]
    return niah + ruler


def build_prompts(path: Path, scale: Scale, seed: int, pool: Pool | None, tokenizer: Path) -> dict[str, dict]:
    """The samples of ``evaluation_prompts`` that ``path`` lacks, built on ``pool``'s workers (None: here) and added
    to ``path``; returns them as ``_PROMPTS`` holds them (for ``expect_prompts``)."""
    fingerprint = _fingerprint(tokenizer)
    saved = pickle.loads(path.read_bytes()) if path.exists() else {}  # only this job writes it until the run ends
    keys = [key for key in evaluation_prompts(scale, seed) if key not in saved.get(fingerprint, {})]
    keys.sort(key=lambda key: -key[2] if key[0] == "ruler" else -key[1])  # the longest first: an even load
    jobs = [(str(tokenizer), key, seed) for key in keys]
    built = dict(
        zip(keys, pool.map(_build_prompt, jobs) if pool is not None else map(_build_prompt, jobs), strict=True)
    )
    saved.setdefault(fingerprint, {}).update(built)
    with written(path, "background") as tmp:
        tmp.write_bytes(pickle.dumps(saved))
    return {fingerprint: built}


def _build_prompt(job: tuple[str, tuple, int]):
    """The sample of cache key ``key`` (``evaluation_prompts``), as ``_niah`` and ``run_ruler`` build it with
    ``Prompting(seed=seed)`` and the export's tokenizer (a copy of the corpus' ``tokenizer``)."""
    from mtraining.eval.documents import Haystack
    from mtraining.eval.niah import TASK
    from mtraining.eval.tasks import generate

    tokenizer, key, seed = job
    count = _tokenizer(tokenizer).count
    if key[0] == "ruler":
        _, task, length, s = key
        return generate(task, length, s, count, Haystack(seed=seed), max_new_tokens=None)
    _, length, depth, s = key
    return generate(TASK, length, s, count, Haystack(seed=seed), depth / 100, None)


@functools.cache
def _tokenizer(path: str):
    """The evaluation's tokenizer (``loading.load_tokenizer``), loaded once per worker process."""
    from mtraining.eval.loading import load_tokenizer

    return load_tokenizer(path)


def load_export(export: str, scale: Scale):
    """``mtraining.eval.loading.load`` of an export on the scale's device (CUDA or the CPU) in its dtype."""
    from mtraining.eval.loading import load

    return load(export, device="cuda" if scale.device == "cuda" else "cpu", dtype=scale.dtype)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None

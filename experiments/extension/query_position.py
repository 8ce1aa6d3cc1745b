"""Does sparse attention keep retrieval when the questions are not at the end? CPU scale, inference only.

The vertical-slash pattern is estimated from the last ``last_q`` queries (answer_positions.py: at the GPU
scale 0.87% of recall logs' answers lie there). This scores the CPU scale's extended models on the held-out
recall documents twice, with the same tokens at the same length: ``end``, the document's own filler moved in
front (after its first token, the sink) so its questions end it, and ``tail``, the same filler after the
questions, so the rows that choose the lines are filler and the questions lie ``--tail`` tokens before the end.
Dense attention sees no difference between the two but the positions; a pattern chosen by the last rows may.

    python -m experiments.extension.query_position --work runs/extension_cpu --docs 50   # bench/results/extension_cpu_query_position.json
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from bench.common import RESULTS_DIR, provenance

from ..common.stages import Clock, write_json
from . import evaluation, recall_corpus, report
from .recall_corpus import eval_set
from .settings import SCALES, Budget, Scale

Doc = tuple[list[int], list[int], list[float]]  # ids, answer positions, depths (as evaluation's recall documents)


def placed(docs: list[Doc], tail: int, scale: Scale, seed: int) -> dict[str, list[Doc]]:
    """``docs`` (each ``tail`` tokens short of the length) with ``tail`` filler tokens of their own after the first
    token (``end``: the questions end the document) or after the questions (``tail``)."""
    out: dict[str, list[Doc]] = {"end": [], "tail": []}
    for i, (ids, answers, depths) in enumerate(docs):
        filler = recall_corpus._filler(random.Random(f"query-position-{seed}-{i}"), scale.vocab, tail)
        out["end"].append(([ids[0], *filler, *ids[1:]], [a + tail for a in answers], depths))
        out["tail"].append(([*ids, *filler], list(answers), depths))
    return out


def held_out(scale: Scale, documents: int, tail: int, seed: int) -> dict[str, list[Doc]]:
    """The ``end`` and ``tail`` placements (``placed``) of ``documents`` held-out recall documents at the scale's
    length; ValueError unless ``tail`` lies between last_q and half the length."""
    if not scale.last_q < tail < scale.long // 2:
        raise ValueError(f"--tail must lie between last_q ({scale.last_q}) and half the length ({scale.long // 2})")
    docs = eval_set(scale.vocab, scale.long - tail, documents, scale.eval_shape, scale.depths, seed)
    return placed([(d.ids, d.answers, d.depths) for d in docs], tail, scale, seed)


def exported(work: Path, model: str) -> Path:
    """The export of extension ``model`` in pipeline.py's ``work`` folder; ValueError naming the fix."""
    export = work / "extend" / model / "export"
    if not (export / "model.safetensors").is_file():
        raise ValueError(
            f"no exported model in {export}: run python -m experiments.extension --scale cpu --work {work} first"
        )
    return export


def score(export: Path, scale: Scale, attention: Budget | None, documents: list[Doc]) -> dict:
    """Retrieval of one placement read with ``attention`` (None: dense): hits per document, the percent found,
    the depth grid, each document's loss per position bucket (``ppl``), the pattern's density and the time taken."""
    with Clock() as clock:
        result = evaluation.evaluate_recall(str(export), scale, attention, {scale.long: documents})
    n = str(scale.long)
    found = result["tasks"]["recall"][n]["documents"]
    return {
        "documents": found,
        "retrieval": report.accuracy(found),
        "grid": result["tasks"]["recall"][n]["grid"],
        "ppl": result["ppl"][n],
        "density": result["density"][n],
        "wall_s": clock.wall_s,
        "cpu_s": clock.cpu_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--work", type=Path, required=True, help="the CPU scale's work folder of python -m experiments.extension"
    )
    p.add_argument("--docs", type=int, default=50)
    p.add_argument("--tail", type=int, default=256, help="filler tokens after the questions (> last_q)")
    p.add_argument("--budget", default=None, help="the sparse budget (default: the scale's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "extension_cpu_query_position.json")
    args = p.parse_args()
    scale = SCALES["cpu"]
    budget = scale.budget(args.budget or scale.default_budget)
    sparse = f"sparse-{budget.name}"
    # (model, attention): the dense extension read dense and sparse, the sparse extension read with its own budget
    plan = [("dense", None), ("dense", budget), (sparse, budget)]
    try:
        variants = held_out(scale, args.docs, args.tail, args.seed)
        exports = {model: exported(args.work, model) for model, _ in plan}
    except ValueError as err:
        p.error(str(err))
    rows, differences = {}, {}
    for model, attention in plan:
        label = f"{model}/{'dense' if attention is None else sparse}"
        for where, documents in variants.items():
            rows[f"{label}/{where}"] = row = score(exports[model], scale, attention, documents)
            print(f"{label}/{where}: {row['retrieval']['percent']:.1f}% ({row['wall_s']:.0f}s)")
        differences[label] = report.difference(rows[f"{label}/tail"]["documents"], rows[f"{label}/end"]["documents"])
    result = dict(
        name=args.out.stem,
        **provenance(on_gpu=False),
        length=scale.long,
        tail=args.tail,
        documents=args.docs,
        budget=budget.name,
        rows=rows,
        tail_minus_end=differences,
    )
    write_json(args.out, result)


if __name__ == "__main__":
    main()

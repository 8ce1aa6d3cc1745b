"""Retrieval scored teacher-forced: documents whose answer tokens sit at known positions.

A document is token ids plus the positions of its answer tokens (for example the value after a
queried key in an associative-recall document) and a depth per answer (where in the context the
fact it retrieves was stated). One prefill of the whole document runs through the attention under
test (``Engine.token_scores``: dense or dynamic sparse, one process or a context-parallel ring);
an answer counts as found when the greedy prediction at the position before it is the answer token.
For single-token answers this equals greedy generation from the prompt that ends before the answer,
with the whole prompt prefilled through that attention (no dense tail).

Scores come per (length, depth) cell and per length, each with a Wilson 95% interval, and per
document, so two models scored on the same documents can be compared pair by pair.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .engine import Engine
from .intervals import wilson_interval
from .ppl import position_buckets
from .runtime import track


def run_retrieval(
    engine: Engine,
    documents: Sequence[tuple[Sequence[int], Sequence[int], Sequence[float]]],
    depth_bins: Sequence[float],
    first_bucket: int | None = None,
    show_progress: bool = True,
) -> dict:
    """Score ``documents`` (ids, answer positions, depths) of any lengths.

    Each answer's depth goes to the nearest of ``depth_bins``. Returns ``lengths``, ``depths``,
    ``scores`` [depth][length] percent found, ``intervals`` of the same shape (Wilson 95%), ``by_length``
    (percent, interval, answers per length) and ``documents`` (length, hits, answers per document, in
    the order given). With ``first_bucket``, each document also gets ``nll``: its summed loss per
    position bucket (``ppl.position_buckets``), so the same pass yields perplexity by position.
    """
    if not documents:
        raise ValueError("no documents to score")
    hits: dict[tuple[int, float], list[int]] = {}
    per_doc = []
    for ids, answers, depths in track(documents, len(documents), "retrieval", show_progress):
        if not answers or len(answers) != len(depths):
            raise ValueError("every document needs at least one answer position and one depth per answer")
        if min(answers) < 1 or max(answers) >= len(ids):
            raise ValueError(f"answer positions must lie in 1..{len(ids) - 1} (the token after a prompt)")
        nll, predicted = engine.token_scores(torch.as_tensor(list(ids)))
        found = [int(predicted[p - 1]) == int(ids[p]) for p in answers]
        for depth, ok in zip(depths, found):
            nearest = min(depth_bins, key=lambda b: abs(b - depth))
            hits.setdefault((len(ids), nearest), []).append(ok)
        record = {"length": len(ids), "hits": sum(found), "answers": len(found)}
        if first_bucket is not None:
            buckets = position_buckets(len(ids), first_bucket)
            record["buckets"] = [[a + 1, b] for a, b in buckets]
            record["nll"] = [float(nll[a:b].double().sum()) for a, b in buckets]
        per_doc.append(record)
    lengths = sorted({n for n, _ in hits})
    bins = sorted({d for _, d in hits})
    scores = [[_percent(hits.get((n, d), [])) for n in lengths] for d in bins]
    intervals = [[wilson_interval(sum(hits.get((n, d), [])), len(hits.get((n, d), []))) for n in lengths] for d in bins]
    by_length = []
    for n in lengths:
        cell = [ok for (m, _), oks in hits.items() if m == n for ok in oks]
        by_length.append(
            {
                "length": n,
                "percent": _percent(cell),
                "interval": wilson_interval(sum(cell), len(cell)),
                "answers": len(cell),
            }
        )
    return {
        "lengths": lengths,
        "depths": bins,
        "scores": scores,
        "intervals": intervals,
        "by_length": by_length,
        "documents": per_doc,
    }


def _percent(oks: Sequence[bool]) -> float:
    return 100.0 * sum(oks) / len(oks) if oks else math.nan

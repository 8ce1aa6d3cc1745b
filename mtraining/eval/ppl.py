"""Long-document perplexity at several lengths, with the loss per position bucket.

For each length L the first L tokens of every document that long (or, with ``pack``, consecutive
L-token windows of all documents joined by the separator training uses: the EOS) are scored; the
per-token losses are summed into buckets of positions [0, b), [b, 2b), [2b, 4b), ... so a user sees
whether late tokens, which have more context, get a lower loss. Held-out real documents (a JSONL corpus with a ``text`` field, or
text files) take PG-19's role. Each perplexity carries a 95% interval over its windows (``ppl_interval``:
the windows' mean losses resampled), and each window's per-bucket loss sums are kept with the index of
the document it starts in (``window_records``), so two models read on the same documents pair up window
by window.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..data.tokenizer import Tokenizer
from .engine import Engine
from .intervals import mean_interval
from .runtime import track


def position_buckets(length: int, first: int) -> list[tuple[int, int]]:
    """Bucket edges over predicted positions 1..length-1: [0, first), [first, 2 first), [2 first, 4 first)..."""
    if first <= 0:
        raise ValueError(f"the first bucket must hold at least one position, got {first}")
    edges = [0, first]
    while edges[-1] < length - 1:
        edges.append(edges[-1] * 2)
    edges[-1] = min(edges[-1], length - 1)
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


class Windows:
    """Documents cut into evaluation windows of a given length, each tokenised once (lazily, as far as the windows
    asked for need): keep one across ``run_ppl`` calls, or build it from ids tokenised before (``of_ids``)."""

    def __init__(self, docs: Sequence[str], tokenizer: Tokenizer) -> None:
        self.docs = docs
        self.tokenizer = tokenizer
        self.ids: list[list[int]] = []

    @classmethod
    def of_ids(cls, ids: Sequence[Sequence[int]], tokenizer: Tokenizer) -> Windows:
        """Windows of documents given as token ids (``tokenizer``'s), tokenised nowhere else."""
        windows = cls([], tokenizer)
        windows.ids = [list(map(int, doc)) for doc in ids]
        return windows

    def _tokenise_until(self, done) -> None:
        while len(self.ids) < len(self.docs) and not done():
            self.ids.append(self.tokenizer.encode(self.docs[len(self.ids)]))

    def windows(self, length: int, samples: int, pack: bool) -> list[tuple[int, list[int]]]:
        """Up to ``samples`` (index of the document the window starts in, its ``length`` ids)."""
        if pack:
            separator = self.tokenizer.separator_id(None)  # training's: the declared EOS, else a common EOS name
            need = length * samples

            self._tokenise_until(lambda: sum(len(d) + 1 for d in self.ids) >= need)
            stream: list[int] = []
            owner: list[int] = []
            for i, doc in enumerate(self.ids):
                stream.extend([*doc, separator])
                owner.extend([i] * (len(doc) + 1))
            starts = range(0, len(stream) - length + 1, length)
            found = [(owner[i], stream[i : i + length]) for i in starts][:samples]
        else:
            self._tokenise_until(lambda: sum(len(d) >= length for d in self.ids) >= samples)
            found = [(i, d[:length]) for i, d in enumerate(self.ids) if len(d) >= length][:samples]
        if not found:
            longest = max((len(d) for d in self.ids), default=0)
            total = sum(len(d) for d in self.ids)
            hint = (
                f"the documents hold {total} tokens in all; add more text or drop that length"
                if pack
                else f"the longest has {longest}; add longer documents, pass --pack to join documents, or drop that length"
            )
            raise ValueError(f"no {length}-token window in the data ({hint})")
        return found


def run_ppl(
    engine: Engine,
    tokenizer: Tokenizer,
    docs: Sequence[str] | Windows,
    lengths: Sequence[int],
    samples: int = 1,
    first_bucket: int = 1024,
    pack: bool = False,
    show_progress: bool = True,
) -> list[dict]:
    """Per length: windows scored, mean NLL, perplexity with its 95% interval over windows, per-bucket NLL,
    perplexity and interval, and per window its document and bucket loss sums (module docstring). ``docs``: texts,
    or ``Windows`` (tokenised once for every call that gets it)."""
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    source = docs if isinstance(docs, Windows) else Windows(docs, tokenizer)
    plan = [(n, doc, w) for n in lengths for doc, w in source.windows(n, samples, pack)]
    sums: dict[int, list[dict]] = {n: [] for n in lengths}
    for length, doc, window in track(plan, len(plan), "perplexity", show_progress):
        nll = engine.token_nll(torch.tensor(window)).double()
        edges = position_buckets(length, first_bucket)
        sums[length].append({"document": doc, "nll": [float(nll[a:b].sum()) for a, b in edges]})
    results = []
    for n in lengths:
        edges = position_buckets(n, first_bucket)
        buckets = []
        for i, (a, b) in enumerate(edges):
            per_window = [w["nll"][i] / (b - a) for w in sums[n]]
            buckets.append({"start": a + 1, "end": b, "tokens": (b - a) * len(per_window), **_perplexity(per_window)})
        per_window = [sum(w["nll"]) / (n - 1) for w in sums[n]]
        results.append(
            {"length": n, "windows": len(sums[n]), "tokens": (n - 1) * len(sums[n]), **_perplexity(per_window)}
            | {"buckets": buckets, "window_records": sums[n]}
        )
    return results


def _perplexity(per_window: list[float]) -> dict:
    """Mean NLL of windows with equal token counts, its perplexity, and the perplexity's 95% interval over the
    windows (None for one window)."""
    mean = sum(per_window) / len(per_window)
    lo, hi = mean_interval(per_window)
    interval = None if math.isnan(lo) else [math.exp(lo), math.exp(hi)]
    return {"nll": mean, "ppl": math.exp(mean), "ppl_interval": interval}

"""Long-document perplexity at several lengths, with the loss per position bucket.

For each length L the first L tokens of every document that long (or, with ``pack``, consecutive
L-token windows of all documents joined by the separator training uses: the EOS) are scored; the per-token losses are summed into
buckets of positions [0, b), [b, 2b), [2b, 4b), ... so a user sees whether late tokens, which
have more context, get a lower loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..data.tokenizer import Tokenizer
from .engine import Engine
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


class _Windows:
    """Lazily tokenised documents, cut into evaluation windows of a given length."""

    def __init__(self, docs: Sequence[str], tokenizer: Tokenizer) -> None:
        self.docs = docs
        self.tokenizer = tokenizer
        self.ids: list[list[int]] = []

    def _tokenise_until(self, done) -> None:
        while len(self.ids) < len(self.docs) and not done():
            self.ids.append(self.tokenizer.encode(self.docs[len(self.ids)]))

    def windows(self, length: int, samples: int, pack: bool) -> list[list[int]]:
        if pack:
            separator = self.tokenizer.separator_id(None)  # training's: the declared EOS, else a common EOS name
            need = length * samples

            self._tokenise_until(lambda: sum(len(d) + 1 for d in self.ids) >= need)
            stream: list[int] = []
            for doc in self.ids:
                stream.extend([*doc, separator])
            found = [stream[i : i + length] for i in range(0, len(stream) - length + 1, length)][:samples]
        else:
            self._tokenise_until(lambda: sum(len(d) >= length for d in self.ids) >= samples)
            found = [d[:length] for d in self.ids if len(d) >= length][:samples]
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
    docs: Sequence[str],
    lengths: Sequence[int],
    samples: int = 1,
    first_bucket: int = 1024,
    pack: bool = False,
    show_progress: bool = True,
) -> list[dict]:
    """Per length: windows scored, mean NLL, perplexity, and per-bucket NLL/perplexity."""
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    source = _Windows(docs, tokenizer)
    plan = [(n, w) for n in lengths for w in source.windows(n, samples, pack)]
    sums = {n: torch.zeros(len(position_buckets(n, first_bucket)), dtype=torch.float64) for n in lengths}
    windows = {n: 0 for n in lengths}
    for length, window in track(plan, len(plan), "perplexity", show_progress):
        nll = engine.token_nll(torch.tensor(window)).double()
        for i, (a, b) in enumerate(position_buckets(length, first_bucket)):
            sums[length][i] += nll[a:b].sum()
        windows[length] += 1
    results = []
    for n in lengths:
        buckets = []
        for (a, b), total in zip(position_buckets(n, first_bucket), sums[n].tolist()):
            tokens = (b - a) * windows[n]
            buckets.append(
                {"start": a + 1, "end": b, "tokens": tokens, "nll": total / tokens, "ppl": math.exp(total / tokens)}
            )
        mean = float(sums[n].sum()) / ((n - 1) * windows[n])
        results.append(
            {
                "length": n,
                "windows": windows[n],
                "tokens": (n - 1) * windows[n],
                "nll": mean,
                "ppl": math.exp(mean),
                "buckets": buckets,
            }
        )
    return results

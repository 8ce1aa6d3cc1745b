"""Pack token streams into fixed-length samples, draw them in a seeded order, shard each into the CP layout.

Sample ``i`` of a stream is tokens ``[i N, (i+1) N + 1)`` (N = seq_len): inputs are its first N
tokens and labels its last N, so shifting happens on the *global* sequence before any split. A
sample is read from its memory-mapped stream when drawn (one window, never the whole stream).

Several sources mix by weight: draw ``k`` (a global counter: step, micro-batch, data-parallel
rank, row) picks a source and one of its samples as a pure function of ``k`` and the seed, so a
resumed run draws exactly what an uninterrupted one would. Draws come in blocks in which every
source appears in proportion to its weight (exactly, up to rounding to the block size), shuffled
with the seed; within a source, samples follow a seeded permutation that is redrawn each epoch
of that source. Each context-parallel rank then takes its layout positions of inputs, labels and
position ids.

A sample is a window of its stream, so anything recorded per stream position maps onto a sample by
the same window. Document boundaries (``data.document_masking``) are read off the sample itself: a
document ends after every separator token, and a sample starts a document at position 0 (one cut by
the previous sample continues as its own document). They are global positions (``ops.Documents``),
the same on every context-parallel rank; with ``reset_position_ids`` each rank's position ids count
from its tokens' document start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..data.tokens import TokenStream
from ..ops.documents import Documents
from ..parallel.layout import Layout

_BLOCK = 4096  # draws per mixing block: weights are honoured to 1/_BLOCK (finer when a weight needs it)
_MAX_BLOCK = 1 << 24


class PackedStream:
    """Fixed-length samples of one token stream."""

    def __init__(self, stream: TokenStream | np.ndarray, seq_len: int, name: str = "the data") -> None:
        self.stream = stream if isinstance(stream, TokenStream) else TokenStream([stream])
        self.seq_len = seq_len
        self.num_samples = (len(self.stream) - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(
                f"{name} holds {len(self.stream)} tokens, fewer than one sample of seq_len {seq_len} + 1; "
                "add data or lower data.seq_len"
            )

    def sample(self, index: int) -> np.ndarray:
        """int64 tokens [seq_len + 1] of sample ``index``."""
        start = index * self.seq_len
        return self.stream.read(start, start + self.seq_len + 1)


def _largest_remainder(shares: np.ndarray, total: int) -> np.ndarray:
    """Integers summing to ``total`` in proportion to ``shares`` (largest-remainder rounding)."""
    exact = shares / shares.sum() * total
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(counts - exact, kind="stable")[: total - counts.sum()]] += 1
    return counts


class SampleOrder:
    """Which (source, sample) the k-th draw is; see the module docstring."""

    def __init__(
        self, sizes: Sequence[int], weights: Sequence[float] | None, seed: int = 0, shuffle: bool = True
    ) -> None:
        self.sizes = list(sizes)
        self.seed = seed
        self.shuffle = shuffle
        shares = np.asarray(weights if weights is not None else sizes, dtype=np.float64)
        block = _BLOCK
        while (counts := _largest_remainder(shares, block)).min() == 0 and block < _MAX_BLOCK:
            block *= 2
        if counts.min() == 0:
            raise ValueError(f"data source weights {list(shares)} are too uneven: one would never be drawn")
        self.block, self.counts = block, counts
        self.shares = counts / block
        self._block_cache: tuple[int, np.ndarray, np.ndarray] | None = None
        self._perms: dict[int, tuple[int, np.ndarray]] = {}

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each draw, its rank among that source's draws) in block ``b``."""
        if self._block_cache is None or self._block_cache[0] != b:
            ids = np.repeat(np.arange(len(self.counts)), self.counts)
            if self.shuffle:
                ids = np.random.default_rng((self.seed, 0, b)).permutation(ids)
            else:  # evenly interleaved: draw j of source i sits at (j + 0.5) / count_i
                position = np.concatenate([(np.arange(c) + 0.5) / c for c in self.counts])
                ids = ids[np.argsort(position, kind="stable")]
            order = np.argsort(ids, kind="stable")
            rank = np.empty(self.block, dtype=np.int64)
            rank[order] = np.arange(self.block) - np.repeat(np.cumsum(self.counts) - self.counts, self.counts)
            self._block_cache = (b, ids, rank)
        return self._block_cache[1], self._block_cache[2]

    def _permutation(self, source: int, epoch: int) -> np.ndarray:
        cached = self._perms.get(source)
        if cached is None or cached[0] != epoch:
            n = self.sizes[source]
            perm = np.random.default_rng((self.seed, 1, source, epoch)).permutation(n) if self.shuffle else np.arange(n)
            self._perms[source] = cached = (epoch, perm)
        return cached[1]

    def draw(self, k: int) -> tuple[int, int]:
        """(source index, sample index) of draw ``k``."""
        b, r = divmod(k, self.block)
        ids, rank = self._block(b)
        source = int(ids[r])
        epoch, within = divmod(b * int(self.counts[source]) + int(rank[r]), self.sizes[source])
        return source, int(self._permutation(source, epoch)[within])


class PackedSamples:
    """Samples of one or several weighted token streams in a seeded order (see the module docstring)."""

    def __init__(
        self,
        streams: Sequence[TokenStream | np.ndarray] | TokenStream | np.ndarray,
        seq_len: int,
        seed: int = 0,
        shuffle: bool = True,
        weights: Sequence[float] | None = None,
        names: Sequence[str] | None = None,
    ) -> None:
        if isinstance(streams, (TokenStream, np.ndarray)):
            streams = [streams]
        names = names or [f"data source {i}" for i in range(len(streams))]
        self.sources = [PackedStream(s, seq_len, n) for s, n in zip(streams, names)]
        self.seq_len = seq_len
        self.order = SampleOrder([s.num_samples for s in self.sources], weights, seed, shuffle)

    def batch(self, first: int, count: int) -> Tensor:
        """int64 [count, seq_len + 1]: draws first .. first + count - 1."""
        rows = []
        for k in range(first, first + count):
            source, index = self.order.draw(k)
            rows.append(self.sources[source].sample(index))
        return torch.from_numpy(np.stack(rows))


def first_draw(step: int, micro: int, micro_batches: int, dp_rank: int, dp_size: int, batch_size: int) -> int:
    """The draw counter of row 0 of a micro-batch: steps, then micro-batches, then data-parallel ranks, then rows."""
    return ((step * micro_batches + micro) * dp_size + dp_rank) * batch_size


@dataclass
class Shard:
    """One rank's part of a batch, in its layout order."""

    input_ids: Tensor  # int64 [B, N / W]
    labels: Tensor  # int64 [B, N / W]
    position_ids: Tensor  # int64 [1 or B, N / W], global positions (RoPE), or positions within documents
    documents: Documents | None = None  # the batch's packed documents (global boundaries, every rank alike)


def sample_documents(samples: Tensor, separator: int) -> Documents:
    """The packed documents of samples [B, N + 1]: each row's inputs start a document at 0 and after every
    ``separator`` token (one row of boundaries for all rows when they agree)."""
    inputs = samples[:, :-1]
    n = inputs.shape[1]
    rows = [torch.cat([row.new_zeros(1), torch.nonzero(row[:-1] == separator).flatten() + 1]) for row in inputs]
    if all(torch.equal(r, rows[0]) for r in rows[1:]):
        rows = rows[:1]
    return Documents(rows, n)


def shard_batch(
    samples: Tensor, layout: Layout, rank: int, separator: int | None = None, reset_position_ids: bool = False
) -> Shard:
    """Split samples [B, N + 1] into ``rank``'s inputs, labels and global positions; with a ``separator``
    token id also the packed documents (and, ``reset_position_ids``, positions within each document)."""
    if samples.dim() != 2 or samples.shape[1] != layout.seq_len + 1:
        raise ValueError(
            f"samples must be [batch, seq_len + 1 = {layout.seq_len + 1}] for this layout, got {tuple(samples.shape)}"
        )
    positions = layout.positions(rank)[None, :]
    documents = None if separator is None else sample_documents(samples, separator)
    if documents is not None and reset_position_ids:
        positions = positions - documents.left_bounds(positions[0]).long()
    return Shard(
        input_ids=layout.shard(samples[:, :-1], rank, dim=1),
        labels=layout.shard(samples[:, 1:], rank, dim=1),
        position_ids=positions,
        documents=documents,
    )

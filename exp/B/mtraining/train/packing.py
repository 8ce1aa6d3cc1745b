"""Pack a token stream into fixed-length samples, order them, and shard each into the CP layout.

Sample ``i`` is tokens ``[i N, (i+1) N + 1)`` of the stream (N = seq_len): inputs are its first N
tokens and labels its last N, so shifting happens on the *global* sequence before any split.
Each context-parallel rank then takes its layout positions of inputs, labels and position ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..parallel.layout import Layout


class PackedSamples:
    """Fixed-length samples of a token stream, in a seeded shuffled order that repeats by epoch."""

    def __init__(self, stream: np.ndarray, seq_len: int, seed: int = 0, shuffle: bool = True) -> None:
        self.stream = stream
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self.num_samples = (len(stream) - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(
                f"the data holds {len(stream)} tokens, fewer than one sample of seq_len {seq_len} + 1; "
                "add data or lower data.seq_len"
            )
        self._orders: dict[int, np.ndarray] = {}

    def sample(self, index: int) -> np.ndarray:
        """Tokens [seq_len + 1] of sample ``index`` in stream order."""
        start = index * self.seq_len
        return np.asarray(self.stream[start : start + self.seq_len + 1], dtype=np.int64)

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            n = self.num_samples
            rng = np.random.default_rng([self.seed, epoch])
            self._orders = {epoch: rng.permutation(n) if self.shuffle else np.arange(n)}
        return self._orders[epoch]

    def global_sample(self, k: int) -> int:
        """Stream index of the k-th sample drawn (epochs reshuffled with the seed)."""
        epoch, within = divmod(k, self.num_samples)
        return int(self._order(epoch)[within])

    def batch(self, step: int, dp_rank: int, dp_size: int, batch_size: int) -> Tensor:
        """int64 [batch_size, seq_len + 1]: this data-parallel rank's samples of ``step`` (a pure function)."""
        first = (step * dp_size + dp_rank) * batch_size
        rows = [self.sample(self.global_sample(first + i)) for i in range(batch_size)]
        return torch.from_numpy(np.stack(rows))


@dataclass
class Shard:
    """One rank's part of a batch, in its layout order."""

    input_ids: Tensor  # int64 [B, N / W]
    labels: Tensor  # int64 [B, N / W]
    position_ids: Tensor  # int64 [1, N / W], global positions (RoPE)


def shard_batch(samples: Tensor, layout: Layout, rank: int) -> Shard:
    """Split samples [B, N + 1] into ``rank``'s inputs, labels and global positions."""
    if samples.dim() != 2 or samples.shape[1] != layout.seq_len + 1:
        raise ValueError(
            f"samples must be [batch, seq_len + 1 = {layout.seq_len + 1}] for this layout, got {tuple(samples.shape)}"
        )
    return Shard(
        input_ids=layout.shard(samples[:, :-1], rank, dim=1),
        labels=layout.shard(samples[:, 1:], rank, dim=1),
        position_ids=layout.positions(rank)[None, :],
    )

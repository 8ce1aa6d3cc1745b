"""Context-parallel layouts: which global token positions each rank holds, and in what order.

A layout splits a sequence of ``seq_len`` tokens over ``world_size`` ranks. Every rank holds
``local_len`` positions in ascending global order, made of runs of ``block_size`` (G) consecutive
positions that start at multiples of G, so the kernels' blocks fall on the pattern's global G-grid.

- contiguous: rank r holds [r N/W, (r+1) N/W);
- zigzag: the sequence is cut into 2W chunks, rank r holds chunks r and 2W-1-r (even dense causal work);
- striped: stripes of G tokens are dealt round-robin, stripe s to rank s mod W (even sparse work).

All maps are closed-form integer arithmetic on tensors, so they run on any device without tables.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


# Note [aligned runs]
# Every G local rows of a rank hold G consecutive global positions that start at a multiple of G
# (G = the layout's block_size). All three layouts guarantee it; their lengths must divide accordingly.
# What relies on it:
# - the kernels' G-blocks fall on the pattern's global G-grid, so a block diagonal is the same set of
#   pairs on every rank and ring step (check_pattern_block: the pattern's G divides the layout's);
# - the walks and the estimate treat positions as runs (block starts and vertical lookups are binary
#   searches; slash sums are strided diagonal sums);
# - a layout deals whole G-blocks, so per-block columns are ranked by the rank that holds the block.
# Queries that are not aligned (decoding) run dense.
class Layout:
    """Base class: subclasses define ``_unit`` (the divisor seq_len needs) and the two maps."""

    name: str = "base"

    def __init__(self, seq_len: int, world_size: int, block_size: int = 128) -> None:
        for arg, value in (("seq_len", seq_len), ("world_size", world_size), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{arg} must be a positive int, got {value!r}")
        unit = self._unit(world_size, block_size)
        if seq_len % unit != 0:
            example = max(unit, -(-seq_len // unit) * unit)
            raise ValueError(
                f"seq_len {seq_len} cannot be split by the {self.name} layout over {world_size} ranks with "
                f"block {block_size}: use a multiple of {unit}, e.g. {example}"
            )
        self.seq_len = seq_len
        self.world_size = world_size
        self.block_size = block_size

    # ------------------------------------------------------------------ subclass hooks
    @staticmethod
    def _unit(world_size: int, block_size: int) -> int:
        raise NotImplementedError

    def _local_to_global(self, rank: int, local: Tensor) -> Tensor:
        raise NotImplementedError

    def _global_to_owner(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    # ------------------------------------------------------------------ public maps
    @property
    def local_len(self) -> int:
        """Tokens per rank (N / W)."""
        return self.seq_len // self.world_size

    def positions(self, rank: int) -> Tensor:
        """int64 [local_len]: the global positions rank holds, ascending (its local order)."""
        self._check_rank(rank)
        return self._local_to_global(rank, torch.arange(self.local_len, dtype=torch.int64))

    def owner(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """(rank, local index) int64 tensors of global positions ``pos`` (any shape, any device)."""
        pos = torch.as_tensor(pos)
        if pos.dtype.is_floating_point or pos.dtype == torch.bool:
            raise ValueError(f"positions must be an integer tensor, got {pos.dtype}")
        pos = pos.long()
        if pos.numel() and bool(((pos < 0) | (pos >= self.seq_len)).any()):
            raise ValueError(f"positions must lie in [0, {self.seq_len}) for this {self.name} layout")
        return self._global_to_owner(pos)

    def shard(self, x: Tensor, rank: int, dim: int = 1) -> Tensor:
        """Rank's rows (along ``dim``) of a full-sequence tensor, in local order."""
        self._check_rank(rank)
        self._check_len(x, dim, self.seq_len, "the full sequence")
        return x.index_select(dim, self.positions(rank).to(x.device))

    def gather(self, shards: list[Tensor], dim: int = 1) -> Tensor:
        """The full-sequence tensor from every rank's shard (inverse of ``shard``)."""
        if len(shards) != self.world_size:
            raise ValueError(f"gather needs one shard per rank ({self.world_size}), got {len(shards)}")
        for shard in shards:
            self._check_len(shard, dim, self.local_len, "local_len")
        stacked = torch.cat(list(shards), dim=dim)  # rank-major: row rank * local_len + local index
        rank, local = self._global_to_owner(torch.arange(self.seq_len, device=stacked.device))
        return stacked.index_select(dim, rank * self.local_len + local)

    def all_gather(self, shard: Tensor, group: dist.ProcessGroup | None, dim: int = 1) -> Tensor:
        """The full-sequence tensor on every rank of ``group`` from each rank's ``shard`` (collective)."""
        shards = [torch.empty_like(shard) for _ in range(self.world_size)]
        dist.all_gather(shards, shard.contiguous(), group=group)
        return self.gather(shards, dim=dim)

    def check_pattern_block(self, block_size: int) -> None:
        """ValueError unless a pattern on a ``block_size`` grid fits this layout's runs (G_pattern | G_layout;
        see Note [aligned runs])."""
        if self.block_size % block_size != 0:
            raise ValueError(
                f"pattern block_size {block_size} must divide the layout's block_size {self.block_size} so kernel "
                f"blocks fall on the pattern's grid; build the layout with block_size={block_size}"
            )

    # ------------------------------------------------------------------ helpers
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size}) for this {self.name} layout")

    def _check_len(self, x: Tensor, dim: int, expected: int, what: str) -> None:
        if x.dim() == 0 or x.shape[dim] != expected:
            raise ValueError(
                f"tensor of shape {tuple(x.shape)} must have {expected} rows ({what}) along dim {dim} "
                f"for the {self.name} layout of seq_len {self.seq_len} over {self.world_size} ranks"
            )

    def _key(self) -> tuple:
        return (self.name, self.seq_len, self.world_size, self.block_size)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(seq_len={self.seq_len}, world_size={self.world_size}, block_size={self.block_size})"
        )


class ContiguousLayout(Layout):
    """Rank r holds [r N/W, (r+1) N/W)."""

    name = "contiguous"

    @staticmethod
    def _unit(world_size: int, block_size: int) -> int:
        return world_size * block_size

    def _local_to_global(self, rank: int, local: Tensor) -> Tensor:
        return rank * self.local_len + local

    def _global_to_owner(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        return pos // self.local_len, pos % self.local_len


class ZigzagLayout(Layout):
    """2W chunks; rank r holds chunk r then chunk 2W-1-r."""

    name = "zigzag"

    @staticmethod
    def _unit(world_size: int, block_size: int) -> int:
        return 2 * world_size * block_size

    @property
    def _chunk(self) -> int:
        return self.seq_len // (2 * self.world_size)

    def _local_to_global(self, rank: int, local: Tensor) -> Tensor:
        c = self._chunk
        chunk = torch.where(local < c, rank, 2 * self.world_size - 1 - rank)
        return chunk * c + local % c

    def _global_to_owner(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        c, w = self._chunk, self.world_size
        chunk = pos // c
        second = chunk >= w
        rank = torch.where(second, 2 * w - 1 - chunk, chunk)
        return rank, pos % c + second.long() * c


class StripedLayout(Layout):
    """Stripes of G tokens dealt round-robin: stripe s goes to rank s mod W."""

    name = "striped"

    @staticmethod
    def _unit(world_size: int, block_size: int) -> int:
        return world_size * block_size

    def _local_to_global(self, rank: int, local: Tensor) -> Tensor:
        g = self.block_size
        return (local // g * self.world_size + rank) * g + local % g

    def _global_to_owner(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        g, w = self.block_size, self.world_size
        stripe = pos // g
        return stripe % w, stripe // w * g + pos % g


LAYOUTS: dict[str, type[Layout]] = {cls.name: cls for cls in (ContiguousLayout, ZigzagLayout, StripedLayout)}


def make_layout(name: str, seq_len: int, world_size: int, block_size: int = 128) -> Layout:
    """The layout called ``name`` ("contiguous", "zigzag" or "striped")."""
    if name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; use one of: {', '.join(LAYOUTS)}")
    return LAYOUTS[name](seq_len, world_size, block_size)

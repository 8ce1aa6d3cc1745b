"""The vertical-slash sparsity pattern and its meaning on the global token grid.

A pattern says, per (batch, query head), which (query, key) pairs attention computes. It is
defined on *global* token positions so that one pattern means the same thing on one device and
in every context-parallel layout:

    pair (i, j) is kept  <=>  j <= i  and  ( j is a vertical of the head
                                             or  i // G - j // G is a selected block diagonal )

``G`` is the pattern's ``block_size`` (the kernel block). Slash lines (fixed offsets ``i - j = d``)
are stored as the block diagonals they cross, so the block part is computed block by block on the
global G-grid and verticals are computed column by column, each pair exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


def slashes_to_block_diags(offsets: Tensor, block_size: int, num_blocks: int) -> Tensor:
    """Boolean [..., num_blocks] mask of the block diagonals crossed by slash offsets [..., S].

    Offset ``d = i - j >= 0`` crosses block diagonal ``d // G`` and, unless ``d % G == 0``, also
    ``d // G + 1``. Negative offsets (padding) are ignored.
    """
    valid = offsets >= 0
    lower = torch.where(valid, offsets // block_size, num_blocks)
    upper = torch.where(valid & (offsets % block_size != 0), lower + 1, num_blocks)
    mask = torch.zeros(*offsets.shape[:-1], num_blocks + 1, dtype=torch.bool, device=offsets.device)
    mask.scatter_(-1, lower.clamp(max=num_blocks).long(), True)
    mask.scatter_(-1, upper.clamp(max=num_blocks).long(), True)
    return mask[..., :num_blocks]


def compact(values: Tensor, keep: Tensor, fill: int, width: int) -> tuple[Tensor, Tensor]:
    """Move the kept entries of each row of ``values`` [..., L] to the front, in order.

    Returns (packed [..., W] int32 padded with ``fill``, counts [...] int32); W = max(``width``, 1),
    where ``width`` (a host-known bound, so no device sync) is at least every row's count.
    """
    counts = keep.sum(-1, dtype=torch.int32)
    width = max(width, 1)
    slot = torch.where(keep, keep.cumsum(-1) - 1, width)
    packed = torch.full((*values.shape[:-1], width + 1), fill, dtype=torch.int32, device=values.device)
    packed.scatter_(-1, slot.long(), values.to(torch.int32))
    return packed[..., :width].contiguous(), counts


def _mask_to_sorted(mask: Tensor, fill: int, width: int) -> tuple[Tensor, Tensor]:
    """Boolean [..., L] with at most ``width`` set per row -> (ascending indices padded with ``fill``, counts)."""
    positions = torch.arange(mask.shape[-1], device=mask.device, dtype=torch.int32).expand_as(mask)
    return compact(positions, mask, fill, width=width)


@dataclass(frozen=True)
class VerticalSlashPattern:
    """Per-(batch, query-head) vertical-slash pattern on the global grid (see module docstring).

    Attributes:
        seq_len: global sequence length N the pattern is defined on.
        block_size: G, the block grid of the slash part (must equal the kernel block size).
        block_diags: int32 [B, H, Dmax], selected block diagonals ascending, padded with num_blocks.
        num_diags: int32 [B, H], how many entries of ``block_diags`` are real.
        vertical_pos: int32 [B, H, Vmax], vertical key positions ascending, padded with seq_len.
        num_verticals: int32 [B, H], how many entries of ``vertical_pos`` are real.
    """

    seq_len: int
    block_size: int
    block_diags: Tensor
    num_diags: Tensor
    vertical_pos: Tensor
    num_verticals: Tensor
    index_cache: dict = field(default_factory=dict, compare=False, repr=False)
    """Kernel indices derived from this pattern per chunk pair (kernel_index.py); lives with the pattern."""

    @property
    def num_blocks(self) -> int:
        return -(-self.seq_len // self.block_size)

    @property
    def batch(self) -> int:
        return self.block_diags.shape[0]

    @property
    def heads(self) -> int:
        return self.block_diags.shape[1]

    @property
    def device(self) -> torch.device:
        return self.block_diags.device

    def diag_mask(self) -> Tensor:
        """Boolean [B, H, num_blocks]: is block diagonal delta selected."""
        mask = torch.zeros(self.batch, self.heads, self.num_blocks + 1, dtype=torch.bool, device=self.device)
        mask.scatter_(-1, self.block_diags.long().clamp(max=self.num_blocks), True)
        return mask[..., : self.num_blocks]

    def vertical_mask(self) -> Tensor:
        """Boolean [B, H, seq_len]: is key position j a vertical."""
        mask = torch.zeros(self.batch, self.heads, self.seq_len + 1, dtype=torch.bool, device=self.device)
        mask.scatter_(-1, self.vertical_pos.long().clamp(max=self.seq_len), True)
        return mask[..., : self.seq_len]

    def to(self, device: torch.device | str) -> "VerticalSlashPattern":
        return VerticalSlashPattern(
            self.seq_len,
            self.block_size,
            self.block_diags.to(device),
            self.num_diags.to(device),
            self.vertical_pos.to(device),
            self.num_verticals.to(device),
        )

    # ----------------------------------------------------------------- constructors
    @classmethod
    def from_masks(cls, diag_mask: Tensor, vertical_mask: Tensor, block_size: int) -> "VerticalSlashPattern":
        """Build from boolean [B, H, num_blocks] diagonal and [B, H, N] vertical masks."""
        seq_len = vertical_mask.shape[-1]
        num_blocks = -(-seq_len // block_size)
        if diag_mask.shape[-1] != num_blocks or diag_mask.shape[:2] != vertical_mask.shape[:2]:
            raise ValueError(
                f"diag_mask {tuple(diag_mask.shape)} must be [B, H, ceil(N/G)={num_blocks}] with the "
                f"same [B, H] as vertical_mask {tuple(vertical_mask.shape)}"
            )
        widths = torch.stack([diag_mask.sum(-1).amax(), vertical_mask.sum(-1).amax()]).tolist()  # one device sync
        diags, n_diags = _mask_to_sorted(diag_mask, num_blocks, widths[0])
        verts, n_verts = _mask_to_sorted(vertical_mask, seq_len, widths[1])
        return cls(seq_len, block_size, diags, n_diags, verts, n_verts)

    @classmethod
    def from_lines(
        cls, vertical_pos: Tensor, slash_offsets: Tensor, seq_len: int, block_size: int
    ) -> "VerticalSlashPattern":
        """Build from vertical positions [B, H, V] and slash offsets [B, H, S] (-1 = padding)."""
        num_blocks = -(-seq_len // block_size)
        diag_mask = slashes_to_block_diags(slash_offsets, block_size, num_blocks)
        vmask = torch.zeros(*vertical_pos.shape[:2], seq_len + 1, dtype=torch.bool, device=vertical_pos.device)
        vmask.scatter_(-1, vertical_pos.long().where(vertical_pos >= 0, seq_len).clamp(max=seq_len), True)
        return cls.from_masks(diag_mask, vmask[..., :seq_len], block_size)

    @classmethod
    def dense(cls, batch: int, heads: int, seq_len: int, block_size: int, device=None) -> "VerticalSlashPattern":
        """Every block diagonal selected: equal to dense causal attention."""
        num_blocks = -(-seq_len // block_size)
        diag_mask = torch.ones(batch, heads, num_blocks, dtype=torch.bool, device=device)
        vmask = torch.zeros(batch, heads, seq_len, dtype=torch.bool, device=device)
        return cls.from_masks(diag_mask, vmask, block_size)

    # ----------------------------------------------------------------- accounting
    def pair_mask(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Boolean [B, H, Sq, Sk]: which (q_pos[a], k_pos[b]) pairs the pattern keeps (small sizes only)."""
        q_pos = q_pos.to(self.device).long()
        k_pos = k_pos.to(self.device).long()
        causal = k_pos[None, :] <= q_pos[:, None]
        delta = (q_pos[:, None] // self.block_size - k_pos[None, :] // self.block_size).clamp(0, self.num_blocks - 1)
        in_block = self.diag_mask()[:, :, delta]  # [B, H, Sq, Sk]
        is_vertical = self.vertical_mask()[:, :, k_pos.clamp(0, self.seq_len - 1)][:, :, None, :]
        return causal & (in_block | is_vertical)

    def kept_pairs(self) -> Tensor:
        """Float64 [B, H]: number of causal (i, j) pairs the pattern keeps on the full sequence."""
        n, g, nb = self.seq_len, self.block_size, self.num_blocks
        last = n - g * (nb - 1)  # rows (and columns) of the last, possibly partial, block
        dev = self.device
        delta = torch.arange(nb, device=dev, dtype=torch.float64)
        # causal pairs on block diagonal delta: triangles on delta=0, full blocks elsewhere.
        per_diag = (nb - 1 - delta) * g * g + last * g
        per_diag[0] = (nb - 1) * g * (g + 1) / 2 + last * (last + 1) / 2
        selected = self.diag_mask()
        block_pairs = (selected.double() * per_diag).sum(-1)
        # a vertical j in key block kb adds the rows i >= j whose diagonal is not selected.
        unselected = (~selected).double()  # [B, H, nb]
        prefix = unselected.clone()
        prefix[..., 0] = 0
        prefix = prefix.cumsum(-1)  # prefix[m] = sum_{1 <= delta <= m} unselected[delta]
        cols = self.vertical_pos.long().clamp(max=n - 1)
        real = torch.arange(cols.shape[-1], device=dev)[None, None, :] < self.num_verticals[..., None]
        kb = cols // g
        top = nb - 1 - kb  # largest delta with a row block
        far_rows = g * prefix.gather(-1, top) - torch.where(top >= 1, unselected.gather(-1, top) * (g - last), 0.0)
        own_rows = unselected[..., :1] * ((kb + 1) * g).clamp(max=n).sub(cols).double()
        vertical_pairs = ((far_rows + own_rows) * real).sum(-1)
        return block_pairs + vertical_pairs

    def density(self) -> Tensor:
        """Float64 [B, H]: kept causal pairs / all causal pairs of the full sequence."""
        return self.kept_pairs() / (self.seq_len * (self.seq_len + 1) / 2)

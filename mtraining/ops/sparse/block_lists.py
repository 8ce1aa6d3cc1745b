"""A pattern's selected block diagonals as the block lists of a block-sparse kernel (FlashAttention-4's).

A selected block diagonal delta keeps, for every query block qb of the G-grid, the whole G x G block
(qb, qb - delta), causal on the main diagonal (delta = 0). A block-sparse kernel takes such blocks as
lists on its own tile grid (T x T tiles, T = ``FA4_TILE`` dividing G): per query tile the key tiles it
visits (the forward's, kv direction), per key tile the query tiles (the backward's, q direction), each
split into *partial* tiles, which need the causal mask (the tiles on the main diagonal), and *full*
ones. The lists ascend, padded with 0 past their counts (the kernels read only the first count).
Built in torch ops on any device, over the queries and keys 0..S-1 (the single-device call's default
positions), without a device sync.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..pattern import VerticalSlashPattern, compact

FA4_TILE = 128
"""FA4's block-sparse tile at head_dim 128 on Hopper: its forward's kv tile, which the sparse kv block must
equal there (block_size[1] == tile_n; on Blackwell a multiple), and its backward's sparse q block."""


class BlockLists(NamedTuple):
    """Tile lists in one direction, int32: per tile of this side, the tiles of the other side it meets.

    partial_count [B, H, n], partial_index [B, H, n, W]: the causal-diagonal tiles (at most one per tile);
    full_count [B, H, n], full_index [B, H, n, W]: the others. FA4's order (mask, then full).
    """

    partial_count: Tensor
    partial_index: Tensor
    full_count: Tensor
    full_index: Tensor


class SparseBlocks(NamedTuple):
    """The selected blocks of a pattern on the T-grid of ``tile``: ``forward`` lists key tiles per query tile,
    ``backward`` query tiles per key tile."""

    forward: BlockLists
    backward: BlockLists
    tile: int


def sparse_blocks(pattern: VerticalSlashPattern, seq_len: int, tile: int = FA4_TILE) -> SparseBlocks:
    """The selected block diagonals of ``pattern`` as tile lists over the positions 0..seq_len-1 (queries and
    keys alike), on the grid of ``tile`` (which must divide the pattern's block size)."""
    g = pattern.block_size
    if g % tile:
        raise ValueError(f"the pattern's block size {g} must be a multiple of the block-sparse tile {tile}")
    per_block = g // tile
    n_tiles = -(-seq_len // tile)
    diags = pattern.block_diags  # ascending, padded with num_blocks
    real = torch.arange(diags.shape[-1], device=diags.device) < pattern.num_diags[..., None]
    tiles = torch.arange(n_tiles, device=diags.device, dtype=torch.int32)
    sub = torch.arange(per_block, device=diags.device, dtype=torch.int32)
    # forward: key tile (qb - delta) * r + s of query tile t (qb = t // r), largest delta first so that they ascend
    keys = ((tiles[:, None] // per_block - diags.flip(-1)[..., None, :]) * per_block)[..., None] + sub
    key_ok = (real.flip(-1)[..., None, :, None] & (keys >= 0) & (keys <= tiles[:, None, None])).flatten(-2)
    forward = _split(keys.flatten(-2), key_ok, tiles)
    # backward: query tile (kb + delta) * r + s of key tile t (kb = t // r), smallest delta first
    queries = ((tiles[:, None] // per_block + diags[..., None, :]) * per_block)[..., None] + sub
    query_ok = (real[..., None, :, None] & (queries < n_tiles) & (queries >= tiles[:, None, None])).flatten(-2)
    backward = _split(queries.flatten(-2), query_ok, tiles)
    return SparseBlocks(forward, backward, tile)


def _split(other: Tensor, ok: Tensor, tiles: Tensor) -> BlockLists:
    """The kept tiles ``other`` [B, H, n, L] (ascending where ``ok``) of each tile ``tiles`` [n], split into the
    one on the main diagonal (partial: causal mask) and the rest (full). The lists are at most n wide (the kernel
    takes no wider ones), one entry per distinct tile."""
    diagonal = other == tiles[:, None]
    width = min(other.shape[-1], tiles.shape[0])
    partial_index, partial_count = compact(other, ok & diagonal, 0, width=1)
    full_index, full_count = compact(other, ok & ~diagonal, 0, width=width)
    return BlockLists(partial_count, partial_index, full_count, full_index)


def dense_mask(lists: BlockLists, tile: int, seq_len: int) -> tuple[Tensor, Tensor]:
    """(partial, full) boolean [B, H, seq_len, seq_len] (rows: this side's positions) of the tile lists, for
    tests at small sizes: every position pair inside a listed tile."""
    n = lists.full_count.shape[-1]

    def spread(count: Tensor, index: Tensor) -> Tensor:
        used = torch.arange(index.shape[-1], device=index.device) < count[..., None]
        tiles = torch.zeros(*count.shape, n + 1, dtype=torch.bool, device=index.device)
        tiles.scatter_(-1, torch.where(used, index, n).long(), True)
        expand = tiles[..., :n].repeat_interleave(tile, -2).repeat_interleave(tile, -1)
        return expand[..., :seq_len, :seq_len]

    return spread(lists.partial_count, lists.partial_index), spread(lists.full_count, lists.full_index)

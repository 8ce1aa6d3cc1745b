"""Local kernel indices: the global pattern restricted to one (query chunk, key chunk) pair.

The Triton kernels never search: for every query tile they get the list of key tiles to visit
(forward and dQ), for every key tile the list of query tiles (dK/dV), plus the start of the one
causal-diagonal block that needs a mask, and the vertical columns of this key chunk. Everything is
derived on the device with vectorised torch ops from the global pattern and the global positions
of the rows, so one kernel serves any layout and any ring step, and the kernel loops are plain
`for j in range(n)` loops that Triton can software-pipeline. Building a walk never waits for the
device (list widths are host-known upper bounds), so ring steps queue without host syncs.

Positions must come in *aligned runs*: every G rows of a chunk (from local row 0) hold G
consecutive global positions starting at a multiple of G (the last run may be shorter). All
layouts in ``mtraining.parallel`` produce such chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .pattern import VerticalSlashPattern, compact

DENSE_BLOCK = 64  # block grid the Triton backend uses for dense causal attention (pattern=None)
_ABSENT = torch.iinfo(torch.int32).max


@dataclass(frozen=True)
class QueryWalk:
    """What each query tile visits (forward and dQ kernels); int32 on the device.

    q_gblock [nQT]: global block of each query tile (to test vertical columns against diagonals).
    starts [B, H, nQT, W]: local key rows of the unmasked key tiles (off-diagonal blocks).
    count, diag [B, H, nQT]: how many; local key row of the causal-diagonal block, or -1.
    diag_mask [B, H, nb] (int8): is block diagonal delta selected.
    vcols [B, H, Vk]: local key rows of the verticals present in this key chunk, ascending.
    vcount [B, H, nQT]: how many of them a query tile may see (position <= its last query).
    """

    q_gblock: Tensor
    starts: Tensor
    count: Tensor
    diag: Tensor
    diag_mask: Tensor
    vcols: Tensor
    vcount: Tensor


@dataclass(frozen=True)
class KeyWalk:
    """What each key tile is seen by (dK/dV kernels); int32 on the device.

    starts [B, H, nKT, W]: local query rows of the unmasked query tiles (off-diagonal blocks).
    count, diag [B, H, nKT]: how many; local query row of the causal-diagonal block, or -1.
    q_gblock, diag_mask, vcols: as in QueryWalk (query tiles of size q_tile).
    vstart [B, H, nVC]: per chunk of ``v_chunk`` verticals, the first query tile that may see it.
    """

    starts: Tensor
    count: Tensor
    diag: Tensor
    q_gblock: Tensor
    diag_mask: Tensor
    vcols: Tensor
    vstart: Tensor


def check_aligned_positions(pos: Tensor, block_size: int, name: str) -> None:
    """ValueError unless ``pos`` comes in runs of ``block_size`` consecutive, block-aligned positions."""
    n = pos.shape[0]
    local = torch.arange(n, device=pos.device)
    run_start = pos[(local // block_size) * block_size].long()
    ok = bool(((run_start % block_size == 0) & (pos.long() == run_start + local % block_size)).all())
    if not ok:
        raise ValueError(
            f"{name} must hold runs of {block_size} consecutive global positions starting at multiples of "
            f"{block_size} (the pattern's block size); shard the sequence with a layout from "
            "mtraining.parallel, or use dense attention for unaligned queries"
        )


def _block_starts(pos: Tensor, block_size: int, num_blocks: int) -> Tensor:
    """int32 [num_blocks]: local row where each global block starts, -1 where absent."""
    starts = torch.full((num_blocks,), -1, dtype=torch.int32, device=pos.device)
    local_starts = torch.arange(0, pos.shape[0], block_size, device=pos.device, dtype=torch.int32)
    starts[(pos[local_starts.long()] // block_size).long()] = local_starts
    return starts


def _tile_lists(
    tile_gblock: Tensor,
    diags: Tensor,
    real: Tensor,
    sign: int,
    other_block_start: Tensor,
    sub_tile: int,
    block_size: int,
    other_len: int,
) -> tuple[Tensor, Tensor]:
    """For each tile of one side, the unmasked tiles of the other side it meets (off-diagonal blocks).

    The other side's global block is ``tile_gblock - delta`` (sign=-1, forward) or ``+ delta``
    (sign=+1, backward); each of its blocks contributes G / sub_tile tiles.
    """
    nb = other_block_start.shape[0]
    other = tile_gblock[None, None, :, None] + sign * diags[:, :, None, :]  # [B, H, nT, D]
    ok = real[:, :, None, :] & (diags[:, :, None, :] > 0) & (other >= 0) & (other < nb)
    start = other_block_start[other.clamp(0, nb - 1).long()]
    ok = ok & (start >= 0)
    offsets = torch.arange(0, block_size, sub_tile, device=diags.device, dtype=torch.int32)
    starts = start[..., None] + offsets  # [B, H, nT, D, G / sub_tile]
    ok = ok[..., None] & (starts < other_len)
    # a tile meets each block of the other chunk at most once: a host-known bound, no device sync.
    width = min(diags.shape[-1], -(-other_len // block_size)) * offsets.numel()
    return compact(starts.flatten(-2), ok.flatten(-2), _ABSENT, width=width)


def _connected_diags(q_present: Tensor, k_present: Tensor) -> Tensor:
    """Boolean [nb]: delta such that some present q block qB has a present k block qB - delta."""
    nb = q_present.shape[0]
    qf = q_present.float().view(1, 1, nb)
    kf = k_present.float().view(1, 1, nb)
    # out[t] = sum_i kpad[t + i] q[i] = sum_b k[b - (nb - 1 - t)] q[b]: lag delta = nb - 1 - t.
    return F.conv1d(F.pad(kf, (nb - 1, 0)), qf).flatten().flip(0) > 0.5


@dataclass(frozen=True)
class _ChunkPair:
    """What both walks need: block starts, useful diagonals, vertical columns of the key chunk."""

    q_pos: Tensor
    k_pos: Tensor
    q_block_start: Tensor
    k_block_start: Tensor
    diags: Tensor
    real: Tensor
    diag_mask: Tensor
    vcols: Tensor
    vcol_pos: Tensor


def _chunk_pair(pattern: VerticalSlashPattern, q_pos: Tensor, k_pos: Tensor) -> _ChunkPair:
    g, nb = pattern.block_size, pattern.num_blocks
    dev = q_pos.device
    q_pos, k_pos = q_pos.to(torch.int32), k_pos.to(torch.int32)
    sk = k_pos.shape[0]
    q_block_start = _block_starts(q_pos, g, nb)
    k_block_start = _block_starts(k_pos, g, nb)
    # block part: only diagonals that connect blocks present in this chunk pair matter.
    useful = _connected_diags(q_block_start >= 0, k_block_start >= 0)
    diags = pattern.block_diags
    real = torch.arange(diags.shape[-1], device=dev) < pattern.num_diags[..., None]
    real = real & useful[diags.clamp(max=nb - 1).long()]
    # column part: verticals whose key lives in this chunk, as local rows (padding: sk).
    vpos = pattern.vertical_pos
    real_v = torch.arange(vpos.shape[-1], device=dev) < pattern.num_verticals[..., None]
    local = torch.searchsorted(k_pos, vpos.contiguous()).clamp(max=sk - 1)
    vcols, _ = compact(local, real_v & (k_pos[local.long()] == vpos), sk, width=local.shape[-1])
    vcol_pos = torch.where(vcols < sk, k_pos[vcols.clamp(max=sk - 1).long()], _ABSENT).contiguous()
    diag_mask = pattern.diag_mask()
    return _ChunkPair(q_pos, k_pos, q_block_start, k_block_start, diags, real,
                      diag_mask.to(torch.int8).contiguous(), vcols, vcol_pos)


def _tile_gblock(pos: Tensor, tile: int, block_size: int) -> Tensor:
    return (pos[torch.arange(0, pos.shape[0], tile, device=pos.device)] // block_size).to(torch.int32)


def build_query_walk(
    pattern: VerticalSlashPattern, q_pos: Tensor, k_pos: Tensor, q_tile: int, k_tile: int
) -> QueryWalk:
    """Restrict the global pattern to the chunk pair (q_pos, k_pos), seen from the query tiles."""
    c = _chunk_pair(pattern, q_pos, k_pos)
    g = pattern.block_size
    sq, sk = c.q_pos.shape[0], c.k_pos.shape[0]
    q_gblock = _tile_gblock(c.q_pos, q_tile, g)
    starts, count = _tile_lists(q_gblock, c.diags, c.real, -1, c.k_block_start, k_tile, g, sk)
    diag = torch.where(c.diag_mask[..., :1] > 0, c.k_block_start[q_gblock.long()], -1).to(torch.int32)
    q_last = c.q_pos[(torch.arange(0, sq, q_tile, device=q_pos.device) + q_tile - 1).clamp(max=sq - 1)]
    vcount = torch.searchsorted(c.vcol_pos, q_last.expand(*c.vcols.shape[:2], -1).contiguous(), right=True)
    return QueryWalk(q_gblock, starts, count, diag.contiguous(), c.diag_mask, c.vcols,
                     vcount.to(torch.int32).contiguous())


def build_key_walk(
    pattern: VerticalSlashPattern, q_pos: Tensor, k_pos: Tensor, q_tile: int, k_tile: int, v_chunk: int
) -> KeyWalk:
    """Restrict the global pattern to the chunk pair (q_pos, k_pos), seen from the key tiles."""
    c = _chunk_pair(pattern, q_pos, k_pos)
    g = pattern.block_size
    sq = c.q_pos.shape[0]
    k_gblock = _tile_gblock(c.k_pos, k_tile, g)
    starts, count = _tile_lists(k_gblock, c.diags, c.real, +1, c.q_block_start, q_tile, g, sq)
    diag = torch.where(c.diag_mask[..., :1] > 0, c.q_block_start[k_gblock.long()], -1).to(torch.int32)
    first_row = torch.searchsorted(c.q_pos, c.vcol_pos[..., ::v_chunk].contiguous())
    return KeyWalk(starts, count, diag.contiguous(), _tile_gblock(c.q_pos, q_tile, g), c.diag_mask, c.vcols,
                   (first_row // q_tile).to(torch.int32).contiguous())

"""Local kernel indices: the global pattern restricted to one (query chunk, key chunk) pair.

The Triton kernels never search: for every query tile they get the list of key tiles to visit
(forward and dQ), for every key tile the list of query tiles (dK/dV), plus the start of the one
causal-diagonal block that needs a mask, and the vertical columns of this key chunk. Everything is
derived on the device with vectorised torch ops from the global pattern and the global positions
of the rows, so one kernel serves any layout and any ring step, and the kernel loops are plain
`for j in range(n)` loops that Triton can software-pipeline.

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
class KernelIndex:
    """Kernel-ready indices for one (query chunk, key chunk) pair; all int32 on the device.

    q_gblock [nQT]: global block of each query tile (to test vertical columns against diagonals).
    fwd_starts [B, H, nQT, W]: local key rows of the unmasked key tiles a query tile visits.
    fwd_count, fwd_diag [B, H, nQT]: how many; local key row of the causal-diagonal block or -1.
    bwd_starts [B, H, nKT, W']: local query rows of the unmasked query tiles a key tile is seen by.
    bwd_count, bwd_diag [B, H, nKT]: how many; local query row of the causal-diagonal block or -1.
    diag_mask [B, H, nb] (int8): is block diagonal delta selected.
    vcols [B, H, Vk]: local key rows of the verticals present in this key chunk, ascending.
    vcount_q [B, H, nQT]: how many of them a query tile may see (position <= its last query).
    vstart_q [B, H, nVC]: per chunk of ``v_chunk`` verticals, the first query tile that may see it.
    """

    q_tile: int
    k_tile: int
    v_chunk: int
    q_gblock: Tensor
    fwd_starts: Tensor
    fwd_count: Tensor
    fwd_diag: Tensor
    bwd_starts: Tensor
    bwd_count: Tensor
    bwd_diag: Tensor
    diag_mask: Tensor
    vcols: Tensor
    vcount_q: Tensor
    vstart_q: Tensor


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
    return compact(starts.flatten(-2), ok.flatten(-2), _ABSENT)


def _connected_diags(q_present: Tensor, k_present: Tensor) -> Tensor:
    """Boolean [nb]: delta such that some present q block qB has a present k block qB - delta."""
    nb = q_present.shape[0]
    qf = q_present.float().view(1, 1, nb)
    kf = k_present.float().view(1, 1, nb)
    # out[t] = sum_i kpad[t + i] q[i] = sum_b k[b - (nb - 1 - t)] q[b]: lag delta = nb - 1 - t.
    return F.conv1d(F.pad(kf, (nb - 1, 0)), qf).flatten().flip(0) > 0.5


def build_kernel_index(
    pattern: VerticalSlashPattern,
    q_pos: Tensor,
    k_pos: Tensor,
    q_tile: int,
    k_tile: int,
    v_chunk: int,
) -> KernelIndex:
    """Restrict the global pattern to the chunk pair (q_pos, k_pos); see KernelIndex."""
    g, nb = pattern.block_size, pattern.num_blocks
    dev = q_pos.device
    q_pos, k_pos = q_pos.to(torch.int32), k_pos.to(torch.int32)
    sq, sk = q_pos.shape[0], k_pos.shape[0]
    q_block_start = _block_starts(q_pos, g, nb)
    k_block_start = _block_starts(k_pos, g, nb)
    q_tiles = torch.arange(0, sq, q_tile, device=dev)
    q_gblock = (q_pos[q_tiles] // g).to(torch.int32)
    k_gblock = (k_pos[torch.arange(0, sk, k_tile, device=dev)] // g).to(torch.int32)

    # block part: only diagonals that connect blocks present in this chunk pair matter.
    diag_mask = pattern.diag_mask()
    useful = _connected_diags(q_block_start >= 0, k_block_start >= 0)
    nd = pattern.block_diags.shape[-1]
    diags = pattern.block_diags
    real = (torch.arange(nd, device=dev) < pattern.num_diags[..., None]) & useful[diags.clamp(max=nb - 1).long()]
    fwd_starts, fwd_count = _tile_lists(q_gblock, diags, real, -1, k_block_start, k_tile, g, sk)
    bwd_starts, bwd_count = _tile_lists(k_gblock, diags, real, +1, q_block_start, q_tile, g, sq)
    has_diag0 = diag_mask[..., :1]
    fwd_diag = torch.where(has_diag0, k_block_start[q_gblock.long()], -1).to(torch.int32).contiguous()
    bwd_diag = torch.where(has_diag0, q_block_start[k_gblock.long()], -1).to(torch.int32).contiguous()

    # column part: verticals whose key lives in this chunk, as local rows.
    vpos = pattern.vertical_pos
    real_v = torch.arange(vpos.shape[-1], device=dev) < pattern.num_verticals[..., None]
    local = torch.searchsorted(k_pos, vpos.contiguous()).clamp(max=sk - 1)
    present = real_v & (k_pos[local.long()] == vpos)
    vcols, _ = compact(local, present, sk)
    # positions of those columns (padding -> +inf) to count what each query tile may see.
    vcol_pos = torch.where(vcols < sk, k_pos[vcols.clamp(max=sk - 1).long()], _ABSENT).contiguous()
    q_last = q_pos[(q_tiles + q_tile - 1).clamp(max=sq - 1)]
    vcount_q = torch.searchsorted(vcol_pos, q_last.expand(*vcols.shape[:2], -1).contiguous(), right=True)
    first_row = torch.searchsorted(q_pos, vcol_pos[..., ::v_chunk].contiguous())
    return KernelIndex(
        q_tile,
        k_tile,
        v_chunk,
        q_gblock,
        fwd_starts,
        fwd_count,
        fwd_diag,
        bwd_starts,
        bwd_count,
        bwd_diag,
        diag_mask.to(torch.int8).contiguous(),
        vcols,
        vcount_q.to(torch.int32).contiguous(),
        (first_row // q_tile).to(torch.int32).contiguous(),
    )

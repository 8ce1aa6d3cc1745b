"""Local kernel indices: the global pattern restricted to one (query chunk, key chunk) pair.

The Triton kernels walk, per query tile, the selected block diagonals (``kB = qB - delta``) and
then the vertical columns gathered from this key chunk. Everything here is derived on the device
with a handful of vectorised torch ops from the global pattern and the global positions of the
rows, so one kernel serves any layout and any ring step.

Positions must come in *aligned runs*: every G rows of a chunk (from local row 0) hold G
consecutive global positions starting at a multiple of G (the last run may be shorter). All
layouts in ``mtraining.parallel`` produce such chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .pattern import VerticalSlashPattern, _pack_sorted

DENSE_BLOCK = 64  # block grid the Triton backend uses for dense causal attention (pattern=None)


@dataclass(frozen=True)
class KernelIndex:
    """Kernel-ready indices for one (query chunk, key chunk) pair (all int32, on the device).

    q_gblock [nQT]: global block of each query tile; k_gblock [nKT]: of each key tile.
    q_block_start / k_block_start [nb]: local row where a global block starts in the chunk, -1 absent.
    diags [B, H, Dk]: selected block diagonals that connect a present q block and a present k block.
    diag_count [B, H]: real entries of ``diags``. diag_mask [B, H, nb] (int8): is a diagonal selected.
    vcols [B, H, Vk]: local key rows of the verticals present in this key chunk, ascending.
    vcount_q [B, H, nQT]: verticals a query tile may see (position <= the tile's last query).
    vstart_q [B, H, nVC]: per chunk of ``v_chunk`` verticals, the first query tile that may see it.
    """

    q_tile: int
    k_tile: int
    v_chunk: int
    q_gblock: Tensor
    k_gblock: Tensor
    q_block_start: Tensor
    k_block_start: Tensor
    diags: Tensor
    diag_count: Tensor
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


def _connected_diags(q_present: Tensor, k_present: Tensor) -> Tensor:
    """Boolean [nb]: delta such that some present q block qB has a present k block qB - delta."""
    nb = q_present.shape[0]
    qf = q_present.float().view(1, 1, nb)
    kf = k_present.float().view(1, 1, nb)
    # out[delta] = sum_b q[b] * k[b - delta]: cross-correlation with k padded on the left.
    counts = F.conv1d(F.pad(kf, (nb - 1, 0)), qf).flatten().flip(0)
    return counts > 0.5


def build_kernel_index(
    pattern: VerticalSlashPattern,
    q_pos: Tensor,
    k_pos: Tensor,
    q_tile: int,
    k_tile: int,
    v_chunk: int,
) -> KernelIndex:
    """Restrict the global pattern to the chunk pair (q_pos, k_pos); see KernelIndex."""
    g, nb, n = pattern.block_size, pattern.num_blocks, pattern.seq_len
    dev = q_pos.device
    q_pos, k_pos = q_pos.to(torch.int32), k_pos.to(torch.int32)
    q_block_start = _block_starts(q_pos, g, nb)
    k_block_start = _block_starts(k_pos, g, nb)
    q_tiles = torch.arange(0, q_pos.shape[0], q_tile, device=dev)
    k_tiles = torch.arange(0, k_pos.shape[0], k_tile, device=dev)
    q_gblock = (q_pos[q_tiles] // g).to(torch.int32)
    k_gblock = (k_pos[k_tiles] // g).to(torch.int32)

    # block part: keep only the diagonals that connect blocks present in this chunk pair.
    diag_mask = pattern.diag_mask()
    useful = _connected_diags(q_block_start >= 0, k_block_start >= 0)
    diags, diag_count = _pack_sorted(diag_mask & useful, nb)

    # column part: verticals whose key lives in this chunk, as local rows.
    vpos = pattern.vertical_pos
    real = torch.arange(vpos.shape[-1], device=dev) < pattern.num_verticals[..., None]
    local = torch.searchsorted(k_pos, vpos.contiguous(), right=False).clamp(max=k_pos.shape[0] - 1)
    present = real & (k_pos[local.long()] == vpos)
    sentinel = k_pos.shape[0]
    keyed = torch.where(present, local.to(torch.int32), torch.full_like(local, sentinel, dtype=torch.int32))
    vcols = keyed.sort(dim=-1).values
    width = max(int(present.sum(-1).max().item()) if present.numel() else 0, 1)
    vcols = vcols[..., :width].contiguous()
    # positions of those columns (sentinel -> +inf) to count what each query tile may see.
    big = torch.iinfo(torch.int32).max
    vcol_pos = torch.where(vcols < sentinel, k_pos[vcols.clamp(max=sentinel - 1).long()], big).contiguous()
    q_last = q_pos[(q_tiles + q_tile - 1).clamp(max=q_pos.shape[0] - 1)]
    vcount_q = torch.searchsorted(vcol_pos, q_last.expand(*vcols.shape[:2], -1).contiguous(), right=True)
    chunk_first = vcol_pos[..., ::v_chunk].contiguous()
    first_row = torch.searchsorted(q_pos, chunk_first.clamp(max=big - 1), right=False)
    vstart_q = (first_row // q_tile).to(torch.int32)
    return KernelIndex(
        q_tile,
        k_tile,
        v_chunk,
        q_gblock,
        k_gblock,
        q_block_start,
        k_block_start,
        diags,
        diag_count,
        diag_mask.to(torch.int8).contiguous(),
        vcols,
        vcount_q.to(torch.int32).contiguous(),
        vstart_q.contiguous(),
    )

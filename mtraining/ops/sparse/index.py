"""The walks of the sparse kernels and their builders in torch ops (the CPU path and the oracle of the Triton ones).

A walk is the global pattern restricted to one (query chunk, key chunk) pair.

The Triton kernels never search: for every block of G query rows they get the list of key blocks
to visit (forward and dQ), for every block of G keys the list of query blocks (dK/dV), plus the
start of the one causal-diagonal block that needs a mask, and the vertical columns of this key
chunk. The lists are per G-block, not per kernel tile, so one query walk and one key walk (from one
``ChunkPair``) serve all three kernels whatever their tile sizes; a tile of B rows or keys (B
divides G) walks its block's list and steps through each listed block in G / B tiles.
Everything is derived on the device from the global pattern and the global positions of the rows
(on CUDA by three Triton launches, index_kernels.py; elsewhere, and as their oracle, by the
vectorised torch ops here; launch.py picks one and caches the result per pattern and chunk pair),
so one kernel serves any layout and any ring step, and the kernel loops are plain
`for j in range(n)` loops that Triton can software-pipeline. Building a walk never waits for the
device (list widths are host-known upper bounds), so ring steps queue without host syncs.

Packed documents (``q_bound``: per row the smallest key position it may see, ops/documents.py): a
query block's rows have non-decreasing bounds (their positions rise), lo = its first row's, hi = its
last row's. A listed key block ending before lo is seen by no row: it is dropped; one starting before
hi holds keys some row may not see: it needs the document mask; the others need none. The lists go
by ascending block diagonal (nearest key block first), so the blocks without a mask are a prefix of
each list (``unmasked`` of them), then the masked ones; the key walk's lists rise in query block and
have the same shape. Verticals before lo are skipped (``vfirst``), and a chunk of verticals is seen
only by the rows whose bound is at most its last vertical (``vend``). Work then follows the pairs
the documents keep, not the causal grid.

Positions must come in *aligned runs*, ascending: every G rows of a chunk (from local row 0) hold G
consecutive global positions starting at a multiple of G (the last run may be shorter), and the
runs rise with the local row (both builders search the positions). All layouts in
``mtraining.parallel`` produce such chunks.

Per-block columns (``pattern.block_cols``): each query block also lists the local key rows of its own
columns that lie in this key chunk and that the lines do not keep for it already (a vertical of the head,
or a key on a selected block diagonal: no pair counts twice), ascending (``ColumnWalk``, built in torch
ops on every device: one gather and search per listed column). A column lies before its block's first row,
so every row of the block sees it but for packed documents, which the kernels test per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from ..pattern import VerticalSlashPattern, compact

DENSE_BLOCK = 64  # block grid the Triton backend uses for dense causal attention (pattern=None)
ABSENT = torch.iinfo(torch.int32).max  # padding of the walks' lists


class QueryWalk(NamedTuple):
    """What each query block visits (forward and dQ kernels); int32 on the device, built by ``of``.

    Lists are per block of G local query rows, so one walk serves every query tile size that
    divides G (a tile reads the row of its block). The kernels take it whole (a NamedTuple argument),
    its strides with it.

    q_gblock [nQB]: global block of each local query block (to test vertical columns against diagonals).
    starts [B, H, nQB, W]: local key rows of the unmasked key blocks (off-diagonal blocks, G keys each).
    count, diag [B, H, nQB]: how many; local key row of the causal-diagonal block, or -1.
    diag_mask [B, H, nb] (int8): is block diagonal delta selected.
    vcols [B, H, Vk]: local key rows of the verticals present in this key chunk, ascending.
    vcount [B, H, nQB]: how many of them the block may see (position <= its last query).
    With documents (None otherwise): unmasked [B, H, nQB], how many listed blocks (a prefix) need no
    document mask; vfirst [B, H, nQB], the first vertical the block may see (position >= its rows' lo).
    stride_s*: of starts (b, h, block); stride_c*: of count and every other [B, H, nQB] list, which share
    them; stride_m*: of diag_mask; stride_w*: of vcols.
    """

    q_gblock: Tensor
    starts: Tensor
    count: Tensor
    diag: Tensor
    diag_mask: Tensor
    vcols: Tensor
    vcount: Tensor
    unmasked: Tensor | None
    vfirst: Tensor | None
    stride_sb: int
    stride_sh: int
    stride_st: int
    stride_cb: int
    stride_ch: int
    stride_mb: int
    stride_mh: int
    stride_wb: int
    stride_wh: int

    @classmethod
    def of(
        cls,
        q_gblock: Tensor,
        starts: Tensor,
        count: Tensor,
        diag: Tensor,
        diag_mask: Tensor,
        vcols: Tensor,
        vcount: Tensor,
        unmasked: Tensor | None = None,
        vfirst: Tensor | None = None,
    ) -> QueryWalk:
        """The walk of these lists, with their strides."""
        s, m, w = starts.stride(), diag_mask.stride(), vcols.stride()
        cb, ch = _shared_strides(count, diag, vcount, unmasked, vfirst)
        lists = (q_gblock, starts, count, diag, diag_mask, vcols, vcount, unmasked, vfirst)
        return cls(*lists, s[0], s[1], s[2], cb, ch, m[0], m[1], w[0], w[1])


class KeyWalk(NamedTuple):
    """What each key block is seen by (dK/dV kernels); int32 on the device, per block of G local keys,
    built by ``of``; the kernels take it whole, its strides with it.

    starts [B, H, nKB, W]: local query rows of the unmasked query blocks (off-diagonal blocks).
    count, diag [B, H, nKB]: how many; local query row of the causal-diagonal block, or -1.
    vstart [B, H, nVC]: per chunk of ``v_chunk`` verticals (``vcols``), the first local query row that may see it.
    diag_mask, vcols: the chunk pair's (as in ``QueryWalk``), for the vertical dK/dV kernel.
    With documents (None otherwise): unmasked [B, H, nKB], how many listed blocks (a prefix) need no
    document mask; vend [B, H, nVC], the end of the rows that may see the chunk (bound <= its last vertical).
    stride_s*: of starts; stride_c*: of count, diag and unmasked; stride_t*: of vstart and vend;
    stride_m*: of diag_mask; stride_w*: of vcols.
    """

    starts: Tensor
    count: Tensor
    diag: Tensor
    vstart: Tensor
    diag_mask: Tensor
    vcols: Tensor
    unmasked: Tensor | None
    vend: Tensor | None
    stride_sb: int
    stride_sh: int
    stride_st: int
    stride_cb: int
    stride_ch: int
    stride_tb: int
    stride_th: int
    stride_mb: int
    stride_mh: int
    stride_wb: int
    stride_wh: int

    @classmethod
    def of(
        cls,
        starts: Tensor,
        count: Tensor,
        diag: Tensor,
        vstart: Tensor,
        pair: ChunkPair,
        unmasked: Tensor | None = None,
        vend: Tensor | None = None,
    ) -> KeyWalk:
        """The walk of these lists (and ``pair``'s diagonal mask and vertical columns), with their strides."""
        s, m, w = starts.stride(), pair.diag_mask.stride(), pair.vcols.stride()
        cb, ch = _shared_strides(count, diag, unmasked)
        tb, th = _shared_strides(vstart, vend)
        lists = (starts, count, diag, vstart, pair.diag_mask, pair.vcols, unmasked, vend)
        return cls(*lists, s[0], s[1], s[2], cb, ch, tb, th, m[0], m[1], w[0], w[1])


def without_blocks(walk: QueryWalk | KeyWalk) -> QueryWalk | KeyWalk:
    """``walk`` with its block lists emptied (no listed block, no diagonal block; strides kept): the kernels
    then compute only the vertical columns that no selected block diagonal covers (they test each vertical
    against ``diag_mask``), the part a block-sparse kernel that computes the selected blocks leaves over
    (ops/sparse/fa4.py)."""
    unmasked = None if walk.unmasked is None else torch.zeros_like(walk.unmasked)
    return walk._replace(count=torch.zeros_like(walk.count), diag=torch.full_like(walk.diag, -1), unmasked=unmasked)


def _shared_strides(*lists: Tensor | None) -> tuple[int, int]:
    """The (batch, head) strides that ``lists`` [B, H, n] share (None: absent); the kernels index them alike."""
    present = [t for t in lists if t is not None]
    strides = {t.stride()[:2] for t in present}
    if len(strides) != 1 or len({t.shape for t in present}) != 1:
        raise ValueError(
            f"walk lists of one kind must share shape and strides, got {[tuple(t.stride()) for t in present]}"
        )
    return next(iter(strides))


class BlockBounds(NamedTuple):
    """The document bounds of each block of G local query rows: lo (its first row's), hi (its last row's);
    int32 [B or 1, nQB]. A key block [kG, kG + G) is seen iff kG + G - 1 >= lo, needs no mask iff kG >= hi."""

    lo: Tensor
    hi: Tensor

    def seen_and_plain(self, key_block: Tensor, q_block: Tensor | None, g: int) -> tuple[Tensor, Tensor]:
        """(seen, plain) for global key blocks ``key_block`` [B, H, N, D] met by local query blocks
        ``q_block`` (same shape, or None: the query blocks are dim 2, the query walk's case)."""
        if q_block is None:
            lo, hi = self.lo[:, None, :, None], self.hi[:, None, :, None]
        else:
            rows = torch.arange(self.lo.shape[0], device=q_block.device).view(-1, 1, 1, 1)
            index = q_block.clamp(min=0).long()
            lo, hi = self.lo[rows, index], self.hi[rows, index]
        return key_block * g + (g - 1) >= lo, key_block * g >= hi


def block_bounds(q_bound: Tensor, block_size: int) -> BlockBounds:
    """``BlockBounds`` of the rows' bounds q_bound [B or 1, Sq] (non-decreasing along each row)."""
    sq = q_bound.shape[1]
    last = torch.arange(block_size - 1, sq + block_size - 1, block_size, device=q_bound.device).clamp(max=sq - 1)
    return BlockBounds(q_bound[:, ::block_size].contiguous(), q_bound[:, last].contiguous())


def check_aligned_positions(pos: Tensor, block_size: int, name: str) -> None:
    """ValueError unless ``pos`` ascends in runs of ``block_size`` consecutive, block-aligned positions."""
    n = pos.shape[0]
    local = torch.arange(n, device=pos.device)
    run_start = pos[(local // block_size) * block_size].long()
    aligned = (run_start % block_size == 0) & (pos.long() == run_start + local % block_size)
    ok = bool(aligned.all() & (pos[1:] > pos[:-1]).all())
    if not ok:
        raise ValueError(
            f"{name} must hold ascending runs of {block_size} consecutive global positions starting at "
            f"multiples of {block_size} (the pattern's block size); shard the sequence with a layout from "
            "mtraining.parallel, or use dense attention for unaligned queries"
        )


def _block_starts(pos: Tensor, block_size: int, num_blocks: int) -> Tensor:
    """int32 [num_blocks]: local row where each global block starts, -1 where absent."""
    starts = torch.full((num_blocks,), -1, dtype=torch.int32, device=pos.device)
    local_starts = torch.arange(0, pos.shape[0], block_size, device=pos.device, dtype=torch.int32)
    starts[(pos[local_starts.long()] // block_size).long()] = local_starts
    return starts


def _block_lists(
    pattern: VerticalSlashPattern,
    gblock: Tensor,
    sign: int,
    other_block_start: Tensor,
    other_len: int,
    bounds: BlockBounds | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """For each local block of one side, the local starts of the other side's blocks it meets
    off the diagonal: global block ``gblock - delta`` (sign=-1, query side) or ``+ delta`` (sign=+1).

    Only blocks present on both sides are listed (``start >= 0``), so a diagonal that connects no
    block of this chunk pair drops out here without a separate test. With document ``bounds`` only the
    blocks some row's document reaches are listed; returns (starts, count, unmasked: how many of them,
    a prefix, need no document mask; None without bounds)."""
    nb = other_block_start.shape[0]
    g = pattern.block_size
    diags = pattern.block_diags
    real = torch.arange(diags.shape[-1], device=diags.device) < pattern.num_diags[..., None]
    other = gblock[None, None, :, None] + sign * diags[:, :, None, :]  # [B, H, nBlocks, D]
    ok = real[:, :, None, :] & (diags[:, :, None, :] > 0) & (other >= 0) & (other < nb)
    start = other_block_start[other.clamp(0, nb - 1).long()]
    ok &= start >= 0
    plain = None
    if bounds is not None:
        if sign < 0:  # this side holds the queries, the other the keys
            seen, plain = bounds.seen_and_plain(other, None, g)
        else:
            seen, plain = bounds.seen_and_plain(gblock[None, None, :, None].expand_as(other), start // g, g)
        ok &= seen
    starts, count = compact(start, ok, ABSENT, width=list_width(pattern, other_len))
    return starts, count, None if plain is None else (ok & plain).sum(-1, dtype=torch.int32)


def list_width(pattern: VerticalSlashPattern, other_len: int) -> int:
    """Width of a walk's block lists: a block meets each block of the other chunk (``other_len``
    rows) at most once, through at most every diagonal of the pattern. Host-known: no device sync."""
    return max(min(pattern.block_diags.shape[-1], -(-other_len // pattern.block_size)), 1)


@dataclass(frozen=True)
class ChunkPair:
    """What both walks need: positions, block starts, the diagonal mask, vertical columns of the key chunk."""

    q_pos: Tensor
    k_pos: Tensor
    q_block_start: Tensor
    k_block_start: Tensor
    diag_mask: Tensor
    vcols: Tensor
    vcol_pos: Tensor


class ColumnWalk(NamedTuple):
    """Each query block's own columns in this key chunk (forward, dQ, and the column dK/dV kernel); int32,
    built by ``of``; the kernels take it whole, its strides with it.

    rows [B, H, nQB, K]: local key rows of the block's columns that only the columns keep, ascending,
    padded with Sk; count [B, H, nQB]: how many. stride_x*: of rows; stride_c*: of count.
    """

    rows: Tensor
    count: Tensor
    stride_xb: int
    stride_xh: int
    stride_xt: int
    stride_cb: int
    stride_ch: int

    @classmethod
    def of(cls, rows: Tensor, count: Tensor) -> ColumnWalk:
        """The walk of these lists, with their strides."""
        return cls(rows, count, *rows.stride()[:3], *count.stride()[:2])


def column_walk_torch(pattern: VerticalSlashPattern, q_pos: Tensor, k_pos: Tensor) -> ColumnWalk:
    """The per-block columns of ``pattern`` (``block_cols``, required) that a chunk pair holds, seen from the
    query blocks: those present in the key chunk and not kept by a vertical or a selected block diagonal."""
    g, n = pattern.block_size, pattern.seq_len
    sk = k_pos.shape[0]
    q_gblock = _local_gblock(q_pos, g).long()
    cols = pattern.block_cols[:, :, q_gblock]  # [B, H, nQB, K] global positions, padded with n
    k_pos = k_pos.to(cols.dtype)
    local = torch.searchsorted(k_pos, cols.flatten(2)).view_as(cols).clamp(max=sk - 1)
    keep = (cols < n) & (k_pos[local] == cols)
    keep &= ~pattern.lines_keep(q_gblock, cols.clamp(max=n - 1))
    rows, count = compact(local, keep, sk, width=cols.shape[-1])
    return ColumnWalk.of(rows, count)


def chunk_pair_torch(pattern: VerticalSlashPattern, q_pos: Tensor, k_pos: Tensor) -> ChunkPair:
    """The part of the global pattern that a query chunk and a key chunk (global positions) share."""
    g, nb = pattern.block_size, pattern.num_blocks
    dev = q_pos.device
    q_pos, k_pos = q_pos.to(torch.int32), k_pos.to(torch.int32)
    sk = k_pos.shape[0]
    q_block_start = _block_starts(q_pos, g, nb)
    k_block_start = _block_starts(k_pos, g, nb)
    # column part: verticals whose key lives in this chunk, as local rows (padding: sk).
    vpos = pattern.vertical_pos
    real_v = torch.arange(vpos.shape[-1], device=dev) < pattern.num_verticals[..., None]
    local = torch.searchsorted(k_pos, vpos.contiguous()).clamp(max=sk - 1)
    vcols, _ = compact(local, real_v & (k_pos[local.long()] == vpos), sk, width=local.shape[-1])
    vcol_pos = torch.where(vcols < sk, k_pos[vcols.clamp(max=sk - 1).long()], ABSENT).contiguous()
    diag_mask = pattern.diag_mask()
    return ChunkPair(q_pos, k_pos, q_block_start, k_block_start, diag_mask.to(torch.int8).contiguous(), vcols, vcol_pos)


def _local_gblock(pos: Tensor, block_size: int) -> Tensor:
    """int32 [ceil(len / G)]: global block of each run of G local rows."""
    return (pos[::block_size] // block_size).to(torch.int32)


def query_walk_torch(pattern: VerticalSlashPattern, pair: ChunkPair, q_bound: Tensor | None = None) -> QueryWalk:
    """The global pattern restricted to a chunk pair, seen from the query blocks (``q_bound``: documents)."""
    g = pattern.block_size
    sq, sk = pair.q_pos.shape[0], pair.k_pos.shape[0]
    q_gblock = _local_gblock(pair.q_pos, g)
    bounds = None if q_bound is None else block_bounds(q_bound, g)
    starts, count, unmasked = _block_lists(pattern, q_gblock, -1, pair.k_block_start, sk, bounds)
    diag = torch.where(pair.diag_mask[..., :1] > 0, pair.k_block_start[q_gblock.long()], -1).to(torch.int32)
    q_last = pair.q_pos[torch.arange(g - 1, sq + g - 1, g, device=pair.q_pos.device).clamp(max=sq - 1)]
    heads = pair.vcols.shape[:2]
    vcount = torch.searchsorted(pair.vcol_pos, q_last.expand(*heads, -1).contiguous(), right=True)
    vfirst = None
    if bounds is not None:
        lo = bounds.lo[:, None, :].expand(*heads, -1).contiguous()
        vfirst = torch.searchsorted(pair.vcol_pos, lo).to(torch.int32).contiguous()
    return QueryWalk.of(
        q_gblock,
        starts,
        count,
        diag.contiguous(),
        pair.diag_mask,
        pair.vcols,
        vcount.to(torch.int32).contiguous(),
        unmasked,
        vfirst,
    )


def key_walk_torch(
    pattern: VerticalSlashPattern, pair: ChunkPair, v_chunk: int, q_bound: Tensor | None = None
) -> KeyWalk:
    """The global pattern restricted to a chunk pair, seen from the key blocks (verticals in chunks of
    ``v_chunk``; ``q_bound``: documents)."""
    g = pattern.block_size
    k_gblock = _local_gblock(pair.k_pos, g)
    bounds = None if q_bound is None else block_bounds(q_bound, g)
    starts, count, unmasked = _block_lists(pattern, k_gblock, +1, pair.q_block_start, pair.q_pos.shape[0], bounds)
    diag = torch.where(pair.diag_mask[..., :1] > 0, pair.q_block_start[k_gblock.long()], -1).to(torch.int32)
    first_row = torch.searchsorted(pair.q_pos, pair.vcol_pos[..., ::v_chunk].contiguous())
    vend = None
    if q_bound is not None:
        vpos = pair.vcol_pos
        width = vpos.shape[-1]
        chunks = -(-width // v_chunk)
        padded = torch.nn.functional.pad(vpos, (0, chunks * v_chunk - width), value=ABSENT)
        real = padded < ABSENT
        last = torch.where(real, padded, -1).view(*vpos.shape[:2], chunks, v_chunk).amax(-1)  # -1: no vertical
        rows = q_bound[:, None, :].expand(*vpos.shape[:2], -1).contiguous()
        vend = torch.searchsorted(rows, last.to(rows.dtype).contiguous(), right=True).to(torch.int32).contiguous()
    return KeyWalk.of(starts, count, diag.contiguous(), first_row.to(torch.int32).contiguous(), pair, unmasked, vend)

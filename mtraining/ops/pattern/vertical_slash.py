"""The vertical-slash sparsity pattern and its meaning on the global token grid.

A pattern says, per (batch, query head), which (query, key) pairs attention computes. It is
defined on *global* token positions so that one pattern means the same thing on one device and
in every context-parallel layout:

    pair (i, j) is kept  <=>  j <= i  and  ( j is a vertical of the head
                                             or  i // G - j // G is a selected block diagonal
                                             or  j is one of block_cols[i // G], the columns of i's block )

``G`` is the pattern's ``block_size`` (the kernel block). Slash lines (fixed offsets ``i - j = d``)
are stored as the block diagonals they cross, so the block part is computed block by block on the
global G-grid and verticals are computed column by column, each pair exactly once. Per-block columns
(optional, ``with_block_columns``) are key columns kept for the rows of one query block only, all of
them before the block's first row; only the torch backend computes them for now.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..documents import Documents


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


class LineLists(NamedTuple):
    """A pattern's index lists before they are cut to their widths (``line_lists``).

    block_diags int32 [B, H, num_blocks] ascending, padded with num_blocks; num_diags int32 [B, H];
    vertical_pos int32 [B, H, V] ascending, padded with seq_len; num_verticals int32 [B, H].
    """

    block_diags: Tensor
    num_diags: Tensor
    vertical_pos: Tensor
    num_verticals: Tensor

    def widths(self) -> tuple[Tensor, Tensor]:
        """Longest diagonal list and longest vertical list (0-d device tensors), what ``pattern`` needs."""
        return self.num_diags.amax(), self.num_verticals.amax()

    def pattern(self, seq_len: int, block_size: int, diag_width: int, vertical_width: int) -> VerticalSlashPattern:
        """The pattern, each list cut to its width (host ints, e.g. ``widths()`` fetched in one sync)."""
        return VerticalSlashPattern(
            seq_len,
            block_size,
            _cut(self.block_diags, diag_width),
            self.num_diags,
            _cut(self.vertical_pos, vertical_width),
            self.num_verticals,
        )


def line_lists(vertical_pos: Tensor, slash_offsets: Tensor, seq_len: int, block_size: int) -> LineLists:
    """Index lists of the pattern with verticals ``vertical_pos`` [B, H, V] and slashes ``slash_offsets``
    [B, H, S] (negative = padding), without a device sync. Entries must be < seq_len and a row's
    vertical positions distinct.

    Verticals: the row's positions sorted. Slashes: offset d crosses block diagonals d // G and
    ceil(d / G) (the same one when G divides d), marked on a [num_blocks] mask whose set entries,
    sorted, are the list.
    """
    num_blocks = -(-seq_len // block_size)
    verts = vertical_pos.masked_fill(vertical_pos < 0, seq_len).sort(-1).values.int()
    num_verticals = (verts < seq_len).sum(-1, dtype=torch.int32)
    beyond = num_blocks * block_size  # crosses only slot num_blocks, which is dropped: padding goes there
    offsets = slash_offsets.masked_fill(slash_offsets < 0, beyond).clamp_(max=beyond)
    mask = torch.zeros(*offsets.shape[:-1], num_blocks + 1, dtype=torch.bool, device=offsets.device)
    mask.scatter_(-1, offsets // block_size, True)
    mask.scatter_(-1, (offsets + (block_size - 1)) // block_size, True)
    mask = mask[..., :num_blocks]
    blocks = torch.arange(num_blocks, dtype=torch.int32, device=mask.device)
    diags = torch.where(mask, blocks, num_blocks).sort(-1).values
    return LineLists(diags, mask.sum(-1, dtype=torch.int32), verts, num_verticals)


def _cut(lists: Tensor, width: int) -> Tensor:
    """The first max(width, 1) entries of each row, contiguous."""
    width = max(width, 1)
    return lists if lists.shape[-1] == width else lists[..., :width].contiguous()


class ChunkPairCache:
    """What the kernels derive from one pattern per chunk pair (the walks of ops/sparse/launch.py),
    built once and reused by the forward, the backward and every ring step that meets the pair again.

    A chunk pair is its two position tensors themselves (and, with packed documents, the rows' left
    bounds): an entry is found only for the very same tensors, not modified in place since it was built
    (torch's version counter). Each entry holds its tensors, so their ids cannot be taken by other
    tensors while the cache lives; the cache lives as long as its pattern. Copies and pickles of a
    pattern start empty.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[tuple[Tensor, ...], Any]] = {}

    def get(
        self, kind: tuple, q_pos: Tensor, k_pos: Tensor, build: Callable[[], Any], q_bound: Tensor | None = None
    ) -> Any:
        """The entry ``kind`` of the chunk pair (q_pos, k_pos[, q_bound]), from ``build()`` the first time."""
        held = (q_pos, k_pos) if q_bound is None else (q_pos, k_pos, q_bound)
        key = (*kind, *((id(t), t._version) for t in held))
        hit = self._entries.get(key)
        if hit is None:
            hit = self._entries[key] = (held, build())
        return hit[1]

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __reduce__(self):
        return ChunkPairCache, ()


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
        block_cols: int32 [B, H, num_blocks, K] or None: per query block r, key columns kept for the
            block's rows only (``with_block_columns``), ascending, distinct, each < r * G, padded with seq_len.
    """

    seq_len: int
    block_size: int
    block_diags: Tensor
    num_diags: Tensor
    vertical_pos: Tensor
    num_verticals: Tensor
    block_cols: Tensor | None = None
    index_cache: ChunkPairCache = field(default_factory=ChunkPairCache, compare=False, repr=False)
    """The kernels' walks of each chunk pair this pattern met (ops/sparse/launch.py); lives with the pattern."""

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

    def to(self, device: torch.device | str) -> VerticalSlashPattern:
        return VerticalSlashPattern(
            self.seq_len,
            self.block_size,
            self.block_diags.to(device),
            self.num_diags.to(device),
            self.vertical_pos.to(device),
            self.num_verticals.to(device),
            None if self.block_cols is None else self.block_cols.to(device),
        )

    def with_block_columns(self, cols: Tensor) -> VerticalSlashPattern:
        """This pattern plus per-block columns: row i also keeps key j when j is one of cols[b, h, i // G].

        ``cols``: integer [B, H, num_blocks, K], any order; entries < 0 or >= seq_len are padding. Every
        real column of block r must be < r * G (before the block's first row, so all its rows see it)
        and appear once in its block. Sorted, padded with seq_len and checked in one device sync;
        returns a new pattern (with an empty index cache), without columns when none is real.
        """
        n, g, nb = self.seq_len, self.block_size, self.num_blocks
        if not isinstance(cols, Tensor) or cols.dtype == torch.bool or cols.is_floating_point() or cols.is_complex():
            raise ValueError(f"block columns must be an integer tensor, got {getattr(cols, 'dtype', type(cols))}")
        if cols.dim() != 4 or tuple(cols.shape[:3]) != (self.batch, self.heads, nb):
            raise ValueError(
                f"block columns must be [B, H, num_blocks, K] = [{self.batch}, {self.heads}, {nb}, K] for this "
                f"pattern (num_blocks = ceil({n} / {g})), got {tuple(cols.shape)}"
            )
        cols = cols.to(self.device, torch.int64)
        cols = cols.masked_fill((cols < 0) | (cols >= n), n).sort(-1).values
        real = cols < n
        starts = torch.arange(nb, device=self.device)[:, None] * g
        late = real & (cols >= starts)
        repeated = real[..., 1:] & (cols[..., 1:] == cols[..., :-1])
        any_real, any_late, any_repeated = torch.stack([real.any(), late.any(), repeated.any()]).tolist()  # one sync
        if any_late:
            b, h, r, k = (int(x) for x in late.nonzero()[0])
            raise ValueError(
                f"block columns must lie before their query block's first row: block {r} (first row {r * g}) of "
                f"batch {b}, head {h} holds column {int(cols[b, h, r, k])}, which not all of its rows may see; keep "
                "such keys with block diagonals or verticals, and pad with -1"
            )
        if any_repeated:
            b, h, r, k = (int(x) for x in repeated.nonzero()[0])
            raise ValueError(
                f"block columns repeat column {int(cols[b, h, r, k + 1])} in block {r} of batch {b}, head {h}; "
                "list each column once per block (pad with -1)"
            )
        return VerticalSlashPattern(
            n,
            g,
            self.block_diags,
            self.num_diags,
            self.vertical_pos,
            self.num_verticals,
            cols.int().contiguous() if any_real else None,
        )

    # ----------------------------------------------------------------- constructors
    @classmethod
    def from_masks(cls, diag_mask: Tensor, vertical_mask: Tensor, block_size: int) -> VerticalSlashPattern:
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
    ) -> VerticalSlashPattern:
        """Build from vertical positions [B, H, V] and slash offsets [B, H, S] (negative = padding).

        Entries must be < seq_len and a row's vertical positions distinct (top-k indices are). One device sync.
        """
        lists = line_lists(vertical_pos, slash_offsets, seq_len, block_size)
        verts = lists.vertical_pos  # sorted: a repeat sits next to itself
        repeated = ((verts[..., 1:] == verts[..., :-1]) & (verts[..., 1:] < seq_len)).any()
        outside = (vertical_pos >= seq_len).any() | (slash_offsets >= seq_len).any()
        *widths, repeats, out = torch.stack([*lists.widths(), repeated, outside]).tolist()  # one device sync
        if out:
            raise ValueError(f"vertical_pos and slash_offsets must be < seq_len ({seq_len}); use -1 for padding")
        if repeats:
            raise ValueError("vertical_pos repeats a position within a row; pass each vertical once per row")
        return lists.pattern(seq_len, block_size, *widths)

    @classmethod
    def dense(cls, batch: int, heads: int, seq_len: int, block_size: int, device=None) -> VerticalSlashPattern:
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
        k_col = k_pos.clamp(0, self.seq_len - 1)
        kept = in_block | self.vertical_mask()[:, :, k_col][:, :, None, :]
        if self.block_cols is not None:  # is k_pos[b] in the ascending column list of q_pos[a]'s block
            lists = self.block_cols[:, :, (q_pos // self.block_size).clamp(0, self.num_blocks - 1)]  # [B, H, Sq, K]
            keys = k_col.to(lists.dtype).expand(*lists.shape[:-1], -1).contiguous()
            slot = torch.searchsorted(lists, keys).clamp_(max=lists.shape[-1] - 1)
            kept |= lists.gather(-1, slot) == keys
        return causal & kept

    def kept_pairs(self, documents: Documents | None = None) -> Tensor:
        """Float64 [B, H]: number of causal (i, j) pairs the pattern keeps on the full sequence (with packed
        ``documents``: of pairs within one document)."""
        n, g, nb = self.seq_len, self.block_size, self.num_blocks
        dev = self.device
        if documents is None:
            last = n - g * (nb - 1)  # rows (and columns) of the last, possibly partial, block
            delta = torch.arange(nb, device=dev, dtype=torch.float64)
            # causal pairs on block diagonal delta: triangles on delta=0, full blocks elsewhere.
            per_diag = (nb - 1 - delta) * g * g + last * g
            per_diag[0] = (nb - 1) * g * (g + 1) / 2 + last * (last + 1) / 2
            per_diag = per_diag[None]
            ends = torch.full((1, 1, 1), n, dtype=torch.long, device=dev)
        else:
            per_diag = _document_pairs_per_diagonal(documents, n, g, dev)
            ends = _document_ends(documents, self.vertical_pos.long().clamp(max=n - 1))
        selected = self.diag_mask()
        block_pairs = (selected.double() * per_diag[:, None]).sum(-1)
        # a vertical j in key block kb adds the rows i >= j of its document (ending at `ends`, the sequence's
        # end without documents) whose diagonal is not selected.
        unselected = (~selected).double()  # [B, H, nb]
        prefix = unselected.clone()
        prefix[..., 0] = 0
        prefix = prefix.cumsum(-1)  # prefix[m] = sum_{1 <= delta <= m} unselected[delta]
        cols = self.vertical_pos.long().clamp(max=n - 1)
        real = torch.arange(cols.shape[-1], device=dev)[None, None, :] < self.num_verticals[..., None]
        kb = cols // g
        top = (ends - 1) // g - kb  # largest delta with a row block of the vertical's document
        last_rows = (ends - 1) % g + 1  # rows of that last block
        top_unselected = unselected.gather(-1, top.expand_as(kb))
        far_rows = g * prefix.gather(-1, top.expand_as(kb)) - torch.where(
            top >= 1, top_unselected * (g - last_rows), 0.0
        )
        own_rows = unselected[..., :1] * torch.minimum((kb + 1) * g, ends).sub(cols).double()
        vertical_pairs = ((far_rows + own_rows) * real).sum(-1)
        return block_pairs + vertical_pairs + self._block_column_pairs(documents)

    def _block_column_pairs(self, documents: Documents | None) -> Tensor:
        """Float64 [B, H]: pairs that only ``block_cols`` keeps. Column j of query block r adds nothing when
        it is a vertical or diagonal r - j // G is selected, else the rows of block r before the end of
        j's document (the sequence's end without documents): all rows of r lie after j."""
        if self.block_cols is None:
            return torch.zeros(self.batch, self.heads, dtype=torch.float64, device=self.device)
        n, g, nb = self.seq_len, self.block_size, self.num_blocks
        cols = self.block_cols.long().clamp(max=n - 1)  # [B, H, nb, K]
        blocks = torch.arange(nb, device=self.device)[:, None]
        row_end = ((blocks + 1) * g).clamp(max=n)  # the last block may be partial
        if documents is not None:
            row_end = torch.minimum(row_end, _document_ends(documents, cols))
        rows = (row_end - blocks * g).clamp(min=0)
        adds = (self.block_cols < n) & ~self.lines_keep(torch.arange(nb, device=self.device), cols)
        return (rows * adds).sum((-2, -1), dtype=torch.float64)

    def lines_keep(self, q_block: Tensor, cols: Tensor) -> Tensor:
        """Boolean like ``cols`` [B, H, R, K]: do the lines already keep key position cols[..., r, :] (< seq_len,
        before the block) for the rows of global query block q_block[r]: a vertical of the head, or a key on a
        selected block diagonal (q_block - col // G). A per-block column there adds no pair."""
        delta = (q_block[:, None] - cols // self.block_size).clamp(min=0).long()
        on_diagonal = self.diag_mask().gather(-1, delta.flatten(2)).view_as(cols)
        verticals = self.vertical_pos  # ascending, padded with seq_len: a real column never equals the padding
        flat = cols.flatten(2).to(verticals.dtype)
        slot = torch.searchsorted(verticals, flat).clamp(max=verticals.shape[-1] - 1)
        return on_diagonal | (verticals.gather(-1, slot) == flat).view_as(cols)

    def density(self, documents: Documents | None = None) -> Tensor:
        """Float64 [B, H]: kept causal pairs / all causal pairs of the full sequence (with packed
        ``documents``: kept pairs / the causal pairs within documents, what dense attention computes)."""
        if documents is None:
            return self.kept_pairs() / (self.seq_len * (self.seq_len + 1) / 2)

        def build() -> Tensor:
            lengths = [documents.lengths(b).double() for b in range(documents.batch)]
            return torch.stack([(x * (x + 1) / 2).sum() for x in lengths]).to(self.device)

        total = documents.cached(("causal pairs", self.device), build)
        return self.kept_pairs(documents) / total[:, None]


def attention_mask(
    q_pos: Tensor, k_pos: Tensor, pattern: VerticalSlashPattern | None, q_bound: Tensor | None = None
) -> Tensor:
    """Boolean [B or 1, H or 1, Sq, Sk] of the pairs computed: causal by position, then the pattern, then
    (``q_bound`` [B or 1, Sq]: the left bound of each row's keys, ``Documents.left_bounds``) the documents."""
    if pattern is None:
        allowed = (k_pos[None, :].long() <= q_pos[:, None].long())[None, None]
    else:
        allowed = pattern.pair_mask(q_pos, k_pos)
    if q_bound is not None:
        allowed = allowed & (k_pos.long()[None, None, None, :] >= q_bound.long()[:, None, :, None])
    return allowed


def _document_pairs_per_diagonal(documents: Documents, n: int, g: int, device: torch.device) -> Tensor:
    """Float64 [B or 1, nb]: pairs (i, j) with bound(i) <= j <= i on each block diagonal of the G-grid over positions
    0..n-1, from every position's left bound (``Documents.left_bounds``), kept on ``documents`` per (n, g, device):
    every layer's density reads them. Row i meets diagonal 0 from max(bound, its block's start) to i, the diagonal
    ``top`` of its bound's block from the bound to that block's end, and G keys on every diagonal between (added
    through a difference array)."""

    def build() -> Tensor:
        nb = -(-n // g)
        rows = torch.arange(n, device=device)
        lo = documents.left_bounds(rows).long()
        b = lo.shape[0]
        rows = rows.expand(b, -1)
        top = rows // g - lo // g
        pairs = torch.zeros(b, nb, dtype=torch.float64, device=device)
        pairs[:, 0] = (rows - torch.maximum(lo, rows // g * g) + 1).sum(-1).double()
        pairs.scatter_add_(1, top, torch.where(top >= 1, (lo // g * g + g - lo).double(), 0.0))
        middle = top >= 2
        steps = torch.zeros(b, nb + 1, dtype=torch.float64, device=device)
        steps[:, 1] = g * middle.sum(-1).double()
        steps.scatter_add_(1, top, middle.double() * -g)
        return pairs + steps.cumsum(-1)[:, :nb]

    return documents.cached(("pairs per diagonal", n, g, device), build)


def _document_ends(documents: Documents, cols: Tensor) -> Tensor:
    """int64 shaped like cols [B, ...]: where the document of each key position in cols ends (exclusive)."""
    dev = cols.device
    ends = documents.cached(("ends", dev), lambda: documents.ends(torch.arange(documents.seq_len, device=dev)))
    if ends.shape[0] == 1:
        return ends[0][cols]
    return ends[torch.arange(cols.shape[0], device=cols.device).view(-1, *(1,) * (cols.dim() - 1)), cols]

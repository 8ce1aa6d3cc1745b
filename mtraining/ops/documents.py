"""Packed documents: where each document of a packed sequence starts, and what that means for attention.

A packed sequence of N tokens holds several documents back to back: contiguous ranges of global
positions. With document masking, pair (i, j) is computed iff j <= i, doc(i) == doc(j) and the pattern
keeps it. For j <= i, doc(i) == doc(j) iff j >= start(doc(i)), so the mask is a per-query *left bound*:
``left_bounds(pos)`` gives, per batch row, the global position of the first token of each position's
document. That bound travels with the query rows like their positions (one int32 per row), whatever
the layout or ring step; the kernels test ``k_pos >= bound`` next to the causal ``k_pos <= q_pos``.

``Documents`` holds the boundaries on the host (cu_seqlens style), so the decisions that need them (which
key blocks a query block can see, which ring steps compute at all, the dense blocks) are taken without
a device sync. One row of boundaries may stand for every batch row. A batch in which every row is one
document is today's behaviour exactly: entry points turn it into ``None`` (``resolve_documents``).

Packed position ids are read by one rule, ``document_starts`` (flash-attention's varlen convention): a
document starts at the first token and wherever a position id does not continue the previous one
(``pos[i] != pos[i - 1] + 1``), so ids restarting at 0, or at any other value, start a document. Every path
that reads documents from position ids (one device, the Hugging Face model, context parallelism on the
gathered global ids) calls it. What it cannot read (negative ids, fractional or falling boundaries) is
refused with a ValueError naming the fix.

``estimate_end`` marks the positions that take no part in estimating a sparse pattern (ops/pattern): from
it on no row scores lines or ranks block columns and no document forces sinks. Evaluation uses it for a
padding document after a prompt (a layout splits only multiples of its unit) and for answer tokens scored
teacher-forced, which attend to the prompt but must not choose the pattern they are read with. Attention
itself ignores it: those rows attend as any others, within their documents and the pattern.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import Tensor


class Documents:
    """Document starts of packed sequences of ``seq_len`` tokens, per batch row (or one row for all).

    Build with ``from_cu_seqlens`` (boundaries, flash-attention's varlen convention), ``from_lengths``
    or ``from_position_ids`` (packed position ids of the whole sequence, read by ``document_starts``).

    Attributes:
        seq_len: N, the packed sequence length.
        starts: per batch row, an int64 CPU tensor of the global positions where documents start,
            strictly ascending, starting with 0.
        estimate_end: positions >= this take no part in estimating a sparse pattern (module docstring);
            None: every position does.
    """

    def __init__(self, starts: Sequence[Sequence[int] | Tensor], seq_len: int, estimate_end: int | None = None) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
        if estimate_end is not None and (
            isinstance(estimate_end, bool) or not isinstance(estimate_end, int) or not 1 <= estimate_end <= seq_len
        ):
            raise ValueError(
                f"estimate_end must be None or an int in [1, seq_len={seq_len}] (the first position that does not "
                f"estimate), got {estimate_end!r}"
            )
        if isinstance(starts, (str, bytes)) or not isinstance(starts, (Sequence, Tensor)) or len(starts) == 0:
            raise ValueError(f"documents need a list of starts per batch row, got {starts!r}")
        rows = []
        for b, row in enumerate(starts):
            t = _integers(row, f"document starts of batch row {b}")
            if t.numel() == 0 or int(t[0]) != 0:
                raise ValueError(f"batch row {b}: the first document must start at position 0, got {t.tolist()[:4]}")
            if bool((t[1:] <= t[:-1]).any()) or int(t[-1]) >= seq_len:
                raise ValueError(
                    f"batch row {b}: document starts must rise strictly and stay below seq_len {seq_len} "
                    "(an empty document is not a document: drop repeated boundaries)"
                )
            rows.append(t)
        self.seq_len = seq_len
        self.starts: tuple[Tensor, ...] = tuple(rows)
        self.estimate_end = None if estimate_end == seq_len else estimate_end
        self._device_starts: dict[torch.device, Tensor] = {}
        self._cache: dict[tuple, object] = {}
        self._digest: str | None = None

    # ----------------------------------------------------------------- constructors
    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: Sequence[int] | Tensor | Sequence[Sequence[int] | Tensor]) -> Documents:
        """From cumulative lengths [0, l0, l0 + l1, ..., N] (flash-attention's cu_seqlens), one list per
        batch row or one list for every row; N (the last entry) is the sequence length. Integers rising
        strictly from 0 (every document holds a token), every row ending at the same N."""
        rows = [_integers(r, f"cu_seqlens row {b}") for b, r in enumerate(_rows(cu_seqlens, "cu_seqlens"))]
        for b, t in enumerate(rows):
            if t.numel() < 2 or int(t[0]) != 0:
                raise ValueError(f"cu_seqlens row {b} must run from 0 to the sequence length, got {t.tolist()[:8]}")
            falls = (t[1:] <= t[:-1]).nonzero()
            if falls.numel():
                i = int(falls[0]) + 1
                raise ValueError(
                    f"cu_seqlens row {b} must rise strictly (each document holds at least one token), but entry {i} "
                    f"is {int(t[i])} after {int(t[i - 1])}; drop repeated boundaries and sort them"
                )
        ends = {int(t[-1]) for t in rows}
        if len(ends) != 1:
            raise ValueError(f"cu_seqlens rows must all end at the sequence length, got ends {sorted(ends)}")
        return cls([t[:-1] for t in rows], ends.pop())

    @classmethod
    def from_lengths(
        cls, lengths: Sequence[int] | Tensor | Sequence[Sequence[int] | Tensor], estimate_end: int | None = None
    ) -> Documents:
        """From document lengths in order (integers >= 1), one list per batch row (or one list for every row)."""
        rows = [_integers(r, f"document lengths of row {b}") for b, r in enumerate(_rows(lengths, "lengths"))]
        if any(r.numel() == 0 or bool((r < 1).any()) for r in rows):
            raise ValueError("document lengths must be >= 1, at least one per batch row")
        cu = cls.from_cu_seqlens([torch.cat([r.new_zeros(1), r.cumsum(0)]) for r in rows])
        return cu if estimate_end is None else cls(cu.starts, cu.seq_len, estimate_end)

    @classmethod
    def from_position_ids(cls, position_ids: Tensor) -> Documents:
        """From packed position ids [B, N] (or [N]) of the whole sequence: a document starts wherever an id
        does not continue the previous one (``document_starts``)."""
        starts = document_starts(position_ids)
        return cls(starts, int(torch.as_tensor(position_ids).shape[-1]))

    # ----------------------------------------------------------------- facts
    @property
    def batch(self) -> int:
        """Batch rows described (1: the same boundaries for every row)."""
        return len(self.starts)

    @property
    def single(self) -> bool:
        """Every row is one document and every position estimates: nothing to mask or leave out
        (``resolve_documents`` turns this into None)."""
        return self.estimate_end is None and all(r.numel() == 1 for r in self.starts)

    @property
    def estimated_len(self) -> int:
        """The positions that take part in estimating a pattern: 0 .. estimated_len - 1."""
        return self.seq_len if self.estimate_end is None else self.estimate_end

    @property
    def shared(self) -> bool:
        """Every batch row has the same boundaries."""
        return all(torch.equal(r, self.starts[0]) for r in self.starts[1:])

    def lengths(self, row: int = 0) -> Tensor:
        """int64 [documents]: the lengths of batch row ``row``'s documents."""
        starts = self.starts[row]
        return torch.cat([starts[1:], starts.new_tensor([self.seq_len])]) - starts

    def digest(self) -> str:
        """A short hex digest of the boundaries: equal on every process for equal documents."""
        if self._digest is None:
            h = hashlib.blake2b(digest_size=8)
            h.update(f"{self.seq_len}:{self.estimate_end}".encode())
            for r in self.starts:
                h.update(b"|" + r.numpy().tobytes())
            self._digest = h.hexdigest()
        return self._digest

    def __repr__(self) -> str:
        counts = [r.numel() for r in self.starts]
        end = "" if self.estimate_end is None else f", estimate_end={self.estimate_end}"
        return f"Documents(seq_len={self.seq_len}, batch={self.batch}, documents={counts}{end}, digest={self.digest()})"

    # ----------------------------------------------------------------- per position
    def _padded(self, device: torch.device) -> Tensor:
        """int64 [batch, most documents] starts padded with seq_len, on ``device`` (kept per device)."""
        if device not in self._device_starts:
            width = max(r.numel() for r in self.starts)
            pad = torch.full((self.batch, width), self.seq_len, dtype=torch.int64)
            for b, r in enumerate(self.starts):
                pad[b, : r.numel()] = r
            self._device_starts[device] = pad.to(device)
        return self._device_starts[device]

    def doc_ids(self, pos: Tensor) -> Tensor:
        """int64 [batch, len(pos)]: the index of each position's document in its batch row."""
        pos = pos.reshape(1, -1).long()
        starts = self._padded(pos.device)
        return torch.searchsorted(starts, pos.expand(self.batch, -1).contiguous(), right=True) - 1

    def left_bounds(self, pos: Tensor) -> Tensor:
        """int32 [batch, len(pos)] on pos's device: the global position where each position's document
        starts (the left bound of its keys). No device sync."""
        starts = self._padded(pos.device)
        return starts.gather(1, self.doc_ids(pos)).to(torch.int32).contiguous()

    def ends(self, pos: Tensor) -> Tensor:
        """int64 [batch, len(pos)] on pos's device: where each position's document ends (exclusive)."""
        starts = self._padded(pos.device)
        nexts = torch.cat([starts[:, 1:], torch.full_like(starts[:, :1], self.seq_len)], 1)
        return nexts.gather(1, self.doc_ids(pos))

    def cached(self, key: tuple, build):
        """A value derived from these documents (per-rank bounds, ring decisions, a call's default positions and
        scoring rows: the same for every layer of a forward), built once per key."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]


def document_starts(position_ids: Tensor) -> list[Tensor]:
    """Per batch row of packed position ids [B, N] (or [N]) of the whole sequence, the indices where
    documents start (int64, ascending, from 0): the first token, and every token whose id does not continue
    the previous one (``pos[i] != pos[i - 1] + 1``; flash-attention's varlen convention). The one rule by
    which position ids mark documents. Ids must be integers >= 0 (one device sync for device tensors)."""
    if not isinstance(position_ids, Tensor):
        raise ValueError(f"position_ids must be an integer tensor [batch, seq_len], got {type(position_ids).__name__}")
    ids = position_ids[None] if position_ids.dim() == 1 else position_ids
    if ids.dim() != 2 or ids.shape[1] == 0 or not _is_integer(ids.dtype):
        raise ValueError(
            f"position_ids must be integers [batch, seq_len] with seq_len >= 1, got {tuple(position_ids.shape)} "
            f"{position_ids.dtype}"
        )
    ids = ids.detach().to("cpu", torch.int64)
    if bool((ids < 0).any()):
        b, i = (int(x) for x in (ids < 0).nonzero()[0])
        raise ValueError(
            f"position ids must be >= 0 (a token's position within its document or sequence), got {int(ids[b, i])} "
            f"at batch row {b}, index {i}; pass the positions RoPE should see, or the boundaries as "
            "documents=Documents.from_cu_seqlens(...)"
        )
    new = torch.ones_like(ids, dtype=torch.bool)
    new[:, 1:] = ids[:, 1:] != ids[:, :-1] + 1
    return [row.nonzero().reshape(-1) for row in new]


def _is_integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _integers(value: object, what: str) -> Tensor:
    """``value`` as a 1-D int64 CPU tensor, or a ValueError naming ``what`` when it is not a flat list of integers
    (fractions are refused, never truncated)."""
    try:
        t = torch.as_tensor(value).detach()
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{what} must be a flat list of integers, got {value!r} ({e})") from None
    if t.dim() > 1 or not _is_integer(t.dtype):
        raise ValueError(
            f"{what} must be a flat list of integers (token counts and positions), got {t.dtype} "
            f"{t.reshape(-1).tolist()[:8]}; pass whole numbers (an int tensor or list of ints)"
        )
    return t.to("cpu", torch.int64).reshape(-1)


def _rows(value: object, what: str) -> list:
    """One row (a flat list or 1-D tensor) as [row]; a list of rows or a 2-D tensor as its rows."""
    if not isinstance(value, Tensor) and getattr(value, "ndim", 0) >= 1:  # a NumPy array
        value = torch.as_tensor(value)
    if isinstance(value, Tensor):
        if value.dim() == 0 or value.dim() > 2:
            raise ValueError(f"{what} must be one row or one row per batch row (1-D or 2-D), got {tuple(value.shape)}")
        return [value] if value.dim() == 1 else list(value)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) == 0:
        raise ValueError(f"{what} must be a list of integers, or one such list per batch row, got {value!r}")
    value = list(value)
    first = value[0]
    if (isinstance(first, (Sequence, Tensor)) and not isinstance(first, (str, bytes))) or getattr(first, "ndim", 0):
        return value
    return [value]


def resolve_documents(
    documents: Documents | None, batch: int, seq_len: int | None = None, span: tuple[int, int] | None = None
) -> Documents | None:
    """``documents`` checked against a call of ``batch`` rows on a sequence of ``seq_len`` tokens (or whose
    positions lie in ``span`` = (smallest, largest)), or None when there is nothing to mask (None, or one
    document per row: exactly today's attention)."""
    if documents is None:
        return None
    if not isinstance(documents, Documents):
        raise ValueError(
            f"documents must be a mtraining.ops.Documents (Documents.from_cu_seqlens(...)), got "
            f"{type(documents).__name__}"
        )
    if span is not None and span[1] >= documents.seq_len:
        raise ValueError(
            f"documents describe a sequence of {documents.seq_len} tokens but the positions reach {span[1]}; "
            "build them for the packed sequence these positions index"
        )
    if seq_len is not None and documents.seq_len != seq_len:
        raise ValueError(
            f"documents describe a sequence of {documents.seq_len} tokens but this call's is {seq_len}; "
            "build them for the packed sequence these positions index"
        )
    if documents.batch not in (1, batch):
        raise ValueError(
            f"documents have {documents.batch} batch rows but the call has batch {batch}; give one row of "
            "boundaries per batch row, or one row for all"
        )
    return None if documents.single else documents

"""Token ids on disk, memory-mapped: token files and concatenated streams read one window at a time.

A ``TokenStream`` is one or more 1-D memory-mapped arrays end to end. Reading a window copies only
that window (as int64); nothing ever holds the whole stream in memory, so a 10B-token corpus costs
each rank its page-cache footprint of the windows it reads.

A ``.npy`` file says its element type in its header (``mtraining tokenize`` writes them); a raw ``.bin``
file does not, so ``scan_max`` checks that the type it is read with fits its bytes: a size that is not a
multiple of the type, or zeros at every second (or fourth) id, which is what ids of a wider type look
like read with a narrower one, are refused; ids read with a wider type than written pair up into ids
beyond the vocabulary, which the trainer refuses (train/data.py, ``check_vocabulary``).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .documents import DataError

_SCAN_TOKENS = 1 << 24  # tokens per read when scanning a file (64 MB of uint32)
_EVIDENCE = 64  # ids a raw file needs before zeros at every second id say that its type is wrong
_TYPES = ("uint16", "uint32", "int32", "int64")


def open_token_file(path: Path, token_dtype: str = "uint32") -> np.ndarray:
    """The token ids of a ``.npy`` file, or a raw ``.bin`` of ``token_dtype``, memory-mapped read-only."""
    try:
        if path.suffix == ".npy":
            tokens = np.load(path, mmap_mode="r")
        else:
            itemsize = np.dtype(token_dtype).itemsize
            if (size := os.path.getsize(path)) % itemsize:
                raise DataError(
                    f"{path} has {size} bytes, not a multiple of {itemsize}: it does not hold {token_dtype} ids; "
                    f"set data.token_dtype to the type it was written with (one of {', '.join(_TYPES)})"
                )
            tokens = np.memmap(path, dtype=np.dtype(token_dtype), mode="r")
    except (ValueError, OSError) as err:
        if isinstance(err, DataError):
            raise
        raise DataError(f"{path} cannot be read as a token file ({err})") from None
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise DataError(f"{path} must hold a 1-D integer array of token ids, got {tokens.dtype} {tokens.shape}")
    return tokens


def scan_max(path: Path, token_dtype: str = "uint32", separator: int | None = None) -> int:
    """Largest token id of a token file, read in chunks through one buffer (no mapping of the whole file).

    DataError for a negative id, for a raw file whose ids look like a wider type's (module docstring), and, with
    ``separator`` (document masking finds documents by it), for a file that never holds that id."""
    tokens = open_token_file(path, token_dtype)
    if not len(tokens):
        raise DataError(f"{path} holds no tokens")
    offset = tokens.offset if isinstance(tokens, np.memmap) else 0
    dtype, count = tokens.dtype, len(tokens)
    del tokens
    # raw files: the factors f (wider type = f x this one) whose ids off the multiples of f are all zero so far
    zero_between = [f for f in (2, 4) if path.suffix != ".npy" and f * dtype.itemsize <= 8 and count % f == 0]
    best, separated = 0, separator is None
    buffer = np.empty(min(count, _SCAN_TOKENS), dtype=dtype)
    with open(path, "rb") as f:
        f.seek(offset)
        done = 0
        while done < count:
            n = f.readinto(memoryview(buffer[: min(_SCAN_TOKENS, count - done)]).cast("B")) // dtype.itemsize
            if n == 0:
                raise DataError(f"{path} ended after {done} of {count} tokens; the file is truncated")
            chunk = buffer[:n]
            if dtype.kind == "i" and chunk.min() < 0:
                raise DataError(f"{path} holds a negative token id near token {done}; token ids are >= 0")
            best = max(best, int(chunk.max()))
            separated = separated or bool((chunk == separator).any())
            if zero_between:
                nonzero = np.count_nonzero(chunk)
                zero_between = [k for k in zero_between if np.count_nonzero(chunk[(-done) % k :: k]) == nonzero]
            done += n
    if not separated:
        raise DataError(
            f"{path} never holds the separator id {separator}, so data.document_masking would find no documents "
            "in it; write it with the separator after each document (mtraining corpus and tokenize do), set "
            "data.separator to the token its documents end with, or set data.document_masking: false"
        )
    if zero_between and count >= _EVIDENCE:
        factor = max(zero_between)
        wider = {4: "uint32 (or int32)", 8: "int64"}[factor * dtype.itemsize]
        raise DataError(
            f"{path} read as data.token_dtype={dtype.name} holds {count} ids of which only every "
            f"{'second' if factor == 2 else 'fourth'} one is not 0, which is how {wider} ids read with a narrower "
            f"type look; set data.token_dtype={wider.split()[0]}"
        )
    return best


@dataclass(frozen=True)
class TokenPart:
    """One file of a token stream as every rank opens it: a token file, or a text file's tokens in the cache.

    ``origin`` is the data file the ids come from (the text file of a cache entry); ``max_id`` its largest id.
    """

    path: str
    dtype: str
    tokens: int
    max_id: int
    origin: str

    def open(self) -> np.ndarray:
        tokens = open_token_file(Path(self.path), self.dtype)
        if len(tokens) != self.tokens:
            raise DataError(
                f"{self.path} holds {len(tokens)} tokens, {self.tokens} when it was read at start-up: it changed "
                "while the run started; leave data files as they are while a run starts"
            )
        return tokens


class TokenStream:
    """Several 1-D token arrays read as one stream; ``read(start, stop)`` copies one window as int64."""

    def __init__(self, parts: Sequence[np.ndarray]) -> None:
        self.parts = [p for p in parts if len(p)]
        self.ends = np.cumsum([len(p) for p in self.parts]).tolist()

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) as a new int64 array."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"window [{start}, {stop}) is outside the stream of {len(self)} tokens")
        out = np.empty(stop - start, dtype=np.int64)
        part = bisect.bisect_right(self.ends, start)
        filled = 0
        while filled < len(out):
            begin = self.ends[part - 1] if part else 0
            lo = start + filled - begin
            hi = min(len(self.parts[part]), lo + len(out) - filled)
            out[filled : filled + hi - lo] = self.parts[part][lo:hi]
            filled += hi - lo
            part += 1
        return out

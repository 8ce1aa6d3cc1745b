"""Token ids on disk, memory-mapped: token files and concatenated streams read one window at a time.

A ``TokenStream`` is one or more 1-D memory-mapped arrays end to end. Reading a window copies only
that window (as int64); nothing ever holds the whole stream in memory, so a 10B-token corpus costs
each rank its page-cache footprint of the windows it reads.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .documents import DataError

_SCAN_TOKENS = 1 << 24  # tokens per read when scanning a file (64 MB of uint32)


def open_token_file(path: Path, token_dtype: str = "uint32") -> np.ndarray:
    """The token ids of a ``.npy`` file, or a raw ``.bin`` of ``token_dtype``, memory-mapped read-only."""
    try:
        if path.suffix == ".npy":
            tokens = np.load(path, mmap_mode="r")
        else:
            tokens = np.memmap(path, dtype=np.dtype(token_dtype), mode="r")
    except (ValueError, OSError) as err:
        raise DataError(f"{path} cannot be read as a token file ({err})") from None
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise DataError(f"{path} must hold a 1-D integer array of token ids, got {tokens.dtype} {tokens.shape}")
    return tokens


def scan_max(path: Path, token_dtype: str = "uint32") -> int:
    """Largest token id of a token file, read in chunks through one buffer (no mapping of the whole file)."""
    tokens = open_token_file(path, token_dtype)
    if not len(tokens):
        raise DataError(f"{path} holds no tokens")
    offset = tokens.offset if isinstance(tokens, np.memmap) else 0
    dtype, count = tokens.dtype, len(tokens)
    del tokens
    best = 0
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
            done += n
    return best


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

"""Tokenise each text file once, into a cache keyed by its content and the tokenizer.

The cache folder (``data.cache_dir``; default ``$MTRAINING_CACHE``, else ``~/.cache/mtraining``) holds
``tokens/<key>.bin``: the file's documents tokenised (blank ones skipped), each followed by the separator id
(uint16 when the vocabulary fits, else uint32), and ``tokens/<key>.json``, its record (written last: an entry without its
record does not exist; one whose ids file is not the size its record says is written again). ``key`` =
sha256 of the format version, the file's sha256, the tokenizer.json's sha256, how text is tokenised
(``TEXT_OPTIONS``: special-token strings are text), the text field and the separator id. A document holding
the separator id is refused (the separator must be a special token).

The file's SHA-256 is computed from its bytes at every start (0.8 CPU-seconds per GiB measured here, where
xxh3-128 takes 0.2 and BLAKE2b 1.35), so a file rewritten with the same size and modification time is
tokenised again, never served stale.

Files are written under a temporary name and renamed, so concurrent writers (one per node) and
interrupted runs never leave a half-written entry behind.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .documents import DataError, read_documents
from .tokenizer import TEXT_OPTIONS, Tokenizer, refuse_separator_inside

FORMAT = "mtraining-tokens-2"
_BATCH_DOCS = 256
_BATCH_CHARS = 16 << 20
_HASH_CHUNK = 16 << 20


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes, read in chunks (the token cache's key, checkpoints' manifests)."""
    digest, buffer = hashlib.sha256(), bytearray(_HASH_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def default_cache_dir() -> Path:
    if "MTRAINING_CACHE" in os.environ:
        return Path(os.environ["MTRAINING_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mtraining"


@dataclass(frozen=True)
class CachedTokens:
    """One text file's tokens in the cache."""

    path: str
    dtype: str
    tokens: int
    documents: int
    max_id: int
    source: str
    tokenizer: str

    def open(self) -> np.ndarray:
        return np.memmap(self.path, dtype=np.dtype(self.dtype), mode="r", shape=(self.tokens,))


def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class TokenCache:
    """The cache folder of tokenised text files."""

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_cache_dir()

    def _folder(self, name: str) -> Path:
        folder = self.root / name
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise DataError(
                f"cannot create the token cache {folder} ({err.strerror}); set data.cache_dir to a writable folder"
            ) from None
        return folder

    def _entry(self, path: Path, tokenizer: Tokenizer, text_field: str, separator_id: int) -> Path:
        if tokenizer.fingerprint is None:
            raise DataError(f"{tokenizer.path} is not one tokenizer.json; token caches need one (data.tokenizer)")
        options = json.dumps(TEXT_OPTIONS, sort_keys=True)
        parts = (FORMAT, file_digest(path), tokenizer.fingerprint, options, text_field, str(separator_id))
        return self._folder("tokens") / hashlib.sha256("|".join(parts).encode()).hexdigest()

    @staticmethod
    def _read(entry: Path) -> CachedTokens | None:
        """The entry's tokens; None when its record is missing or unreadable, or its ids file is not the size
        the record says (then it is written again)."""
        meta, ids = entry.with_suffix(".json"), entry.with_suffix(".bin")
        if not meta.is_file():
            return None
        try:
            cached = CachedTokens(path=str(ids), **json.loads(meta.read_text()))
        except (ValueError, TypeError):
            return None
        whole = ids.is_file() and ids.stat().st_size == cached.tokens * np.dtype(cached.dtype).itemsize
        return cached if whole else None

    def lookup(self, path: Path, tokenizer: Tokenizer, text_field: str, separator_id: int) -> CachedTokens | None:
        """The cached tokens of a text file, or None when it was not tokenised yet."""
        return self._read(self._entry(path, tokenizer, text_field, separator_id))

    def tokenize(
        self,
        path: Path,
        tokenizer: Tokenizer,
        text_field: str,
        separator_id: int,
        log: Callable[[str], None] = print,
    ) -> CachedTokens:
        """The cached tokens of a text file, tokenising it first if needed."""
        entry = self._entry(path, tokenizer, text_field, separator_id)
        found = self._read(entry)
        if found is not None:
            return found
        dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
        log(f"tokenising {path} into {entry}.bin")
        stats = {"tokens": 0, "documents": 0, "max_id": -1}
        separator = np.asarray([separator_id], dtype=np.int64)
        blank = [0]

        def written(docs: Iterator[str]) -> Iterator[str]:
            for doc in docs:
                if doc.strip():
                    yield doc
                else:
                    blank[0] += 1

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as out:
                for batch in _batches(written(read_documents(path, text_field))):
                    docs = [np.asarray(doc, dtype=np.int64) for doc in tokenizer.encode(batch)]
                    for n, doc in enumerate(docs, start=stats["documents"] + 1):
                        refuse_separator_inside(doc, separator_id, tokenizer, f"{path}: document {n}")
                    array = np.concatenate([part for doc in docs for part in (doc, separator)])
                    stats["tokens"] += len(array)
                    stats["documents"] += len(batch)
                    stats["max_id"] = max(stats["max_id"], int(array.max()))
                    array.astype(dtype).tofile(out)

        bin_path = entry.with_suffix(".bin")
        _write_atomic(bin_path, write)
        if not stats["tokens"]:
            raise DataError(f"{path} holds no documents" + (f", only {blank[0]} blank ones" if blank[0] else ""))
        cached = CachedTokens(
            path=str(bin_path),
            dtype=dtype.name,
            source=str(path),
            tokenizer=str(tokenizer.path),
            **stats,
        )
        record = {k: v for k, v in asdict(cached).items() if k != "path"}  # the .bin lies beside its record
        _write_atomic(entry.with_suffix(".json"), lambda tmp: tmp.write_text(json.dumps(record)))
        return cached


def _batches(docs: Iterator[str]) -> Iterator[list[str]]:
    """Documents in groups of at most _BATCH_DOCS documents or about _BATCH_CHARS characters."""
    batch, chars = [], 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch

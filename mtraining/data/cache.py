"""Tokenise each text file once, into a cache keyed by its content and the tokenizer.

The cache folder (``data.cache_dir``; default ``$MTRAINING_CACHE``, else ``~/.cache/mtraining``) holds

- ``tokens/<key>.bin``: the file's documents tokenised, each followed by the separator id (uint16
  when the vocabulary fits, else uint32), and ``tokens/<key>.json``, its record (written last: an
  entry without its record does not exist). ``key`` = sha256 of the format version, the file's
  sha256, the tokenizer.json's sha256, the text field and the separator id;
- ``files/<key>.json``: what is known of a file (its sha256; for token files their largest id),
  keyed by its path, size and modification time, so a file is read in full once, not at every start.

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
from .tokenizer import Tokenizer
from .tokens import scan_max

FORMAT = "mtraining-tokens-1"
_BATCH_DOCS = 256
_BATCH_CHARS = 16 << 20


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
    """The cache folder: file digests, token-file scans and tokenised text files."""

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

    # ------------------------------------------------------------------ what is known of a file
    def _file_record(self, path: Path) -> tuple[Path, dict]:
        st = path.stat()
        stat_key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
        record = self._folder("files") / f"{stat_key}.json"
        known = json.loads(record.read_text()) if record.is_file() else {}
        return record, known

    def _remember(self, record: Path, known: dict) -> None:
        _write_atomic(record, lambda tmp: tmp.write_text(json.dumps(known)))

    def digest(self, path: Path) -> str:
        """sha256 of the file's bytes (read once per path, size and modification time)."""
        record, known = self._file_record(path)
        if "sha256" not in known:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(8 << 20):
                    h.update(chunk)
            known["sha256"] = h.hexdigest()
            self._remember(record, known)
        return known["sha256"]

    def max_token_id(self, path: Path, token_dtype: str) -> int:
        """Largest id in a token file (scanned once per path, size, modification time and dtype)."""
        record, known = self._file_record(path)
        key = f"max_id_{token_dtype}" if path.suffix == ".bin" else "max_id"
        if key not in known:
            known[key] = scan_max(path, token_dtype)
            self._remember(record, known)
        return known[key]

    # ------------------------------------------------------------------ tokenised text
    def _entry(self, path: Path, tokenizer: Tokenizer, text_field: str, separator_id: int) -> Path:
        if tokenizer.fingerprint is None:
            raise DataError(f"{tokenizer.path} is not one tokenizer.json; token caches need one (data.tokenizer)")
        parts = (FORMAT, self.digest(path), tokenizer.fingerprint, text_field, str(separator_id))
        return self._folder("tokens") / hashlib.sha256("|".join(parts).encode()).hexdigest()

    def lookup(self, path: Path, tokenizer: Tokenizer, text_field: str, separator_id: int) -> CachedTokens | None:
        """The cached tokens of a text file, or None when it was not tokenised yet."""
        entry = self._entry(path, tokenizer, text_field, separator_id)
        meta = entry.with_suffix(".json")
        if not meta.is_file():
            return None
        return CachedTokens(path=str(entry.with_suffix(".bin")), **json.loads(meta.read_text()))

    def tokenize(
        self,
        path: Path,
        tokenizer: Tokenizer,
        text_field: str,
        separator_id: int,
        log: Callable[[str], None] = print,
    ) -> CachedTokens:
        """The cached tokens of a text file, tokenising it first if needed."""
        found = self.lookup(path, tokenizer, text_field, separator_id)
        if found is not None:
            return found
        entry = self._entry(path, tokenizer, text_field, separator_id)
        dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
        log(f"tokenising {path} into {entry}.bin")
        stats = {"tokens": 0, "documents": 0, "max_id": -1}

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as out:
                for batch in _batches(read_documents(path, text_field)):
                    ids = [i for doc in tokenizer.encode(batch) for i in (*doc, separator_id)]
                    array = np.asarray(ids, dtype=np.int64)
                    stats["tokens"] += len(array)
                    stats["documents"] += len(batch)
                    stats["max_id"] = max(stats["max_id"], int(array.max()))
                    array.astype(dtype).tofile(out)

        bin_path = entry.with_suffix(".bin")
        _write_atomic(bin_path, write)
        if not stats["tokens"]:
            raise DataError(f"{path} holds no documents")
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

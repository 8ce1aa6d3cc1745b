"""Read local training data into one token stream: text (.txt/.jsonl/.parquet) or token files.

Text is tokenised with the model's tokenizer and documents are joined with a separator token
(default: the tokenizer's EOS). Pre-tokenised files (.npy, or raw .bin with a given dtype) are
used as they are. Nothing is fetched from the network.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
TOKEN_SUFFIXES = (".npy", ".bin")
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")


class TextTokenizer:
    """A fast tokenizer from a tokenizer.json file or a local HF model directory."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"no tokenizer at {path}: give a tokenizer.json file or a directory that holds one")
        self.path = file
        self._tok = Tokenizer.from_file(str(file))
        self._eos = _declared_eos(file.parent) if path.is_dir() else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int:
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise ValueError(
                f"token {token!r} is not in the vocabulary of {self.path}; set data.separator to one that is"
            )
        return tid

    def separator_id(self, separator: str | None) -> int:
        """Id of ``separator``, or of the tokenizer's EOS when None."""
        if separator is not None:
            return self.token_id(separator)
        for token in ((self._eos,) if self._eos else ()) + _EOS_CANDIDATES:
            if self._tok.token_to_id(token) is not None:
                return self._tok.token_to_id(token)
        raise ValueError(f"cannot tell the EOS token of {self.path}; set data.separator (e.g. '</s>')")

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def _declared_eos(model_dir: Path) -> str | None:
    """eos_token from a HF tokenizer_config.json, if present."""
    cfg = model_dir / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    eos = json.loads(cfg.read_text()).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos


def expand_sources(patterns: list[str]) -> list[Path]:
    """Files named by paths or globs, in sorted order per pattern; every pattern must match."""
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
        if not matches:
            raise ValueError(f"data.sources: {pattern!r} matches no file (paths are relative to the working directory)")
        for path in matches:
            if path.suffix not in TEXT_SUFFIXES + TOKEN_SUFFIXES:
                raise ValueError(f"{path}: unsupported file type; use one of {TEXT_SUFFIXES + TOKEN_SUFFIXES}")
        files.extend(matches)
    return files


def read_documents(path: Path, text_field: str) -> Iterator[str]:
    """The documents of a text file: a whole .txt, each JSONL line's field, each parquet row's column."""
    if path.suffix == ".txt":
        yield path.read_text()
    elif path.suffix == ".jsonl":
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if text_field not in row:
                    raise ValueError(f"{path}:{n} has no field {text_field!r}; set data.text_field")
                yield row[text_field]
    else:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"reading {path} needs pyarrow: pip install pyarrow") from None
        table = pq.read_table(path, columns=[text_field])
        yield from table.column(text_field).to_pylist()


def read_tokens(path: Path, token_dtype: str) -> np.ndarray:
    """Token ids of a pre-tokenised file (.npy, or raw .bin of ``token_dtype``), memory-mapped."""
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
    else:
        tokens = np.memmap(path, dtype=np.dtype(token_dtype), mode="r")
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ValueError(f"{path} must hold a 1-D integer array of token ids, got {tokens.dtype} {tokens.shape}")
    return tokens


def token_stream(
    sources: list[str],
    tokenizer: TextTokenizer | None,
    text_field: str = "text",
    separator: str | None = None,
    token_dtype: str = "uint32",
    batch_docs: int = 256,
) -> np.ndarray:
    """All sources as one int64 token stream; each text document is followed by the separator."""
    parts: list[np.ndarray] = []
    for path in expand_sources(sources):
        if path.suffix in TOKEN_SUFFIXES:
            parts.append(np.asarray(read_tokens(path, token_dtype), dtype=np.int64))
            continue
        if tokenizer is None:
            raise ValueError(f"{path} is text: set data.tokenizer (or model.path) so it can be tokenised")
        sep = tokenizer.separator_id(separator)
        docs = read_documents(path, text_field)
        while batch := [d for _, d in zip(range(batch_docs), docs)]:
            for ids in tokenizer.encode(batch):
                parts.append(np.asarray(ids + [sep], dtype=np.int64))
    if not parts:
        raise ValueError(f"data.sources {sources} hold no tokens")
    return np.concatenate(parts)

"""Training data: each ``data.sources`` entry as one memory-mapped token stream, text tokenised once.

A source entry is a path, glob, folder or saved ``datasets`` folder (mtraining.data.documents), or
a mapping ``{path, weight, text_field}``. Its files, in sorted order, form one stream: token files
(.npy/.bin) as they are, text files through the token cache (mtraining.data.cache), each document
followed by the separator (default: the tokenizer's EOS).

``load_sources(..., tokenize=True)`` fills the cache (text tokenised) and scans token files for their
largest id; it runs in the launcher, and on one rank per node (``open_sources``: local rank 0), whose
sources (the files to map, with their sizes and largest ids) every other rank of its node then opens.
``check_vocabulary`` refuses ids beyond the model's vocabulary, naming the file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch.distributed as dist

from ..data.cache import TokenCache
from ..data.documents import DataError, file_kind, find_files
from ..data.tokenizer import TextTokenizer, Tokenizer
from ..data.tokens import TokenPart, TokenStream, open_token_file, scan_max
from .agree import agree, all_gather
from .checkpoint import write_error
from .config import Config

_WRITE_TOKENS = 1 << 24  # tokens per window when writing a token file


@dataclass
class Source:
    """One data.sources entry, ready to sample from: its files (``parts``) read as one stream.

    The stream is opened on first use and not pickled, so a rank can hand its sources to another
    (``open_sources``), which maps the same files.
    """

    name: str
    parts: list[TokenPart]
    weight: float | None
    files: int
    _stream: TokenStream | None = field(default=None, repr=False, compare=False)

    def open(self) -> Source:
        """Map the files on this rank (once); returns the source."""
        if self._stream is None:
            self._stream = TokenStream([part.open() for part in self.parts])
        return self

    @property
    def stream(self) -> TokenStream:
        return self.open()._stream

    @property
    def max_id(self) -> int:
        return max(part.max_id for part in self.parts)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_stream": None}


def tokenizer_path(cfg: Config) -> str | None:
    """data.tokenizer, else the model folder (model.path), else None."""
    return cfg.data.tokenizer or cfg.model.path


def document_separator(cfg: Config) -> int | None:
    """The token id that ends a document (data.separator, default the tokenizer's EOS) when
    data.document_masking is on; None when it is off."""
    if not cfg.data.document_masking:
        return None
    path = tokenizer_path(cfg)
    if path is None:
        raise DataError(
            "data.document_masking finds documents by their separator token: set data.tokenizer (a tokenizer.json "
            "or a model folder) so its id is known"
        )
    return TextTokenizer(path).separator_id(cfg.data.separator)


def _tokenizer(cfg: Config, text_files: list) -> Tokenizer | None:
    if not text_files:
        return None
    path = tokenizer_path(cfg)
    if path is None:
        raise DataError(
            f"{text_files[0]} is text: set data.tokenizer (a tokenizer.json or a model folder) so it can be tokenised"
        )
    return TextTokenizer(path)


def load_sources(cfg: Config, tokenize: bool, log: Callable[[str], None] = print) -> list[Source]:
    """Every data.sources entry as a stream; ``tokenize``: fill the cache where it lacks an entry."""
    d = cfg.data
    cache = TokenCache(d.cache_dir)
    specs = [(spec, find_files(spec.path)) for spec in d.source_specs]
    _refuse_outputs_inside(specs, cfg, cache)
    tokenizer = _tokenizer(cfg, [f for _, files in specs for f in files if file_kind(f) != "tokens"])
    separator = tokenizer.separator_id(d.separator) if tokenizer is not None else None
    token_files = any(file_kind(f) == "tokens" for _, files in specs for f in files)
    boundary = document_separator(cfg) if token_files else None  # None without document masking
    sources = []
    for spec, files in specs:
        parts = []
        for path in files:
            if file_kind(path) == "tokens":
                ids = open_token_file(path, d.token_dtype)
                max_id = scan_max(path, d.token_dtype, boundary)
                parts.append(TokenPart(str(path), ids.dtype.name, len(ids), max_id, str(path)))
                continue
            text_field = spec.text_field or d.text_field
            if tokenize:
                entry = cache.tokenize(path, tokenizer, text_field, separator, log)
            else:
                entry = cache.lookup(path, tokenizer, text_field, separator)
                if entry is None:
                    raise DataError(_missing(path, cache))
            parts.append(TokenPart(entry.path, entry.dtype, entry.tokens, entry.max_id, str(path)))
        source = Source(spec.path, parts, spec.weight, len(files))
        if not len(source.stream):
            raise DataError(f"data source {spec.path!r} holds no tokens")
        sources.append(source)
    return sources


def _refuse_outputs_inside(specs: list, cfg: Config, cache: TokenCache) -> None:
    """DataError when a folder the run writes (the token cache, checkpoints, logs, the export) lies in a data
    source: its files (.bin ids, .json records, metrics.jsonl) would be read as data from the next start on."""
    outputs = {
        "data.cache_dir": cache.root,
        "checkpoint.dir": cfg.checkpoint.dir,
        "checkpoint.export_dir": cfg.checkpoint.export_dir,
        "log.dir": cfg.log.dir,
    }
    for key, out in outputs.items():
        if out is None:
            continue
        root = Path(out).expanduser().absolute()
        for spec, files in specs:
            folder = Path(spec.path).expanduser().absolute()
            inside = folder.is_dir() and root.is_relative_to(folder)
            if inside or any(Path(f).absolute().is_relative_to(root) for f in files):
                raise DataError(
                    f"data source {spec.path!r} holds {key}={out}: what the run writes there would be read as "
                    f"data; set {key} to a folder outside the data"
                )


def check_vocabulary(sources: list[Source], vocab_size: int, token_dtype: str) -> None:
    """ValueError naming the file when a token id is not below the model's vocab_size."""
    for part in (p for s in sources for p in s.parts):
        if part.max_id < vocab_size:
            continue
        hint = "tokenise with the model's own tokenizer (data.tokenizer) or raise model.config.vocab_size"
        if part.origin.endswith(".bin"):
            hint = (
                f"if its ids were written with a narrower type than data.token_dtype={token_dtype} (uint16 ids read "
                f"as uint32 pair up into ids above 65535), set data.token_dtype to that type; else {hint}"
            )
        raise ValueError(
            f"{part.origin} holds token id {part.max_id} but the model's vocab_size is {vocab_size}; {hint}"
        )


def check_token_file_target(out: Path) -> None:
    """ValueError unless ``out`` names a new ``.npy`` file: an existing file (a data source among them) is never
    written over, and another ending would be read back as a raw ``.bin`` with the .npy header as ids."""
    if out.suffix != ".npy":
        raise ValueError(f"{out}: a token file is written as .npy (its header says its type); name it {out.stem}.npy")
    if out.exists():
        raise ValueError(
            f"{out} exists; choose a new file name, or remove it first (a token file is never written over)"
        )


def write_token_file(sources: list[Source], out: Path) -> np.dtype:
    """Write every source's tokens end to end as one ``.npy`` file (uint16 when the ids fit, else uint32), under
    a temporary name renamed at the end, so a failed write leaves ``out`` as it was; returns the type.
    A write the file system refuses raises SaveFailed (exit 5)."""
    dtype = np.dtype(np.uint16 if max(s.max_id for s in sources) < 1 << 16 else np.uint32)
    total = sum(len(s.stream) for s in sources)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}.npy")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        target = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(total,))
        done = 0
        for s in sources:
            for start in range(0, len(s.stream), _WRITE_TOKENS):
                window = s.stream.read(start, min(len(s.stream), start + _WRITE_TOKENS))
                target[done : done + len(window)] = window
                done += len(window)
        target.flush()
        del target
        os.replace(tmp, out)
    except OSError as err:
        raise write_error(err, out, "writing the token file") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    return dtype


def _missing(path, cache: TokenCache) -> str:
    return (
        f"{path} is not in the token cache {cache.root} (its content or the tokenizer changed since it was "
        "tokenised); run `mtraining tokenize CONFIG` first"
    )


def open_sources(cfg: Config, log: Callable[[str], None] = print) -> list[Source]:
    """Every rank's sources: local rank 0 of each node fills the token cache and scans the token files while
    the others wait, then every rank opens what its node's local rank 0 found. Collective over the default
    group when one is up (all ranks call it); an error on any rank is raised on all (agree.SharedError)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    local_rank = int(os.environ.get("LOCAL_RANK", rank))  # without torchrun (one host): rank 0 fills
    node = os.environ.get("GROUP_RANK", "0")
    found = agree(lambda: load_sources(cfg, tokenize=True, log=log) if local_rank == 0 else None)
    mine = next(sources for where, sources in all_gather((node, found)) if where == node and sources is not None)
    return agree(lambda: [s.open() for s in mine])

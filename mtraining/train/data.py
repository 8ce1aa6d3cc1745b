"""Training data: each ``data.sources`` entry as one memory-mapped token stream, text tokenised once.

A source entry is a path, glob, folder or saved ``datasets`` folder (mtraining.data.documents), or
a mapping ``{path, weight, text_field}``. Its files, in sorted order, form one stream: token files
(.npy/.bin) as they are, text files through the token cache (mtraining.data.cache), each document
followed by the separator (default: the tokenizer's EOS).

``load_sources(..., tokenize=True)`` fills the cache (text tokenised; token files are scanned once
for their largest id either way) and runs once: in the launcher, or on one rank per node
(``open_sources``). Every rank then loads with ``tokenize=False``, which only memory-maps what the
cache holds.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from ..data.cache import TokenCache
from ..data.documents import DataError, file_kind, find_files
from ..data.tokenizer import TextTokenizer, Tokenizer
from ..data.tokens import TokenStream, open_token_file
from .agree import agree
from .config import Config


@dataclass
class Source:
    """One data.sources entry, ready to sample from."""

    name: str
    stream: TokenStream
    max_id: int
    weight: float | None
    files: int


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
    tokenizer = _tokenizer(cfg, [f for _, files in specs for f in files if file_kind(f) != "tokens"])
    separator = tokenizer.separator_id(d.separator) if tokenizer is not None else None
    sources = []
    for spec, files in specs:
        parts, max_id = [], -1
        for path in files:
            if file_kind(path) == "tokens":
                parts.append(open_token_file(path, d.token_dtype))
                max_id = max(max_id, cache.max_token_id(path, d.token_dtype))  # a memo hit after the first scan
                continue
            text_field = spec.text_field or d.text_field
            if tokenize:
                entry = cache.tokenize(path, tokenizer, text_field, separator, log)
            else:
                entry = cache.lookup(path, tokenizer, text_field, separator)
                if entry is None:
                    raise DataError(_missing(path, cache))
            parts.append(entry.open())
            max_id = max(max_id, entry.max_id)
        stream = TokenStream(parts)
        if not len(stream):
            raise DataError(f"data source {spec.path!r} holds no tokens")
        sources.append(Source(spec.path, stream, max_id, spec.weight, len(files)))
    return sources


def _missing(path, cache: TokenCache) -> str:
    return (
        f"{path} is not in the token cache {cache.root} although it should have been tokenised before the ranks "
        "started; check that every node sees data.cache_dir, or run `mtraining tokenize CONFIG` first"
    )


def open_sources(cfg: Config, log: Callable[[str], None] = print) -> list[Source]:
    """Every rank's sources: local rank 0 of each node fills the token cache while the others wait, then
    every rank memory-maps it. Collective over the default group when one is up (all ranks call it);
    an error on any rank is raised on all (agree.SharedError)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if int(os.environ.get("LOCAL_RANK", rank)) == 0:  # without torchrun (one host): rank 0
        agree(lambda: load_sources(cfg, tokenize=True, log=log))
    else:
        agree(lambda: None)
    return agree(lambda: load_sources(cfg, tokenize=False, log=log))

"""Token counters for prompt builders tested without a model."""

from __future__ import annotations

import functools
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "data"


def words(text: str) -> int:
    """A stand-in tokenizer: whitespace words."""
    return len(text.split())


@functools.cache
def _bpe():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(DATA / "tokenizer.json"))


def bpe_count(text: str) -> int:
    """Tokens of ``text`` under the shipped BPE tokenizer (data/tokenizer.json)."""
    return len(_bpe().encode(text).ids)

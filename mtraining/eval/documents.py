"""Local documents for evaluation, and a built-in filler text (no network, no shipped corpus needed).

``load_documents`` reads documents with the shared reader (mtraining.data.documents): text files
(``.txt``, ``.md``: one document each), JSONL (also gzipped; one document per line, the text under
``text_field``), parquet and Arrow files (a column ``text_field``; need pyarrow) and saved ``datasets``
folders, given as files, globs or directories (searched recursively). PG-19 comes as any of these: a
folder of ``<id>.txt`` books per split (the original release), parquet files with a ``text`` column
(the Hugging Face hub), or the Arrow files of ``datasets`` (its cache, or ``save_to_disk``; the
metadata JSON files beside them are skipped). ``filler_sentences`` is a deterministic stream of plain
English sentences for haystacks when the user has no text of their own.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from pathlib import Path

from ..data.documents import TEXT_KINDS, find_files, read_documents


def load_documents(paths: Sequence[str | Path], text_field: str = "text") -> list[str]:
    """All non-empty documents under ``paths``, in sorted file order (then line/row order)."""
    if not paths:
        raise ValueError("no data given; pass --data with a text/JSONL/parquet/arrow file or a directory")
    docs = [
        doc
        for path in paths
        for file in find_files(path, TEXT_KINDS)
        for doc in read_documents(file, text_field)
        if doc.strip()
    ]
    if not docs:
        raise ValueError(f"no non-empty documents found in {', '.join(map(str, paths))}")
    return docs


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text`` (split after . ! ? and whitespace), whitespace-normalised, non-empty."""
    return [" ".join(s.split()) for s in _SENTENCE_END.split(text) if s.strip()]


# A small grammar of our own: subject, verb phrase, object, circumstance.
_SUBJECTS = (
    "the old ferryman",
    "a young painter",
    "the village baker",
    "my neighbour",
    "the quiet student",
    "a tired traveller",
    "the harbour master",
    "the librarian",
    "an elderly farmer",
    "the night guard",
    "a curious child",
    "the shepherd",
    "the clockmaker",
    "a wandering musician",
    "the innkeeper",
)
_VERBS = (
    "walked along",
    "painted",
    "remembered",
    "carried",
    "watched",
    "repaired",
    "described",
    "cleaned",
    "followed",
    "measured",
    "visited",
    "sketched",
    "crossed",
    "photographed",
    "mended",
)
_OBJECTS = (
    "the narrow road",
    "a wooden boat",
    "the evening sky",
    "the stone wall",
    "an empty basket",
    "the garden gate",
    "a faded map",
    "the long corridor",
    "the frozen lake",
    "a broken lantern",
    "the orchard fence",
    "the market stalls",
    "a pile of letters",
    "the church tower",
    "the river bank",
)
_CIRCUMSTANCES = (
    "before the storm arrived",
    "without saying a word",
    "for the third time that week",
    "while the kettle boiled",
    "as the light faded",
    "early in the morning",
    "after a long supper",
    "in the pouring rain",
    "with great care",
    "just before noon",
    "under a pale moon",
    "on the first day of spring",
    "when nobody was looking",
    "despite the cold wind",
    "at a slow pace",
)


def filler_sentences(count: int, seed: int = 0) -> list[str]:
    """The first ``count`` sentences of a deterministic filler stream (a prefix of any longer call)."""
    rng = random.Random(f"mtraining-filler-{seed}")
    out = []
    for _ in range(count):
        subject, verb, obj, tail = (rng.choice(part) for part in (_SUBJECTS, _VERBS, _OBJECTS, _CIRCUMSTANCES))
        out.append(f"{subject[0].upper()}{subject[1:]} {verb} {obj} {tail}.")
    return out


class Haystack:
    """A source of haystack sentences: the built-in filler, or the sentences of local documents."""

    def __init__(self, documents: Sequence[str] | None = None, seed: int = 0) -> None:
        self.seed = seed
        self._sentences: list[str] | None = None
        if documents is not None:
            self._sentences = [s for doc in documents for s in split_sentences(doc)]
            if not self._sentences:
                raise ValueError("the haystack documents contain no sentences; pass text with punctuation")

    @property
    def name(self) -> str:
        return "filler" if self._sentences is None else "documents"

    def sentences(self, count: int) -> list[str]:
        """The first ``count`` sentences (local text repeats from its start when it runs out)."""
        if self._sentences is None:
            return filler_sentences(count, self.seed)
        n = len(self._sentences)
        return [self._sentences[i % n] for i in range(count)]

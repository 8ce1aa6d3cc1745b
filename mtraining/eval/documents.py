"""Local documents for evaluation, and a built-in filler text (no network, no shipped corpus needed).

``load_documents`` reads documents with the shared reader (mtraining.data.documents): text files
(``.txt``, ``.md``: one document each), JSONL (also gzipped; one document per line, the text under
``text_field``), parquet and Arrow files (a column ``text_field``; need pyarrow) and saved ``datasets``
folders, given as files, globs or directories (searched recursively). PG-19 comes as any of these: a
folder of ``<id>.txt`` books per split (the original release), parquet files with a ``text`` column
(the Hugging Face hub), or the Arrow files of ``datasets`` (its cache, or ``save_to_disk``; the
metadata JSON files beside them are skipped). ``filler_sentences`` is a deterministic stream of plain
English sentences for haystacks when the user has no text of their own.

``Haystack`` makes the context of needle tasks: the built-in sentences, or real text (held-out documents,
``--haystack``) as written, each prompt's from its own start (a document and a line in it drawn from the
prompt's seed), so the prompts of a cell read different text.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
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


_LONG_LINE = 512  # characters: longer lines are cut after their sentences, so the fitted haystack stays close
_LINE_END = re.compile(r"(?<=\n)|(?<=[.!?] )")


def text_pieces(text: str) -> list[str]:
    """``text`` cut into consecutive pieces whose concatenation is ``text``: its lines (with their newline),
    lines longer than ``_LONG_LINE`` characters cut after sentence ends (". ", "! ", "? ")."""
    pieces = []
    for line in text.splitlines(keepends=True):
        if len(line) <= _LONG_LINE:
            pieces.append(line)
        else:
            pieces.extend(p for p in _LINE_END.split(line) if p)
    return pieces


class Haystack:
    """A source of haystack text: the built-in filler sentences, or pieces of local documents (``text_pieces``)."""

    def __init__(self, documents: Sequence[str] | None = None, seed: int = 0) -> None:
        self.seed = seed
        self._documents: list[list[str]] | None = None
        if documents is not None:
            self._documents = [p for p in (text_pieces(d) for d in documents if d.strip()) if p]
            if not self._documents:
                raise ValueError("the haystack documents hold no text; pass files with text in them")

    @property
    def name(self) -> str:
        return "filler" if self._documents is None else "documents"

    def context(self, count: int, items: Sequence[tuple[float, str]], draw: int = 0) -> str:
        """``count`` pieces of haystack with each (fraction, text) item inserted before piece round(fraction *
        count) (ties keep their order). Built-in filler: the stream's first sentences (the same for every draw),
        items among them, joined by spaces. Documents: ``count`` consecutive pieces as written, from a start
        drawn with ``draw`` (a document and a piece in it; then the next documents in turn, cyclically), each
        item on a line of its own. A prefix of the pieces for ``count + 1`` (the knob ``tasks.fit_knob`` searches)."""
        pieces = filler_sentences(count, self.seed) if self._documents is None else list(self._stream(count, draw))
        slots: dict[int, list[str]] = {}
        for frac, text in items:
            slots.setdefault(round(frac * count), []).append(text)
        out: list[str] = []
        for i in range(count + 1):
            for text in slots.get(i, []):
                out.append(text if self._documents is None else self._own_line(text, out))
            if i < count:
                out.append(pieces[i])
        return " ".join(out) if self._documents is None else "".join(out).rstrip("\n")

    @staticmethod
    def _own_line(text: str, before: list[str]) -> str:
        """``text`` as a line of its own after the pieces ``before``."""
        return ("" if not before or before[-1].endswith("\n") else "\n") + text + "\n"

    def _stream(self, count: int, draw: int) -> Iterator[str]:
        docs = self._documents
        rng = random.Random(f"mtraining-haystack-{self.seed}-{draw}")
        doc = rng.randrange(len(docs))
        at = rng.randrange(len(docs[doc]))
        for _ in range(count):
            yield docs[doc][at]
            at += 1
            if at == len(docs[doc]):
                doc, at = (doc + 1) % len(docs), 0

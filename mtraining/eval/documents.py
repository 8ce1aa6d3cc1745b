"""Local documents for evaluation, and a built-in filler text (no network, no shipped corpus needed).

``load_documents`` reads text files (``.txt``, ``.md``: one document each), JSONL (one document per
line, the text under ``text_field``), parquet and Hugging Face arrow files (a column ``text_field``;
need pyarrow), given as files or directories (searched recursively). PG-19 comes as any of these: a
folder of ``<id>.txt`` books per split (the original release), parquet files with a ``text`` column
(the Hugging Face hub), or the arrow files of ``datasets`` (its cache, or ``save_to_disk``, whose
metadata JSON files are skipped). ``filler_sentences`` is a deterministic stream of plain English
sentences for haystacks when the user has no text of their own.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
ARROW_SUFFIXES = (".arrow",)
SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES + ARROW_SUFFIXES
HF_METADATA = ("dataset_info.json", "state.json", "dataset_dict.json")  # next to save_to_disk's arrow files


def _files(path: Path) -> list[Path]:
    if not path.exists():
        raise ValueError(
            f"data path {path} does not exist; pass a text (.txt/.md), JSONL, parquet or arrow file, or a directory of them"
        )
    if path.is_file():
        if path.suffix.lower() not in SUFFIXES:
            raise ValueError(f"{path} has an unsupported suffix {path.suffix!r}; use one of {', '.join(SUFFIXES)}")
        return [path]
    found = sorted(
        p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES and p.name not in HF_METADATA
    )
    if not found:
        raise ValueError(f"directory {path} holds no {', '.join(SUFFIXES)} files; point --data at your documents")
    return found


def _read_jsonl(path: Path, text_field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}:{line_no} is not valid JSON ({e.msg}); use one JSON object per line"
                ) from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(
                    f"{path}:{line_no} has no string field {text_field!r} (found {keys}); pass --text-field NAME"
                )
            yield record[text_field]


def _read_table(path: Path, text_field: str) -> Iterator[str]:
    """The strings in column ``text_field`` of a parquet file or an arrow file (IPC stream or file format)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"reading {path} needs pyarrow: pip install pyarrow (or convert it to JSONL)") from None
    if path.suffix.lower() in PARQUET_SUFFIXES:
        table = pq.read_table(path)
    else:
        try:  # datasets writes the stream format
            table = pa.ipc.open_stream(path).read_all()
        except pa.ArrowInvalid:
            table = pa.ipc.open_file(path).read_all()
    if text_field not in table.column_names:
        raise ValueError(f"{path} has no column {text_field!r} (columns: {table.column_names}); pass --text-field NAME")
    yield from (t for t in table.column(text_field).to_pylist() if isinstance(t, str))


def load_documents(paths: Sequence[str | Path], text_field: str = "text") -> list[str]:
    """All non-empty documents under ``paths``, in sorted file order (then line/row order)."""
    if not paths:
        raise ValueError("no data given; pass --data with a text/JSONL/parquet/arrow file or a directory")
    docs: list[str] = []
    for path in paths:
        for file in _files(Path(path)):
            suffix = file.suffix.lower()
            if suffix in TEXT_SUFFIXES:
                docs.append(file.read_text(encoding="utf-8", errors="replace"))
            elif suffix in JSONL_SUFFIXES:
                docs.extend(_read_jsonl(file, text_field))
            else:
                docs.extend(_read_table(file, text_field))
    docs = [d for d in docs if d.strip()]
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

"""Find and read local documents: the one reader behind training data and evaluation texts.

A *source* is a file, a glob or a directory (searched recursively, sorted). Formats, by file name:

- ``.txt``, ``.md``, ``.text``: the whole file is one document (UTF-8);
- ``.jsonl``, ``.json`` and gzipped ``.jsonl.gz``, ``.json.gz``: one JSON object per line, the
  document under ``text_field``;
- ``.parquet`` and ``.arrow`` (Arrow IPC file or stream): the column ``text_field`` (pyarrow);
- a Hugging Face ``datasets`` folder written by ``save_to_disk`` (``state.json`` beside its Arrow
  files): its Arrow files in the dataset's order; a ``DatasetDict`` folder of one split: that split
  (of several: refused, name one); the metadata JSON files ``datasets`` writes beside Arrow files (also
  in its cache) are not documents and are skipped;
- ``.npy`` and ``.bin``: token ids, listed here and read by ``mtraining.data.tokens``.

Every mistake in a file (bad UTF-8, a malformed JSON line, a missing or non-string text field, a
corrupt gzip or Arrow file) raises ``DataError`` naming the file and its line or row. Nothing is
fetched from the network.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

KINDS = {
    "text": (".txt", ".md", ".text"),
    "jsonl": (".jsonl", ".json", ".jsonl.gz", ".json.gz"),
    "table": (".parquet", ".arrow"),
    "tokens": (".npy", ".bin"),
}
TEXT_KINDS = ("text", "jsonl", "table")
# what Hugging Face datasets writes beside its Arrow files (save_to_disk, its cache): not documents
HF_METADATA = ("dataset_info.json", "state.json", "dataset_dict.json")
FIELD_HINT = "set the text field (data.text_field in training, --text-field in evaluation)"


class DataError(ValueError):
    """A data source that cannot be read; the message names the file, the place and the fix."""


def file_kind(path: str | Path) -> str | None:
    """'text', 'jsonl', 'table' or 'tokens' by the file name's ending; None when unsupported."""
    name = Path(path).name.lower()
    return next((kind for kind, endings in KINDS.items() if name.endswith(endings)), None)


def _supported(kinds: Iterable[str]) -> str:
    return ", ".join(e for k in kinds for e in KINDS[k])


def is_saved_dataset(path: Path) -> bool:
    """A folder written by ``datasets.Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _dataset_files(folder: Path) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` folder, in the dataset's row order."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        if len(splits) == 1 and is_saved_dataset(folder / splits[0]):
            return _dataset_files(folder / splits[0])
        raise DataError(
            f"{folder} holds a DatasetDict with splits {splits}; point the source at one split's folder, "
            f"e.g. {folder / (splits[0] if splits else 'train')}"
        )
    try:
        state = json.loads((folder / "state.json").read_text())
        files = [folder / entry["filename"] for entry in state["_data_files"]]
    except (ValueError, KeyError, TypeError) as err:
        raise DataError(f"{folder}/state.json is not a datasets state file ({err}); save it again") from None
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise DataError(f"{folder} lists Arrow files that are missing: {missing}; save the dataset again")
    return files


def _walk(folder: Path, kinds: tuple[str, ...]) -> list[Path]:
    """Supported files under ``folder`` in sorted path order; saved datasets count as their Arrow files."""
    found: list[Path] = []
    for root, dirs, names in os.walk(folder):
        here = Path(root)
        if is_saved_dataset(here):
            dirs.clear()
            found.extend(_dataset_files(here) if "table" in kinds else [])
            continue
        dirs.sort()
        found.extend(_regular(here / n) for n in sorted(names) if file_kind(n) in kinds and n not in HF_METADATA)
    return found


def _regular(path: Path) -> Path:
    """``path``, a regular file (or a link to one); DataError for a FIFO, socket or device, whose reading
    waits for a writer forever."""
    if not path.is_file():
        raise DataError(f"{path} is not a regular file (a FIFO, socket or device); give a file")
    return path


def find_files(source: str | Path, kinds: tuple[str, ...] = TEXT_KINDS + ("tokens",)) -> list[Path]:
    """The files a source names (a file, a glob, a directory or a saved dataset), of the given kinds."""
    text = os.path.expanduser(str(source))
    matches = sorted(Path(p) for p in glob.glob(text, recursive=True)) if glob.has_magic(text) else [Path(text)]
    if not matches or not matches[0].exists():
        what = "matches no file or folder" if glob.has_magic(text) else "does not exist"
        where = "" if os.path.isabs(text) else f" (relative to the working directory, {os.getcwd()})"
        raise DataError(f"data source {text} {what}{where}; check the path")
    files: list[Path] = []
    for path in matches:
        if path.is_dir():
            inside = _dataset_files(path) if is_saved_dataset(path) else _walk(path, kinds)
            if not inside:
                raise DataError(f"folder {path} holds no {_supported(kinds)} files")
            files.extend(inside)
        elif file_kind(path) in kinds:
            files.append(_regular(path))
        elif not glob.has_magic(text):
            raise DataError(f"{path}: unsupported file type; use one of {_supported(kinds)}")
    if not files:
        raise DataError(f"data source {text!r} matches no {_supported(kinds)} file")
    return files


def read_documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """The documents of one text, JSONL or table file, in file order."""
    kind = file_kind(path)
    if kind == "text":
        yield _decode(path.read_bytes(), path, 1)
    elif kind == "jsonl":
        yield from _jsonl(path, text_field)
    elif kind == "table":
        yield from _table(path, text_field)
    else:
        raise DataError(f"{path} is not a text file; use one of {_supported(TEXT_KINDS)}")


def _decode(raw: bytes, path: Path, first_line: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = first_line + raw.count(b"\n", 0, err.start)
        raise DataError(
            f"{path}:{line}: not valid UTF-8 (byte {raw[err.start]:#04x}); re-encode the file as UTF-8"
        ) from None


def read_records(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, JSON value) of every non-blank line of a JSONL file (also gzipped), in file order."""
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for line_no, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                line = _decode(raw, path, line_no)
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(
                        f"{path}:{line_no}: not valid JSON ({err.msg} at column {err.colno}); "
                        "write one JSON object per line"
                    ) from None
                yield line_no, record
    except (OSError, EOFError, zlib.error) as err:  # gzip.BadGzipFile is an OSError
        raise DataError(f"{path}: cannot be read ({err}); check that the file is complete") from None


def _jsonl(path: Path, text_field: str) -> Iterator[str]:
    for line_no, record in read_records(path):
        yield _text_of(record, path, f"{path}:{line_no}", text_field)


def _text_of(record: object, path: Path, where: str, text_field: str) -> str:
    if not isinstance(record, dict) or text_field not in record:
        found = sorted(record) if isinstance(record, dict) else f"a JSON {type(record).__name__}"
        raise DataError(f"{where} has no field {text_field!r} (found {found}); {FIELD_HINT}")
    text = record[text_field]
    if not isinstance(text, str):
        raise DataError(
            f"{where}: field {text_field!r} holds a {type(text).__name__}, not a string; "
            f"{FIELD_HINT} to a text field, or fix the record"
        )
    return text


def _table(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {path} needs pyarrow: pip install pyarrow (or pip install -e '.[data]')") from None
    try:
        if path.name.lower().endswith(".parquet"):
            table = pq.ParquetFile(path)
            names = table.schema_arrow.names
            if text_field not in names:
                raise DataError(f"{path} has no column {text_field!r} (columns: {names}); {FIELD_HINT}")
            batches = table.iter_batches(columns=[text_field])
        else:
            source = pa.memory_map(str(path))
            try:
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:  # the stream format (what datasets writes)
                source.seek(0)
                batches = pa.ipc.open_stream(source)
        row = 0
        for batch in batches:
            if text_field not in batch.schema.names:
                raise DataError(f"{path} has no column {text_field!r} (columns: {batch.schema.names}); {FIELD_HINT}")
            column = batch.column(text_field)
            if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
                raise DataError(f"{path}: column {text_field!r} holds {column.type}, not strings; {FIELD_HINT}")
            if column.null_count:
                first = next(i for i, v in enumerate(column.is_null().to_pylist()) if v)
                raise DataError(f"{path}: row {row + first} of column {text_field!r} is null; drop or fill such rows")
            yield from column.to_pylist()
            row += len(column)
    except (pa.ArrowException, OSError) as err:
        raise DataError(
            f"{path}: cannot be read as {path.suffix[1:]} ({err}); check that the file is complete"
        ) from None

"""A corpus of long documents from local files: token files for training, held-out documents for evaluation.

``build_corpus`` takes code trees (site-packages folders: one document per package) and prose trees
(folders or tar archives of text: one document per top-level entry), read by mtraining.data.trees, and
writes into a new folder:

- ``train/<kind>.npy``: the training documents of each kind (``code``, ``prose``) as token ids, each
  followed by the separator (the tokenizer's EOS unless another is named), uint16 when the vocabulary
  fits; a ``data.sources`` entry each, and ``data.document_masking`` finds the documents by the separator;
- ``heldout/<kind>.jsonl``: the held-out documents, one JSON object per line: ``name``, ``source``,
  ``text`` (exactly the text that was tokenised) and ``tokens`` (its token count); ``mtraining eval ppl
  --data`` reads them, and they serve as haystack filler;
- ``manifest.json``: every document (name, kind, tree, files, bytes, tokens, split, license note), what
  was skipped and why, the tokenizer, the options and the command.

A document is held out when a hash of the seed and its name falls below ``heldout_fraction`` (a
property of the name alone: adding packages does not move other documents), among documents of
``heldout_min_tokens`` to ``heldout_max_tokens`` tokens (evaluation at 128K needs documents that long;
the largest ones, torch's sources or a reference manual, stay training data), or when it is named in
``heldout``.

Text: each file is decoded as UTF-8 (files with NUL bytes or invalid UTF-8 are skipped), files whose
bytes appeared earlier in the corpus are dropped (the first copy, in document order, stays), and each
kept file becomes ``# <path>`` on a line of its own, then its text; files are joined by a blank line.
Special-token strings inside the text (``<|endoftext|>`` in a tokenizer's source) are tokenised as
plain text, so a separator id only ever ends a document. Documents are tokenised in pieces of whole
files (about 1 MiB each) over ``workers`` processes; the pieces depend on the text alone, so the output
is the same byte for byte whatever the number of workers.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .documents import DataError
from .tokenizer import TextTokenizer, refuse_separator_inside
from .trees import CODE_SUFFIXES, MAX_FILE_BYTES, PROSE_SUFFIXES, TreeDocument, TreeFile, package_licenses, read_tree

FORMAT = "mtraining-corpus-1"
PIECE_BYTES = 1 << 20
SUFFIXES = {"code": CODE_SUFFIXES, "prose": PROSE_SUFFIXES}


@dataclass(frozen=True)
class CorpusOptions:
    """How documents are chosen and split (recorded in the manifest)."""

    heldout_fraction: float = 0.05
    heldout_min_tokens: int = 0
    heldout_max_tokens: int = 2_000_000
    min_tokens: int = 0
    seed: int = 0
    skip_tests: bool = False
    max_file_bytes: int = MAX_FILE_BYTES
    separator: str | None = None
    heldout: tuple[str, ...] = ()

    def check(self) -> None:
        if not 0 <= self.heldout_fraction <= 1:
            raise DataError(f"heldout_fraction {self.heldout_fraction} must lie in [0, 1]")
        if min(self.heldout_min_tokens, self.heldout_max_tokens, self.min_tokens) < 0 or self.max_file_bytes <= 0:
            raise DataError("heldout_min_tokens, heldout_max_tokens and min_tokens must be >= 0, max_file_bytes > 0")


def held_out(name: str, seed: int, fraction: float) -> bool:
    """Whether document ``name`` falls in the held-out fraction under ``seed`` (stable: the name alone decides)."""
    draw = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "big")
    return draw < fraction * 2**64


def _decode(data: bytes) -> str | None:
    """The file's text, or None when it is binary (NUL bytes) or not UTF-8."""
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError:
        return None


def _piece(path: str, text: str) -> str:
    """One file as it appears in its document: a path header line, then the text."""
    return f"# {path}\n{text.rstrip()}\n"


def _scan(doc: TreeDocument) -> list[tuple[str, str]]:
    """(status, sha256 of the bytes) of each file of ``doc``: status 'ok', 'unreadable', 'binary or not UTF-8' or
    'empty'."""
    out = []
    for f in doc.files:
        try:
            data = f.read()
        except OSError:
            out.append(("unreadable", ""))
            continue
        text = _decode(data)
        status = "binary or not UTF-8" if text is None else ("empty" if not text.strip() else "ok")
        out.append((status, hashlib.sha256(data).hexdigest()))
    return out


def _pieces(files: list[tuple[TreeFile, str]]) -> Iterator[str]:
    """The pieces of kept files, checking each file still has the bytes it was scanned with."""
    for f, digest in files:
        data = f.read()
        if hashlib.sha256(data).hexdigest() != digest:
            raise DataError(f"{f.disk or f.path} changed while the corpus was built; build it again")
        yield _piece(f.path, _decode(data))


def _text(files: list[tuple[TreeFile, str]], first: bool) -> str:
    """The text of consecutive files of a document; a part after the first starts with the joining newline."""
    return ("" if first else "\n") + "\n".join(_pieces(files))


_TOKENIZER = None


def _init_worker(tokenizer_file: str) -> None:
    global _TOKENIZER
    _TOKENIZER = TextTokenizer(tokenizer_file)  # '<|endoftext|>' in a document is text, not a separator


def _encode(task: tuple[list[tuple[TreeFile, str]], bool]) -> np.ndarray:
    files, first = task
    return np.asarray(_TOKENIZER.encode(_text(files, first)), dtype=np.uint32)


def _parts(kept: list[tuple[TreeFile, str]]) -> list[tuple[list[tuple[TreeFile, str]], bool]]:
    """A document's files in consecutive groups of about PIECE_BYTES (a larger file is a group of its own)."""
    parts: list[tuple[list[tuple[TreeFile, str]], bool]] = []
    group: list[tuple[TreeFile, str]] = []
    size = 0
    for f, digest in kept:
        length = len(f.data) if f.data is not None else os.path.getsize(f.disk)
        if group and size + length > PIECE_BYTES:
            parts.append((group, not parts))
            group, size = [], 0
        group.append((f, digest))
        size += length
    if group:
        parts.append((group, not parts))
    return parts


class _Progress:
    """Lines on stderr: documents and tokens done, tokens per second."""

    def __init__(self, total_docs: int, log: Callable[[str], None]) -> None:
        self.total, self.log, self.start, self.last = total_docs, log, time.perf_counter(), 0.0

    def update(self, docs: int, tokens: int, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - self.last >= 5:
            self.last = now
            rate = tokens / max(now - self.start, 1e-9)
            self.log(f"tokenised {docs}/{self.total} documents, {tokens:,} tokens, {rate:,.0f} tokens/s")


def _dedupe(docs: list[TreeDocument], scans: list[list[tuple[str, str]]], skipped: dict[str, dict[str, int]]):
    """Each document's kept (file, sha256) pairs: decodable, non-empty, bytes not seen in an earlier document."""
    seen: set[str] = set()
    kept_all = []
    for doc, scan in zip(docs, scans):
        kept = []
        for f, (status, digest) in zip(doc.files, scan):
            reason = status if status != "ok" else ("duplicate files" if digest in seen else None)
            if reason is None:
                seen.add(digest)
                kept.append((f, digest))
            else:
                counts = skipped.setdefault(doc.root, {})
                counts[reason] = counts.get(reason, 0) + 1
        kept_all.append(kept)
    return kept_all


def build_corpus(
    out_dir: str | Path,
    tokenizer: str | Path,
    trees: list[tuple[str, str | Path]],
    options: CorpusOptions,
    workers: int,
    command: str,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> dict:
    """Build the corpus of ``trees`` (``(kind, path)`` pairs, ``kind`` 'code' or 'prose') into the new folder
    ``out_dir``; returns the manifest. A code tree's documents carry the license their package declares."""
    options.check()
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise DataError(f"{out_dir} exists and is not an empty folder; choose a new output folder or remove it")
    if workers < 1:
        raise DataError(f"workers must be >= 1, got {workers}")
    tok = TextTokenizer(tokenizer)
    separator = tok.separator_id(options.separator)
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32)
    start = time.perf_counter()
    docs, tree_records, skipped, names = [], [], {}, set()
    for kind, path in trees:
        if kind not in SUFFIXES:
            raise DataError(f"tree kind {kind!r} is not one of {sorted(SUFFIXES)}")
        tree = read_tree(path, kind, SUFFIXES[kind], options.skip_tests, options.max_file_bytes)
        skipped[tree.root] = dict(tree.skipped)
        notes = package_licenses(Path(path)) if kind == "code" and Path(path).is_dir() else {}
        for doc in tree.documents:
            if doc.name in names:  # an earlier tree has this package (it shadows this one on sys.path)
                skipped[tree.root]["documents shadowed by an earlier tree"] = (
                    skipped[tree.root].get("documents shadowed by an earlier tree", 0) + 1
                )
                continue
            names.add(doc.name)
            doc.license = notes.get(doc.name.split("/", 1)[1])
            docs.append(doc)
        tree_records.append({"kind": kind, "root": tree.root, "license_files": tree.licenses})
    if not docs:
        raise DataError("the trees hold no documents; check the paths and that they hold .py / text files")
    unknown = sorted(set(options.heldout) - names)
    if unknown:
        raise DataError(
            f"held-out documents {unknown} are not in the corpus; names look like code/torch, prose/library"
        )
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(str(tok.path),)) as pool:
        scans = pool.map(_scan, docs, chunksize=1)
        kept = _dedupe(docs, scans, skipped)
        log(
            f"read {sum(len(d.files) for d in docs):,} files of {len(docs)} documents in {time.perf_counter() - start:.1f} s"
        )
        tasks = [(i, part) for i, k in enumerate(kept) for part in _parts(k)]
        encoded = pool.imap(_encode, [part for _, part in tasks], chunksize=1)
        result = _collect(docs, kept, tasks, encoded, tok, separator, dtype, options, _Progress(len(docs), log))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the workers, ended and waited for by the pool
    seconds = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    manifest = _write(out_dir, result, docs, kept, tree_records, skipped, tok, separator, dtype, options, command)
    totals = manifest["totals"]
    log(
        f"wrote {out_dir}: {totals['documents']} documents, {totals['tokens']:,} tokens "
        f"({totals['heldout_tokens']:,} held out) in {time.perf_counter() - start:.1f} s with {workers} workers "
        f"(their CPU time {seconds:.1f} s: {totals['tokens'] / max(seconds, 1e-9):,.0f} tokens per CPU-second)"
    )
    return manifest


@dataclass
class _Result:
    tokens: dict[int, int]  # document index -> tokens (separator excluded)
    split: dict[int, str]
    train: dict[str, list[np.ndarray]]


def _collect(docs, kept, tasks, encoded, tok, separator, dtype, options, progress) -> _Result:
    """Route each document's ids, as they arrive in order, to its kind's training stream or the held-out set."""
    result = _Result({}, {}, {})
    current: list[np.ndarray] = []
    done_tokens = 0
    for n, ((i, _), ids) in enumerate(zip(tasks, encoded)):
        current.append(ids)
        if n + 1 < len(tasks) and tasks[n + 1][0] == i:
            continue
        ids = np.concatenate(current)
        current = []
        refuse_separator_inside(ids, separator, tok, f"document {docs[i].name}")
        result.tokens[i] = len(ids)
        done_tokens += len(ids)
        if len(ids) < options.min_tokens:
            result.split[i] = "dropped (under min_tokens)"
        elif docs[i].name in options.heldout or (
            options.heldout_min_tokens <= len(ids) <= options.heldout_max_tokens
            and held_out(docs[i].name, options.seed, options.heldout_fraction)
        ):
            result.split[i] = "heldout"
        else:
            result.split[i] = "train"
            stream = result.train.setdefault(docs[i].kind, [])
            stream += [ids.astype(dtype), np.asarray([separator], dtype=dtype)]
        progress.update(len(result.tokens), done_tokens)
    progress.update(len(result.tokens), done_tokens, force=True)
    for i, k in enumerate(kept):  # documents without a kept file had no task
        if not k:
            result.tokens[i], result.split[i] = 0, "dropped (no files left)"
    return result


def _write(out_dir, result, docs, kept, trees, skipped, tok, separator, dtype, options, command) -> dict:
    """Write the token files, the held-out JSONL and the manifest into a temporary folder, then rename it."""
    tmp = out_dir.with_name(f"{out_dir.name}.partial-{os.getpid()}")
    (tmp / "train").mkdir(parents=True)
    (tmp / "heldout").mkdir()
    for kind, stream in sorted(result.train.items()):
        np.save(tmp / "train" / f"{kind}.npy", np.concatenate(stream))
    heldout: dict[str, list[str]] = {}
    for i, doc in enumerate(docs):
        if result.split[i] == "heldout":
            record = {"name": doc.name, "source": doc.root, "text": _text(kept[i], True), "tokens": result.tokens[i]}
            heldout.setdefault(doc.kind, []).append(json.dumps(record, ensure_ascii=False))
    for kind, lines in sorted(heldout.items()):
        (tmp / "heldout" / f"{kind}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    documents = [
        {
            "name": doc.name,
            "kind": doc.kind,
            "tree": doc.root,
            "files": len(kept[i]),
            "bytes": sum(len(f.data) if f.data is not None else os.path.getsize(f.disk) for f, _ in kept[i]),
            "tokens": result.tokens[i],
            "split": result.split[i],
            "license": doc.license,
        }
        for i, doc in enumerate(docs)
    ]

    def total(split: str, kind: str | None = None) -> int:
        return sum(d["tokens"] for d in documents if d["split"] == split and kind in (None, d["kind"]))

    kinds = sorted({d["kind"] for d in documents})
    manifest = {
        "format": FORMAT,
        "command": command,
        "tokenizer": {
            "path": str(tok.path),
            "sha256": tok.fingerprint,
            "vocab_size": tok.vocab_size,
            "separator": tok.hf.convert_ids_to_tokens(separator),
            "separator_id": separator,
            "dtype": dtype.name,
        },
        "options": asdict(options),
        "trees": [{**t, "skipped": skipped.get(t["root"], {})} for t in trees],
        "totals": {
            "documents": sum(d["split"] in ("train", "heldout") for d in documents),
            "tokens": total("train") + total("heldout"),
            "train_tokens": {k: total("train", k) for k in kinds},
            "heldout_tokens": total("heldout"),
            "heldout_documents": sum(d["split"] == "heldout" for d in documents),
        },
        "documents": documents,
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    if out_dir.exists():
        out_dir.rmdir()  # empty, checked at the start
    os.replace(tmp, out_dir)
    return manifest

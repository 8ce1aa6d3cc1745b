"""Long documents from file trees: one document per top-level entry of a folder or a tar archive.

A *tree* is a folder or a tar archive (``.tar``, ``.tar.gz``, ``.tar.xz``, ...). Each top-level entry is
one document: a folder gives its files with the wanted suffixes in sorted path order, a file gives
itself. In a ``site-packages`` folder that is one document per installed package (its ``.py`` files; a
top-level module is a document of one file), as ProLong builds code documents by concatenating the
files of a repository (its ``thestackv1_concat_by_repo`` sources); in the ``_sources`` folder of a
Sphinx build, one per book (``library``, ``tutorial``, ...). Files named ``LICENSE*`` or ``COPYING*`` at
the top of a tree are its license notes, not documents.

Skipped, and counted: caches and packaging metadata (``__pycache__``, ``*.dist-info``, ``*.egg-info``,
hidden folders), files over ``max_file_bytes`` (1 MiB by default, the Stack's limit), and optionally
folders named ``test`` or ``tests``. Reading, decoding and deduplication happen in mtraining.data.corpus.
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .documents import DataError

CODE_SUFFIXES = (".py",)
PROSE_SUFFIXES = (".txt", ".rst", ".md")
SKIP_DIRS = ("__pycache__",)
SKIP_DIR_SUFFIXES = (".dist-info", ".egg-info", ".data")
TEST_DIRS = ("test", "tests")
LICENSE_PREFIXES = ("license", "copying")
MAX_FILE_BYTES = 1 << 20


@dataclass(frozen=True)
class TreeFile:
    """One file of a document: ``path`` relative to the tree (the header the document shows), and where its
    bytes are: a file on disk (``disk``) or the bytes of an archive member (``data``)."""

    path: str
    disk: str | None = None
    data: bytes | None = None

    def read(self) -> bytes:
        if self.data is not None:
            return self.data
        with open(self.disk, "rb") as f:
            return f.read()


@dataclass
class TreeDocument:
    """One document: a top-level entry of a tree, its files in sorted path order."""

    name: str
    kind: str
    root: str
    files: list[TreeFile]
    license: str | None = None


@dataclass
class Tree:
    """A tree's documents and what was left out of them (counts by reason), with its license notes."""

    root: str
    kind: str
    documents: list[TreeDocument]
    skipped: dict[str, int] = field(default_factory=dict)
    licenses: dict[str, str] = field(default_factory=dict)

    def skip(self, reason: str, count: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + count


def _is_archive(path: Path) -> bool:
    return path.is_file() and tarfile.is_tarfile(path)


def _skip_dir(name: str, skip_tests: bool) -> str | None:
    """Why a folder is skipped, or None."""
    if name in SKIP_DIRS or name.endswith(SKIP_DIR_SUFFIXES) or name.startswith("."):
        return "files in metadata folders"
    if skip_tests and name in TEST_DIRS:
        return "files in test folders"
    return None


def _is_license(name: str) -> bool:
    return name.lower().startswith(LICENSE_PREFIXES)


def _first_line(data: bytes) -> str:
    text = data.decode("utf-8", errors="replace").strip()
    return text.splitlines()[0][:200] if text else ""


def read_tree(
    root: str | Path,
    kind: str,
    suffixes: tuple[str, ...],
    skip_tests: bool = False,
    max_file_bytes: int = MAX_FILE_BYTES,
) -> Tree:
    """The documents of one tree (a folder or a tar archive), named ``kind/<top-level entry>``."""
    root = Path(root)
    if not root.exists():
        raise DataError(f"{root} does not exist; give a folder or a tar archive")
    tree = Tree(str(root), kind, [])
    groups: dict[str, list[TreeFile]] = {}

    def add(rel: str, size: int, disk: str | None = None, data: bytes | None = None) -> None:
        parts = rel.split("/")
        if len(parts) == 1 and _is_license(parts[0]):
            tree.licenses[rel] = _first_line(data if data is not None else Path(disk).read_bytes())
            return
        if not rel.endswith(suffixes):
            return
        reasons = [r for p in parts[:-1] if (r := _skip_dir(p, skip_tests))]
        if reasons:
            tree.skip(reasons[0])
            return
        if size > max_file_bytes:
            tree.skip("files over max_file_bytes")
            return
        groups.setdefault(parts[0], []).append(TreeFile(rel, disk, data))

    if root.is_dir():
        for folder, _, names in os.walk(root):
            for name in names:
                full = Path(folder) / name
                if full.is_file():
                    add(full.relative_to(root).as_posix(), full.stat().st_size, disk=str(full))
    elif _is_archive(root):
        with tarfile.open(root, "r:*") as archive:
            for member in archive:
                if member.isfile():
                    rel = member.name.removeprefix("./")
                    data = archive.extractfile(member).read() if member.size <= max_file_bytes else None
                    add(rel, member.size, data=data)
    else:
        raise DataError(f"{root} is neither a folder nor a tar archive")
    for top in sorted(groups):
        name = top[: -len(".py")] if top.endswith(".py") else top
        files = sorted(groups[top], key=lambda f: f.path)
        tree.documents.append(TreeDocument(f"{kind}/{name}", kind, str(root), files))
    return tree


def site_packages(python: str) -> list[Path]:
    """The site-packages folders (purelib, platlib) of the interpreter ``python``."""
    code = "import json, sysconfig; print(json.dumps([sysconfig.get_path('purelib'), sysconfig.get_path('platlib')]))"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise DataError(f"cannot ask {python} for its site-packages ({err}); give the folder with --code") from None
    paths = [Path(p) for p in json.loads(out)]
    return [p for i, p in enumerate(paths) if p.is_dir() and p not in paths[:i]]


def package_licenses(root: Path) -> dict[str, str]:
    """Top-level name -> the license its distribution declares (License-Expression, License, or its
    license classifiers), from the ``*.dist-info`` / ``*.egg-info`` metadata in ``root``."""
    from importlib.metadata import distributions

    found: dict[str, str] = {}
    for dist in sorted(distributions(path=[str(root)]), key=lambda d: d.name or ""):
        meta: Any = dist.metadata  # an email Message at run time, whose .get typeshed's PackageMetadata lacks
        note = meta.get("License-Expression") or (meta.get("License") or "").strip().split("\n")[0][:100]
        if not note:
            classifiers = [c.split(" :: ")[-1] for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
            note = "; ".join(classifiers)
        name = f"{meta.get('Name')} {meta.get('Version')}: {note or 'no license declared'}"
        tops = (dist.read_text("top_level.txt") or "").split()
        if not tops:
            tops = {Path(f).parts[0].removesuffix(".py") for f in dist.files or () if len(Path(f).parts) > 0}
        for top in sorted(tops):
            found.setdefault(top, name)
    return found

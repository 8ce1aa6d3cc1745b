"""Every repository path that a Markdown file or a docstring names exists, so the docs cannot drift from the tree.

A path is a token that starts with a top folder of the repository (``mtraining/``, ``bench/``, ...) or with a
subpackage of mtraining (``ops/``, ``parallel/``, ...; resolved under ``mtraining/``), and ends with a file
suffix or a slash; relative Markdown links count too. Placeholders (``<scale>``, ``...``, ``$OUT``) and
globs with no match are reported like missing files. ``bench/results/`` is left out: its Markdown files are
records of past runs and name the commands of their day.
"""

from __future__ import annotations

import ast
import glob
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = (".ci", "bench", "configs", "data", "experiments", "mtraining", "tests", "tools")
PACKAGES = ("data", "eval", "models", "ops", "parallel", "train")  # also read under mtraining/
PATH = re.compile(rf"(?<![\w./$~-])((?:{'|'.join(map(re.escape, TOP + PACKAGES))})/[\w.*{{}},/-]*[\w*}}/])(?![<\w])")
LINK = re.compile(r"\]\(([^)#\s]+)")
RECORDS = ("bench", "results")


def _expand(token: str) -> list[str]:
    """``a.{json,md}`` as ``a.json`` and ``a.md``."""
    m = re.search(r"\{([^{}]*)\}", token)
    if m is None:
        return [token]
    return [x for alt in m[1].split(",") for x in _expand(token[: m.start()] + alt + token[m.end() :])]


def _is_path(token: str) -> bool:
    """A file (its last part has a suffix), a folder (ends with /) or a glob; not prose such as 'data/FSDP2'."""
    last = token.rstrip("/").rsplit("/", 1)[-1]
    return token.endswith("/") or "." in last or "*" in token or (ROOT / token).is_dir()


def _exists(token: str, base: Path = ROOT) -> bool:
    for path in _expand(token.rstrip(".,")):
        bases = [base] + ([ROOT / "mtraining"] if base == ROOT and path.split("/")[0] in PACKAGES else [])
        if not any(glob.glob(str(b / path)) if "*" in path else (b / path).exists() for b in bases):
            return False
    return True


def _texts() -> list[tuple[Path, str]]:
    """(file, text) of every Markdown file and every docstring of every Python file in the repository."""
    found = []
    for path in sorted(ROOT.rglob("*.md")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] not in (".venv", ".git") and rel.parts[:2] != RECORDS and "site-packages" not in rel.parts:
            found.append((path, path.read_text()))
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in (".venv", ".git", "build") or "site-packages" in rel.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    found.append((path, doc))
    return found


def stale_paths(texts: list[tuple[Path, str]]) -> list[str]:
    """'file: path' for every named path that does not exist."""
    stale = []
    for path, text in texts:
        for m in PATH.finditer(text):
            if "..." not in m[1] and _is_path(m[1]) and not _exists(m[1]):
                stale.append(f"{path.relative_to(ROOT)}: {m[1]}")
        if path.suffix == ".md":
            for m in LINK.finditer(text):
                if "://" not in m[1] and not _exists(m[1], path.parent):
                    stale.append(f"{path.relative_to(ROOT)}: link {m[1]}")
    return sorted(set(stale))


def test_every_named_path_exists():
    stale = stale_paths(_texts())
    assert not stale, "these files name paths that do not exist (fix the name or the text):\n" + "\n".join(stale)


def test_stale_names_are_found():
    doc = ROOT / "DESIGN.md"
    text = (
        "see ops/torch_backend.py, tests/ops/test_kernels.py, `bench/results/extension_<scale>.md`, [x](bench/nope.md)"
    )
    assert stale_paths([(doc, text + ", and data/FSDP2 as prose")]) == [
        "DESIGN.md: bench/nope.md",
        "DESIGN.md: link bench/nope.md",
        "DESIGN.md: ops/torch_backend.py",
    ]


def _notes() -> tuple[dict[str, list[str]], list[tuple[str, str]]]:
    """Where each ``# Note [name]`` is written, and every (file, name) that points at one ("Note [name]")."""
    defined: dict[str, list[str]] = {}
    pointers = []
    files = [*sorted((ROOT / "mtraining").rglob("*.py")), ROOT / "DESIGN.md"]
    for path in files:
        for line in path.read_text().splitlines():
            for name in re.findall(r"Note \[([^\]]+)\]", line):
                if line.strip() == f"# Note [{name}]":
                    defined.setdefault(name, []).append(str(path.relative_to(ROOT)))
                else:
                    pointers.append((str(path.relative_to(ROOT)), name))
    return defined, pointers


def test_every_note_is_written_once_and_every_pointer_finds_it():
    defined, pointers = _notes()
    twice = {name: where for name, where in defined.items() if len(where) > 1}
    missing = sorted({f"{where}: Note [{name}]" for where, name in pointers if name not in defined})
    assert not twice and not missing, f"notes written twice: {twice}; pointers to no note: {missing}"
    assert defined, "the code has no notes"

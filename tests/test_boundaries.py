"""One-way dependencies: each top folder imports only the folders before it in ``ORDER``. The core stands alone;
bench/ builds on it; experiments/ build on both (bench/common.py's provenance and result files, bench's synthetic
inputs and counters); tools/ (the developers' own scripts) may import any of them. Experiments and benchmarks use
the core's public API.

Public means a name in a package's ``__all__``, a subpackage, or a module of a package without ``__all__``
(the modules of ``mtraining.eval`` and ``mtraining.train``); never a name with a leading underscore. A script
that needs more declares it in its docstring: "Internal tool:", naming each private module it imports.
Imports are read from the source at every depth, the lazy ones inside functions included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ORDER = ("mtraining", "bench", "experiments", "tools")
OUTSIDE = ("experiments", "bench")


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every absolute import in ``path``; ``import a.b`` gives ("a.b", [])."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
    return found


def _exported(package: Path) -> set[str] | None:
    """The names in ``package/__init__.py``'s ``__all__`` (assigned and extended), or None without one."""
    names: set[str] | None = None
    for node in ast.parse((package / "__init__.py").read_text()).body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            names = (names or set()) | {e.value for e in node.value.elts}
    return names


def _private(module: str, name: str | None) -> bool:
    """Whether ``from module import name`` (``import module`` for None) reaches past mtraining's public API."""
    parts = module.split(".")
    if any(p.startswith("_") for p in parts) or (name or "").startswith("_"):
        return True
    path = ROOT.joinpath(*parts)
    if not (path / "__init__.py").exists():  # a module: public where its package lists no __all__
        return _exported(path.parent) is not None
    if name is None or (path / name / "__init__.py").exists():
        return False
    names = _exported(path)
    return names is not None and name not in names


def _sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("folder", ORDER[:-1])
def test_a_folder_imports_only_the_folders_before_it(folder):
    later = ORDER[ORDER.index(folder) + 1 :]
    bad = [
        f"{path.relative_to(ROOT)}: {module}"
        for path in _sources(folder)
        for module, _ in _imports(path)
        if module.split(".")[0] in later
    ]
    assert not bad, (
        f"{folder}/ must not depend on {', '.join(f + '/' for f in later)}: move what it needs into {folder}/ "
        "(or a folder before it):\n" + "\n".join(bad)
    )


@pytest.mark.parametrize("folder", OUTSIDE)
def test_experiments_and_benchmarks_use_the_public_api_or_say_so(folder):
    bad = []
    for path in _sources(folder):
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        for module, names in _imports(path):
            if module.split(".")[0] != "mtraining":
                continue
            private = [n for n in names or [None] if _private(module, n)]
            if private and not ("Internal tool:" in docstring and _named(module, private, docstring)):
                bad.append(f"{path.relative_to(ROOT)}: from {module} import {', '.join(map(str, private))}")
    assert not bad, (
        "import these from a package that exports them (or export them there), or declare the script an "
        "internal tool in its docstring ('Internal tool:' and the private module's name):\n" + "\n".join(bad)
    )


def _named(module: str, names: list[str | None], docstring: str) -> bool:
    """The docstring names the private module imported (``module``, or ``module.name`` for a submodule)."""
    return module in docstring or all(f"{module}.{n}" in docstring for n in names)


def test_the_rule_sees_private_names():
    assert _private("mtraining.parallel.ring.plan", "plan_ring")  # a module of a package with __all__
    assert _private("mtraining.ops.sparse", "launch")  # a module that package does not list
    assert _private("mtraining.eval.tasks", "_render")  # an underscore name
    assert not _private("mtraining.ops", "sparse_attention")  # listed in __all__
    assert not _private("mtraining.ops", "dense")  # a subpackage
    assert not _private("mtraining.eval.tasks", "generate")  # a module of mtraining.eval (no __all__)


def test_test_modules_do_not_import_each_other():
    """Shared fixtures and helpers live in helper modules (tests/factories.py, tests/train/trainer_runs.py, ...)."""
    bad = [
        f"{path.relative_to(ROOT)}: {module}"
        for path in _sources("tests")
        for module, _ in _imports(path)
        if module.startswith("tests.") and module.rsplit(".", 1)[-1].startswith("test_")
    ]
    assert not bad, "move what these share into a helper module:\n" + "\n".join(bad)

"""No import cycle in the package, counting every import: at module level, inside functions (lazy) and under
``if TYPE_CHECKING``. Modules depend one way (ops.pattern below ops.sparse below ops.estimate, ops below
parallel below models below train below eval), so that each can be read, tested and changed without the
modules above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mtraining"


def _modules(package: Path) -> dict[str, tuple[Path, bool]]:
    """Every module of ``package``: dotted name -> (file, is a package's __init__)."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _known(name: str, modules: dict) -> str | None:
    """The package module that importing ``name`` runs last: name itself, or its nearest parent module."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in modules else None


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports, anywhere in its source. ``from pkg import name`` imports the
    module pkg.name where there is one, else pkg (its __init__)."""
    modules = _modules(package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        here = name.split(".") if is_package else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[: len(here) - node.level + 1] + [node.module or ""]) if node.level else node.module
                base = (base or "").rstrip(".")
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
                ]
            else:
                continue
            graph[name].update(t for t in (_known(target, modules) for target in targets) if t and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "mtraining.ops.estimate.estimator" in graph["mtraining.ops.estimate"]  # the walk sees the package
    found = cycles(graph)
    assert not found, "import cycles (each a set of modules that import each other, lazily included):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_a_lazy_import_back_up_is_a_cycle(tmp_path):
    """The finder sees an import inside a function, as the one that tied the pattern to its estimator was."""
    package = tmp_path / "pkg"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("from .core import Pattern\n")
    (package / "low" / "core.py").write_text(
        "class Pattern:\n    def estimate(self):\n        from ..high import run\n"
    )
    (package / "high.py").write_text("from .low import Pattern\n\ndef run():\n    return Pattern\n")
    assert cycles(import_graph(package)) == [["pkg.high", "pkg.low", "pkg.low.core"]]
    (package / "low" / "core.py").write_text("class Pattern:\n    pass\n")
    assert cycles(import_graph(package)) == []

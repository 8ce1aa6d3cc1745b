"""The code base passes the project's linter, formatter and type checker, as configured in pyproject.toml.

ruff lints (a complexity limit included: C901, ``max-complexity``) and formats every Python file; mypy
checks the package.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff(args):
    done = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, (
        f"ruff {' '.join(args)} failed (ruff comes with the test extra: pip install -e '.[test]'; "
        f"fix with `ruff check --fix . && ruff format .`):\n{done.stdout}{done.stderr}"
    )


def test_mypy():
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, (
        f"mypy failed (it comes with the test extra: pip install -e '.[test]'; run `python -m mypy`):\n"
        f"{done.stdout}{done.stderr}"
    )

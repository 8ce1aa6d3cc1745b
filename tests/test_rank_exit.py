"""mtraining/rank_exit.py: a command-line run leaves through os._exit with its command's exit code (an uncaught
error: its traceback and 1), its output flushed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mtraining import rank_exit


class _Exited(Exception):
    """What the patched os._exit raises, with the code it was given."""


def _raise(error: BaseException | None):
    def command() -> None:
        print("last line")
        if error is not None:
            raise error

    return command


@pytest.mark.parametrize(
    "raised, code, err",
    [
        (SystemExit(3), 3, ""),
        (SystemExit(None), 0, ""),
        (SystemExit("bad"), 1, "bad\n"),
        (None, 0, ""),
        (RuntimeError("broken"), 1, "RuntimeError: broken\n"),
        (KeyboardInterrupt(), 130, "KeyboardInterrupt\n"),
    ],
)
def test_the_command_leaves_with_os_exit_and_its_code(monkeypatch, capsys, raised, code, err):
    def exit_now(value: int) -> None:
        raise _Exited(value)

    monkeypatch.setattr(rank_exit.os, "_exit", exit_now)
    with pytest.raises(_Exited) as exited:
        rank_exit.run_command(_raise(raised))
    assert exited.value.args == (code,)
    out, printed = capsys.readouterr()
    assert out == "last line\n" and printed.endswith(err)
    if isinstance(raised, (RuntimeError, KeyboardInterrupt)):
        assert printed.startswith("Traceback")


@pytest.mark.slow
def test_the_installed_script_goes_through_it():
    """`mtraining` (pyproject's script) runs cli.main, which leaves through run_command; its exit code is the
    command's."""
    from pathlib import Path

    import tomllib

    scripts = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["mtraining"] == "mtraining.cli:main"
    proc = subprocess.run(
        [sys.executable, "-c", "from mtraining.cli import main; main()", "train", "/no/such/config.yaml"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "config.yaml" in proc.stdout + proc.stderr

"""mtraining/rank_exit.py: a torchrun worker leaves through os._exit with its command's exit code, its output
flushed; outside torchrun the command exits as Python does."""

from __future__ import annotations

import pytest

from mtraining import rank_exit


class _Exited(Exception):
    """What the patched os._exit raises, with the code it was given."""


@pytest.mark.parametrize("raised, code", [(SystemExit(3), 3), (SystemExit(None), 0), (SystemExit("bad"), 1), (None, 0)])
def test_a_torchrun_worker_leaves_with_os_exit_and_the_commands_code(monkeypatch, capsys, raised, code):
    def command() -> None:
        print("last line")
        if raised is not None:
            raise raised

    def exit_now(value: int) -> None:
        raise _Exited(value)

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setattr(rank_exit.os, "_exit", exit_now)
    with pytest.raises(_Exited) as exited:
        rank_exit.run_command(command)
    assert exited.value.args == (code,)
    out, err = capsys.readouterr()
    assert out == "last line\n" and err == ("bad\n" if code == 1 else "")


def test_outside_torchrun_the_command_exits_as_python_does(monkeypatch):
    def command() -> None:
        raise SystemExit(4)

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(rank_exit.os, "_exit", lambda code: pytest.fail("os._exit outside torchrun"))
    with pytest.raises(SystemExit) as stop:
        rank_exit.run_command(command)
    assert stop.value.code == 4

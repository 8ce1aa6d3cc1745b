"""Start torchrun for ``mtraining train --nproc N``, pass signals on, and exit with a code that says why.

``launch`` (the ``--nproc`` launcher) starts ``python -m mtraining.train.torchrun`` in a session of
its own and forwards the first SIGINT, SIGTERM or SIGHUP it receives, then waits: torchrun passes
the signal to every rank (SIGTERM: they finish the step, save and exit 143; SIGINT: they stop at
once) and kills any rank still alive after its shutdown timeout (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``,
30 s by default), so no process outlives the launcher. Later signals are not forwarded: a second
one would make torchrun quit before its ranks are gone.

Run as a module (``python -m mtraining.train.torchrun ARGS``, the arguments of torchrun), this is
torchrun with a quiet ending: 128 + the signal when torchrun was signalled, the ranks' own code when
they explained their exit (errors.py), and torchrun's report naming the failed rank otherwise.
"""

from __future__ import annotations

import signal
import subprocess
import sys

from .errors import EXPLAINED_EXIT_CODES

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def launch(torchrun_args: list[str]) -> int:
    """Run torchrun with ``torchrun_args`` until it exits, forwarding the first signal; its exit code."""
    proc: subprocess.Popen | None = None
    received: list[int] = []

    def forward(signum: int, frame) -> None:
        received.append(signum)
        if len(received) == 1 and proc is not None:
            proc.send_signal(signum)
        elif len(received) > 1:
            print("stopping: waiting for the ranks to exit", file=sys.stderr, flush=True)

    previous = {s: signal.signal(s, forward) for s in _FORWARDED}
    try:
        cmd = [sys.executable, "-m", "mtraining.train.torchrun", *torchrun_args]
        proc = subprocess.Popen(cmd, start_new_session=True)  # terminal signals reach the launcher only
        if received:  # a signal that came while torchrun was being started
            proc.send_signal(received[0])
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - code if code < 0 else code


def main(argv: list[str] | None = None) -> int:
    """torchrun's ``run`` with the exit codes of the module docstring."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except SignalException as err:
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        _, failure = err.get_first_failure()
        if failure.exitcode in EXPLAINED_EXIT_CODES:
            return failure.exitcode
        print(err.format_msg(), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

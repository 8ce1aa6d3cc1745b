"""How a command-line run of mtraining ends its process.

Every entry point (the ``mtraining`` script, ``python -m mtraining.cli`` and ``python -m mtraining.eval.cli``,
which torchrun starts on every rank) ends with ``os._exit`` once its command has closed its outputs and left
the process group. Python's own teardown could otherwise meet one of gloo's worker threads still releasing
the tensors of the last collective: that needs the GIL, which a finalizing interpreter no longer hands out,
and the process dies with SIGABRT ("terminate called without an active exception") after a good run. A
single process is exposed as much as a torchrun worker: it trains in a process group of one.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Callable

EXIT_INTERRUPTED_BY_USER = 130  # the shell's code for SIGINT


def run_command(command: Callable[[], object]) -> None:
    """Run a typer app (``command()``, which ends by raising SystemExit) and leave with its exit code through
    ``os._exit``, after flushing the logs and the standard streams; an uncaught error prints its traceback and
    exits 1 (Ctrl-C: 130), as Python would."""
    try:
        command()
        code = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:  # sys.exit("message"): print it as Python would
            print(stop.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = EXIT_INTERRUPTED_BY_USER
    except Exception:
        traceback.print_exc()
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

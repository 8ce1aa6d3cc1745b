"""How a command run by torchrun on every rank ends its process.

A torchrun worker ends with ``os._exit`` once its command has closed its outputs and left the process
group. Python's own teardown could otherwise meet one of gloo's worker threads still releasing the tensors
of the last collective: that needs the GIL, which a finalizing interpreter no longer hands out, and the rank
dies with SIGABRT ("terminate called without an active exception") after a good run.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable


def run_command(command: Callable[[], object]) -> None:
    """Run a typer app (``command()``, which ends by raising SystemExit); in a torchrun worker, leave with its
    exit code through ``os._exit`` after flushing the logs and the standard streams."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        command()
        return
    try:
        command()
        code = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:  # sys.exit("message"): print it as Python would
            print(stop.code, file=sys.stderr)
            code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

"""Why a training run stopped early, and the process exit code that says so.

Every rank raises the same ``RunStopped`` at the same step; ``mtraining train`` prints its message
and exits with its code, so schedulers and scripts can tell the cases apart:

    0    finished
    1    a crash (a bug or an unexpected error: the traceback is printed)
    2    the config or the command line cannot run (the message names the fix)
    3    ``Diverged``: the loss or the gradient norm became NaN or infinite
    4    ``RankStalled``: a rank stopped responding (a collective timed out, or a peer died)
    5    ``SaveFailed``: a checkpoint or the export could not be written (full disk, permissions)
    130  interrupted (SIGINT, Ctrl-C): no checkpoint is written
    143  ``Preempted``: SIGTERM; the ranks finished the step and saved a checkpoint; run the same
         command again to resume
"""

from __future__ import annotations

EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130


class RunStopped(RuntimeError):
    """A run that ended before ``train.steps`` for a reason the message explains."""

    exit_code = 1


class Diverged(RunStopped):
    """The loss or the gradient norm of a step is not finite (the step was not applied)."""

    exit_code = 3


class RankStalled(RunStopped):
    """A collective did not complete: a rank stopped responding or died."""

    exit_code = 4


class Preempted(RunStopped):
    """SIGTERM: every rank finished the same step and a checkpoint of it was saved."""

    exit_code = 143


class SaveFailed(RunStopped):
    """A checkpoint or the export could not be written (full disk, permissions)."""

    exit_code = 5


# the codes that mean "the ranks said why" (everything but 0 and a crash's 1)
EXPLAINED_EXIT_CODES = frozenset(
    {EXIT_CONFIG, EXIT_INTERRUPTED, Diverged.exit_code, RankStalled.exit_code, SaveFailed.exit_code}
    | {Preempted.exit_code}
)

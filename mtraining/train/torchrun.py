"""Start torchrun for ``mtraining train --nproc N``, pass signals on, and exit with a code that says why.

``torchrun_command`` builds torchrun's options for one node or for this node of a multi-node job
(``--nnodes/--node-rank/--rdzv-endpoint``). ``launch`` (the ``--nproc`` launcher) starts
``python -m mtraining.train.torchrun`` in a session of its own and forwards the first SIGINT, SIGTERM
or SIGHUP it receives, then waits: torchrun passes the signal to every rank of this node (SIGTERM:
they finish the step, save and exit 143; SIGINT: they stop at once) and kills any rank still alive
after its shutdown timeout (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, 30 s by default), so no process
outlives the launcher. Later signals are not forwarded: a second
one would make torchrun quit before its ranks are gone.

Run as a module (``python -m mtraining.train.torchrun ARGS``, the arguments of torchrun), this is
torchrun with a quiet ending: 128 + the signal when torchrun was signalled, the ranks' own code when
they explained their exit (errors.py), and torchrun's report naming the failed rank otherwise.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys

from .errors import EXPLAINED_EXIT_CODES

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def torchrun_command(
    nproc: int, nnodes: int = 1, node_rank: int | None = None, rdzv_endpoint: str | None = None
) -> list[str]:
    """torchrun's options (without the program to run) that start ``nproc`` ranks on this node.

    One node: a standalone rendezvous on a free local port. Several: every node runs the same
    command with its own ``node_rank``; node 0 hosts the rendezvous at ``rdzv_endpoint`` (host:port),
    and node n's ranks are n*nproc .. n*nproc + nproc - 1 (nodes hold consecutive ranks, which the
    hierarchical ring's inner rings rely on).
    """
    if nproc < 1 or nnodes < 1:
        raise ValueError(f"--nproc and --nnodes must be at least 1, got {nproc} and {nnodes}")
    cmd = [f"--nproc-per-node={nproc}"]
    if nnodes == 1:
        if node_rank not in (None, 0) or rdzv_endpoint is not None:
            raise ValueError("--node-rank and --rdzv-endpoint are for multi-node jobs: add --nnodes N")
        return cmd + ["--standalone"]
    if node_rank is None or not 0 <= node_rank < nnodes or not rdzv_endpoint:
        raise ValueError(
            f"a job of --nnodes {nnodes} needs, on every node, --node-rank (0 .. {nnodes - 1}, 0 on the node "
            "whose address is the endpoint) and --rdzv-endpoint HOST:PORT (that node's address and a free port)"
        )
    host, sep, port = rdzv_endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--rdzv-endpoint must look like HOST:PORT, e.g. node-0:29500, got {rdzv_endpoint!r}")
    if not 0 < int(port) < 1 << 16:
        raise ValueError(f"--rdzv-endpoint {rdzv_endpoint}: port {port} is not a port: give one of 1 .. 65535")
    return cmd + [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--rdzv-endpoint={rdzv_endpoint}"]


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

    # its "failed (exitcode: N)" line repeats what the ranks said; a crash's report is printed below
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
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

"""The nodes of a multi-node launch meet before torchrun starts, saying whom they wait for, with a time-out.

torchrun's static rendezvous (node 0's torchrun hosts a TCPStore at ``--rdzv-endpoint``, the other nodes
connect) waits silently, up to 600 s, inside a call that Ctrl-C does not interrupt. So the ``--nproc``
launcher of each node meets the others first, at the same endpoint: node 0's launcher hosts a TCPStore
there and every launcher writes that its node arrived, then polls until every node has, printing who
is missing every 15 s. Node 0 then waits until every other node has confirmed that it saw that (so none reads a closed
store), closes the store and frees the port, and every node starts torchrun, whose rendezvous then
completes at once. A node that does not arrive within the time-out (``parallel.timeout_minutes``) stops
the others with exit 4 naming it; Ctrl-C stops the waiting at once (exit 130 in the command line); two
launchers with the same ``--node-rank`` are refused.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable

import torch.distributed as dist

from .errors import RankStalled

_KEY = "mtraining/nodes/{stage}/{node}"
_POLL_S = 0.2
_SAY_EVERY_S = 15.0
_CONNECT_S = 2.0  # a client's connection attempt; Ctrl-C is seen between attempts
_ANSWER_S = 20.0  # how long a connected client may wait for the store's answer (a store answers in milliseconds)


class NodesMissing(RankStalled):
    """A node of a multi-node launch did not arrive (or left) within the time-out (exit 4)."""


class NotARendezvous(ValueError):
    """The endpoint's port is held by a program that is not node 0's launcher."""


def meet_nodes(
    endpoint: str, nnodes: int, node_rank: int, timeout_s: float, say: Callable[[str], None] = print
) -> None:
    """Return once the launchers of all ``nnodes`` nodes have met at ``endpoint`` (HOST:PORT, the port free
    again when this returns); NodesMissing after ``timeout_s``; ValueError for a port in use or a
    ``node_rank`` that another launcher holds."""
    host, _, port = endpoint.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # [::1]
    deadline = time.monotonic() + timeout_s
    if node_rank == 0:
        store = _host_store(host, int(port), endpoint)
    else:
        try:
            socket.getaddrinfo(host, int(port))
        except socket.gaierror as err:
            raise ValueError(
                f"cannot resolve the host {host} of --rdzv-endpoint {endpoint} ({err.strerror}); give node 0's "
                "address or a name this node resolves"
            ) from None
        store = _connect(host, int(port), endpoint, deadline, timeout_s, say)
    me = f"{uuid.uuid4().hex} {socket.gethostname()} (pid {os.getpid()})"  # unique even between threads
    holder = store.compare_set(_KEY.format(stage="arrived", node=node_rank), "", me).decode()
    if holder != me:
        raise ValueError(
            f"--node-rank {node_rank} is taken by the launcher on {holder.split(' ', 1)[1]}; give each node its own "
            f"--node-rank (0 .. {nnodes - 1})"
        )
    _wait(store, "arrived", range(nnodes), endpoint, deadline, timeout_s, say)
    if node_rank == 0:
        _wait(store, "confirmed", range(1, nnodes), endpoint, deadline, timeout_s, say)
    else:
        store.set(_KEY.format(stage="confirmed", node=node_rank), "1")
    del store  # node 0: closes the server, so torchrun can host its own store on the port


def _host_store(host: str, port: int, endpoint: str) -> dist.TCPStore:
    try:
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False)
    except (RuntimeError, ValueError) as err:
        raise ValueError(
            f"node 0 cannot open the rendezvous at --rdzv-endpoint {endpoint} ({err}); pass a free port of this node"
        ) from None


def _connect(
    host: str, port: int, endpoint: str, deadline: float, timeout_s: float, say: Callable[[str], None]
) -> dist.TCPStore:
    """A client of node 0's store, tried until the deadline (node 0 may start later). The port is probed with
    a plain connection first: a refused TCPStore client logs a stack trace per attempt."""
    said = -_SAY_EVERY_S
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(_CONNECT_S, left))).close()
            return _client(host, port, endpoint, datetime.timedelta(seconds=max(1.0, min(_CONNECT_S, left))))
        except NotARendezvous:
            raise
        except (OSError, RuntimeError, ValueError):
            time.sleep(_POLL_S)
        now = time.monotonic()
        if now >= deadline:
            raise NodesMissing(
                f"node 0 did not open the rendezvous at {endpoint} within {timeout_s:.0f} s "
                "(parallel.timeout_minutes); start the same command with --node-rank 0 on the node of that address, "
                "and check that this node can reach it"
            )
        if now - said >= _SAY_EVERY_S:
            say(f"waiting for node 0 to open the rendezvous at {endpoint} ({deadline - now:.0f} s left)")
            said = now


def _client(host: str, port: int, endpoint: str, timeout: datetime.timedelta) -> dist.TCPStore:
    """A TCPStore client, made in a thread: a store answers at once, but the client waits forever (and deaf to
    Ctrl-C) on a port where another program listens without answering, so that is refused after _ANSWER_S."""
    made: list = []

    def connect() -> None:
        try:
            made.append(dist.TCPStore(host, port, is_master=False, timeout=timeout))
        except Exception as err:  # handed to the caller
            made.append(err)

    thread = threading.Thread(target=connect, name="rendezvous-client", daemon=True)
    thread.start()
    thread.join(_ANSWER_S)
    if not made:
        raise NotARendezvous(
            f"{endpoint} accepts connections but does not answer as node 0's rendezvous within {_ANSWER_S:.0f} s: "
            "another program listens on that port; give --rdzv-endpoint a free port of node 0 (the same on every "
            "node)"
        )
    if isinstance(made[0], Exception):
        raise made[0]
    return made[0]


def _wait(
    store: dist.TCPStore,
    stage: str,
    nodes: Iterable[int],
    endpoint: str,
    deadline: float,
    timeout_s: float,
    say: Callable[[str], None],
) -> None:
    """Poll until every node in ``nodes`` has written its ``stage`` key, saying who is missing."""
    nodes = list(nodes)
    said = time.monotonic() - _SAY_EVERY_S + 1.0  # first said after 1 s: nodes that start together say nothing
    while True:
        try:
            missing = [n for n in nodes if not store.check([_KEY.format(stage=stage, node=n)])]
        except (RuntimeError, ValueError) as err:
            raise NodesMissing(f"the rendezvous at {endpoint} went away ({err}): node 0's launcher stopped") from None
        if not missing:
            return
        now = time.monotonic()
        names = ", ".join(map(str, missing))
        if now >= deadline:
            raise NodesMissing(
                f"node(s) {names} did not reach the rendezvous at {endpoint} within {timeout_s:.0f} s "
                "(parallel.timeout_minutes); start the same command with that --node-rank there (a node arrives "
                "after its own checks and tokenisation: `mtraining tokenize CONFIG` beforehand shortens them), and "
                "check that it can reach this address"
            )
        if now - said >= _SAY_EVERY_S:
            arrived = len(nodes) - len(missing)
            say(
                f"waiting at the rendezvous {endpoint}: {arrived} of {len(nodes)} nodes {stage}; missing node(s) "
                f"{names} ({deadline - now:.0f} s left)"
            )
            said = now
        time.sleep(_POLL_S)

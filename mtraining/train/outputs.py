"""Output folders, checked at start: a run must not train for hours and then fail at its first save.

Every rank writes its checkpoint shards into ``checkpoint.dir`` and rank 0 commits them, so that folder must
be one that every node sees (shared storage); ``check_shared_dir`` refuses one that is not. ``log.dir`` and
``checkpoint.export_dir`` are written by rank 0 alone (each rank's profile trace aside) and need not be shared.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

import torch.distributed as dist

from .agree import SharedError, agree, all_gather, from_rank0, node, which_ranks
from .config import Config

EXPORT_RECORD = "mtraining_export.json"
"""The file every export writes last: a folder holding it may be replaced by a later export."""
PROBES = (".write-test-", ".shared-check-")
"""Name prefixes of the short-lived files the start's checks write (every rank at once): never a user's file."""
_SHARED_WAIT_S = 5.0  # how long a rank looks for rank 0's file (a network file system may show it late)


def check_output_dir(path: str | None, key: str) -> None:
    """Create ``path`` if needed and write a probe file there; ValueError naming ``key`` if that fails."""
    if path is None:
        return
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{key}={path} is a file, not a folder; set {key} to a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f"{PROBES[0]}{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ValueError(
            f"{key}={path} is not writable ({err.strerror}); fix its permissions or set {key} to a writable folder"
        ) from None


def check_export_target(out: str | Path, cfg: Config, key: str) -> None:
    """ValueError unless an export may go to ``out``: a new or empty folder, or an earlier export (its
    ``EXPORT_RECORD``); neither the model folder (model.path) nor the tokenizer's folder the run reads, nor a
    folder holding checkpoint.dir or log.dir (an export replaces its folder whole)."""
    out = Path(out)
    target = out.resolve()
    for read_key, read in (("model.path", cfg.model.path), ("data.tokenizer", cfg.data.tokenizer)):
        folder = Path(read).resolve() if read is not None else None
        if folder is not None and target == (folder.parent if folder.is_file() else folder):
            raise ValueError(
                f"{key}={out} is the folder of {read_key}: the export would replace the files this run reads; "
                f"set {key} to another folder"
            )
    for other_key, other in (("checkpoint.dir", cfg.checkpoint.dir), ("log.dir", cfg.log.dir)):
        if other is not None and Path(other).resolve().is_relative_to(target):
            raise ValueError(
                f"{key}={out} holds {other_key}={other}: an export replaces its folder whole; set {key} to a "
                "folder of its own (e.g. beside the checkpoints)"
            )
    if out.exists() and not out.is_dir():
        raise ValueError(f"{key}={out} is a file, not a folder; set {key} to a folder")
    # another rank's probe may be there for a moment: the ranks check their folders at once
    found = sorted(p.name for p in out.iterdir() if not p.name.startswith(PROBES)) if out.is_dir() else []
    if found and EXPORT_RECORD not in found:
        raise ValueError(
            f"{key}={out} holds files that no export wrote ({', '.join(found[:5])}{', ...' if len(found) > 5 else ''})"
            f"; set {key} to a new folder, or empty that one"
        )


def check_output_dirs(cfg: Config) -> None:
    """Every folder the run will write into."""
    if cfg.checkpoint.export_dir is not None:
        check_export_target(cfg.checkpoint.export_dir, cfg, "checkpoint.export_dir")
    for key, path in (
        ("checkpoint.dir", cfg.checkpoint.dir),
        ("checkpoint.export_dir", cfg.checkpoint.export_dir),
        ("log.dir", cfg.log.dir),
    ):
        check_output_dir(path, key)


def check_free_space(path: str | None, needed: int, key: str) -> None:
    """ValueError when the disk of ``path`` has less than ``needed`` bytes free (one checkpoint)."""
    if path is None:
        return
    free = shutil.disk_usage(path).free
    if free < needed:
        raise ValueError(
            f"{key}={path} has {free / 1e9:.2f} GB free but one checkpoint takes about {needed / 1e9:.2f} GB; "
            f"free space there or set {key} to a larger disk"
        )


def check_shared_dir(path: str | None, key: str) -> None:
    """Collective: SharedError on every rank unless every rank sees the folder rank 0 sees at ``path``: rank 0
    writes a file with a fresh name there, every rank looks for it (a few seconds at most)."""
    if path is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    marker = Path(path) / from_rank0(f"{PROBES[1]}{uuid.uuid4().hex}")
    rank = dist.get_rank()

    def write() -> None:
        if rank == 0:
            try:
                marker.write_bytes(b"")
            except OSError as err:
                raise ValueError(f"{key}={path} is not writable ({err.strerror})") from None

    agree(write)
    deadline = time.monotonic() + _SHARED_WAIT_S
    while not (seen := marker.is_file()) and time.monotonic() < deadline:
        time.sleep(0.2)
    every = all_gather((seen, node()))
    if rank == 0:
        marker.unlink(missing_ok=True)
    blind = [r for r, (ok, _) in enumerate(every) if not ok]
    if blind:
        raise SharedError(
            f"{key}={path} is not one folder for every rank: {which_ranks(blind, [n for _, n in every])} do not see "
            f"the file rank 0 wrote there (each node has its own {path}); every rank writes its checkpoint shards "
            f"into {key} and rank 0 commits them, so set {key} to a folder on storage every node mounts (an absolute "
            "path: a relative one is relative to each node's copy of the config)"
        )

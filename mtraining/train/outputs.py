"""Output folders, checked at start: a run must not train for hours and then fail at its first save."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .config import Config


def check_output_dir(path: str | None, key: str) -> None:
    """Create ``path`` if needed and write a probe file there; ValueError naming ``key`` if that fails."""
    if path is None:
        return
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{key}={path} is a file, not a folder; set {key} to a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ValueError(
            f"{key}={path} is not writable ({err.strerror}); fix its permissions or set {key} to a writable folder"
        ) from None


def check_output_dirs(cfg: Config) -> None:
    """Every folder the run will write into."""
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

"""Distributed checkpoints (torch.distributed.checkpoint), committed atomically and verified before use.

A checkpoint is ``DIR/step_NNNNNNNN/``: DCP's shards (``__<rank>_<i>.distcp``) and ``.metadata``,
plus ``manifest.json``: the step, what run it belongs to (``run``: model, vocabulary, world shape,
schedule; train/resume.py) and the size and SHA-256 of every file. Ranks write under
``step_NNNNNNNN.partial/``; once every rank has written and hashed its own files, rank 0 writes the
manifest and renames the folder, so a ``step_N`` folder is always whole, and a save that dies half
way (or a ``checkpoint.resume=false`` run killed while overwriting a step) leaves the previous
``step_N`` as it was. Before a checkpoint is used its files are checked against the manifest (each
rank hashes a share); ``newest_verified`` skips a corrupt one, saying why, for the newest that
verifies. The data order and the learning rate are pure functions of the step, so loading one and
continuing gives the same next step as never stopping.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ..data.cache import file_digest
from .agree import all_gather, from_rank0
from .errors import SaveFailed

MANIFEST = "manifest.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
_PARTIAL = ".partial"
_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust libraries (safetensors) quote an OS error


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says why and what to do."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def checkpoints(root: str | Path | None) -> list[Path]:
    """The committed ``step_N`` folders under ``root``, newest first (unverified)."""
    if root is None or not Path(root).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(root).iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _describe(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": file_digest(path)}


def save_checkpoint(
    root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, run: dict | None = None
) -> Path:
    """Collective: every rank writes and hashes its shards of model and optimizer state after ``step``
    steps; rank 0 writes the manifest (with ``run``, what the checkpoint belongs to) and commits."""
    final = step_dir(root, step)
    partial = final.with_name(final.name + _PARTIAL)
    rank, _ = _rank_world()
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a save of this step that died
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)}, checkpoint_id=partial)
        mine = {p.name: _describe(p) for p in sorted(partial.glob(f"__{rank}_*.distcp"))}
    except (Exception, CheckpointException) as err:
        raise write_error(err, final, "saving checkpoint") from None
    files = {name: info for part in all_gather(mine) for name, info in part.items()}
    failure = None
    if rank == 0:
        try:
            for p in sorted(partial.iterdir()):  # .metadata and anything no rank claimed
                files.setdefault(p.name, _describe(p))
            manifest = {"format": FORMAT, "step": step, "run": run or {}, "files": files}
            _write_json(partial / MANIFEST, manifest)
            _commit(partial, final)
        except OSError as err:
            failure = write_error(err, final, "saving checkpoint")
    failure = from_rank0(failure)  # every rank learns whether the commit worked
    if failure is not None:
        raise failure
    return final


def _write_json(path: Path, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _commit(partial: Path, final: Path) -> None:
    """Rename the written folder into place; an existing step folder is replaced only after that."""
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(partial, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash
    finally:
        os.close(fd)


def _errno(err: BaseException) -> int | None:
    """The OS error number of a failed write: an OSError's, or the one a library quotes ("(os error 13)")."""
    if isinstance(err, OSError):
        return err.errno
    found = _OS_ERROR.search(str(err))
    return int(found.group(1)) if found else None


def write_error(err: BaseException, target: Path, what: str) -> BaseException:
    """A clear SaveFailed for a write the file system refused (full disk, permissions, a read-only or missing
    folder); other errors pass through unchanged."""
    causes = list(err.failures.values()) if isinstance(err, CheckpointException) else [(err, None)]
    errors = [e for e, _ in causes]
    text = " ".join(str(e) for e in errors)
    folder = target.parent
    free = shutil.disk_usage(folder).free if folder.exists() else None
    codes = [code for e in errors if (code := _errno(e)) is not None]
    full = any(code in (errno.ENOSPC, errno.EDQUOT) for code in codes)
    # torch's zip writer reports a failed write as "unexpected pos"; the disk being full is then the cause
    full = full or "No space left" in text or ("unexpected pos" in text and free is not None and free < 64 << 20)
    shutil.rmtree(target.with_name(target.name + _PARTIAL), ignore_errors=True)
    if full:
        return SaveFailed(
            f"{what} {target} failed: no space left on the disk of {folder} ({_size(free)} free); "
            "free space there or point checkpoint.dir / checkpoint.export_dir at a larger disk"
        )
    if codes:
        where = next((e.filename for e in errors if isinstance(e, OSError) and e.filename), target)
        denied = codes[0] in (errno.EACCES, errno.EPERM, errno.EROFS)
        fix = "fix its permissions or choose another folder" if denied else "choose another folder"
        return SaveFailed(f"{what} {target} failed: {os.strerror(codes[0])} ({where}); {fix}")
    if isinstance(err, CheckpointException):  # DCP's wrapper is a BaseException: hand on the first cause
        return RuntimeError(f"{what} {target} failed: {errors[0]!r}")
    return err


def _size(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def read_manifest(path: str | Path) -> dict:
    """The manifest of a committed checkpoint; CheckpointError saying what is wrong otherwise."""
    path = Path(path)
    file = path / MANIFEST
    if not file.is_file():
        what = "no .metadata either: an interrupted save" if not (path / ".metadata").is_file() else "an older format"
        raise CheckpointError(f"{path.name} has no {MANIFEST} ({what}), so it cannot be verified")
    try:
        manifest = json.loads(file.read_text())
        files, step = manifest["files"], int(manifest["step"])
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path.name}/{MANIFEST} is unreadable ({err})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path.name} has manifest format {manifest.get('format')}, this version reads {FORMAT}")
    if (m := _STEP_DIR.match(path.name)) and int(m.group(1)) != step:
        raise CheckpointError(f"{path.name}/{MANIFEST} is of step {step}: the folder was renamed or copied over")
    if ".metadata" not in files:
        raise CheckpointError(f"{path.name}/{MANIFEST} lists no .metadata")
    return manifest


def _check_file(path: Path, expected: dict) -> str | None:
    if not path.is_file():
        return f"{path.name} is missing"
    size = path.stat().st_size
    if size != expected["bytes"]:
        return f"{path.name} has {size} bytes, {expected['bytes']} were written (truncated or replaced)"
    if file_digest(path) != expected["sha256"]:
        return f"{path.name} does not match its SHA-256 (bytes changed, or a shard copied from another save)"
    return None


def verify_checkpoint(path: str | Path) -> str | None:
    """None when every file of the checkpoint matches its manifest, else why not.

    Collective when a process group is up: each rank hashes a share of the files and all ranks get
    the same verdict.
    """
    path = Path(path)
    rank, world = _rank_world()
    try:
        files = read_manifest(path)["files"]
        names = sorted(files)[rank::world]
        problems = [why for name in names if (why := _check_file(path / name, files[name]))]
    except CheckpointError as err:
        problems = [str(err)]
    except OSError as err:
        problems = [f"{path.name} cannot be read ({err})"]
    found = list(dict.fromkeys(p for part in all_gather(problems) for p in part))
    return "; ".join(found) if found else None


def newest_verified(root: str | Path | None, report: Callable[[str], None]) -> tuple[Path, dict] | None:
    """(folder, manifest) of the newest checkpoint under ``root`` that verifies, or None; ``report``
    gets one line per checkpoint skipped, with the reason. Collective like ``verify_checkpoint``."""
    for path in checkpoints(root):
        why = verify_checkpoint(path)
        if why is None:
            return path, read_manifest(path)
        report(f"skipping checkpoint {path}: {why}")
    return None


def pick_checkpoint(path: str | Path | None, report: Callable[[str], None]) -> tuple[Path, dict]:
    """(folder, manifest) of a ``step_N`` folder that verifies, or of the newest checkpoint that
    verifies under a checkpoint directory; CheckpointError saying why there is none."""
    if path is None:
        raise CheckpointError("no checkpoint given: set checkpoint.dir or pass a step_N folder")
    path = Path(path)
    if _STEP_DIR.match(path.name) or (path / MANIFEST).is_file() or (path / ".metadata").is_file():
        if why := verify_checkpoint(path):
            raise CheckpointError(f"{path} does not verify: {why}; pass another step_N folder")
        return path, read_manifest(path)
    found = newest_verified(path, report)
    if found is None:
        raise CheckpointError(f"{path} holds no checkpoint that verifies (step_N folders); pass a step_N folder")
    return found


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Restore model (and optimizer) state in place; returns the step it was saved at.

    Collective when a process group is up; without one (offline export) the model is loaded in this
    process. Verify first (``verify_checkpoint``): DCP reads whatever bytes it finds.
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no .metadata); pick a step_N folder that has one")
    step = torch.tensor(0)
    try:
        if optimizer is None:
            state = {"model": get_model_state_dict(model), "step": step}
            with warnings.catch_warnings():  # DCP warns that it loads in one process: intended here
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
            set_model_state_dict(model, state["model"])
        else:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd, "step": step}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    except CheckpointException as err:
        first = next(iter(err.failures.values()))[0]
        raise CheckpointError(f"{path} does not fit this model: {first}") from None
    return int(state["step"])


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the unsharded model state on CPU (rank 0 gets it; other ranks an empty dict)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

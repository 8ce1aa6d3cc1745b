"""Distributed checkpoints (torch.distributed.checkpoint), committed atomically and verified before use.

A checkpoint is ``DIR/step_NNNNNNNN/``: DCP's shards (``__<rank>_<i>.distcp``) and ``.metadata``,
plus ``manifest.json``: the step, what run it belongs to (``run``: model, vocabulary, world shape,
schedule; train/resume.py) and the size and SHA-256 of every file. Ranks write under
``step_NNNNNNNN.partial/``; once every rank has written and hashed its own files, rank 0 writes the
manifest and renames the folder, so a ``step_N`` folder is always whole, and a save that dies half
way (or a ``checkpoint.resume=false`` run killed while overwriting a step) leaves the previous
``step_N`` as it was. Before a checkpoint is used its files are checked against the manifest (each
rank hashes a share); ``newest_verified`` skips a corrupt one, saying why, for the newest that
verifies, and refuses (naming the fix) one that may be whole but cannot be verified here: files its
manifest lists are missing (written on another node's disk), or it has no manifest (an older format;
``python -m mtraining.train.checkpoint adopt DIR/step_N`` records its files as they are). Nothing that
does not verify is deleted: a save of its step keeps it as ``step_N.unverified``. The data order and the
learning rate are pure functions of the step, so loading one and continuing gives the same next step as
never stopping.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shutil
import sys
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


class NotVerifiable(CheckpointError):
    """A checkpoint this version cannot verify although it may be whole: DCP's .metadata without a manifest
    (an older format), or a manifest of another format."""


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
    root: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    run: dict | None = None,
    report: Callable[[str], None] = print,
) -> Path:
    """Collective: every rank writes and hashes its shards of model and optimizer state after ``step``
    steps; rank 0 writes the manifest (with ``run``, what the checkpoint belongs to) and commits (``report``
    gets a line when a step folder that does not verify is kept aside)."""
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
            _commit(partial, final, report)
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


def _commit(partial: Path, final: Path, report: Callable[[str], None]) -> None:
    """Rename the written folder into place; an existing step folder is replaced only after that, and only
    if it verifies: one that does not (it may be whole all the same) is kept under a new name."""
    files = _manifest_files(final) if final.exists() else {}
    if isinstance(files, str) or any(_problems(final, files, sorted(files))):
        kept = _unused_name(final, ".unverified")
        os.replace(final, kept)
        report(f"kept {final.name}, which did not verify, as {kept.name} (this save replaces it)")
    replace_folder(partial, final)


def replace_folder(written: Path, final: Path) -> None:
    """Rename the folder ``written`` to ``final``; an existing ``final`` is moved aside first and removed only
    after the rename, so an interruption leaves one of them whole."""
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(written, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(written, final)
    _sync_folder(final.parent)


def _sync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash
    finally:
        os.close(fd)


def _unused_name(path: Path, suffix: str) -> Path:
    """``path`` + ``suffix``, numbered when that exists."""
    candidate, n = path.with_name(path.name + suffix), 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}{suffix}-{n}")
    return candidate


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
        if older_format(path):
            raise NotVerifiable(
                f"{path.name} has no {MANIFEST} (an older format: a checkpoint of an earlier version, or one copied "
                f"without it), so it cannot be verified; if you trust its files as they are, `python -m "
                f"mtraining.train.checkpoint adopt {path}` records them in a manifest"
            )
        raise CheckpointError(
            f"{path.name} has no {MANIFEST} (no .metadata either: an interrupted save), so it cannot be verified"
        )
    try:
        manifest = json.loads(file.read_text())
        files, step = manifest["files"], int(manifest["step"])
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path.name}/{MANIFEST} is unreadable ({err})") from None
    if manifest.get("format") != FORMAT:
        raise NotVerifiable(
            f"{path.name} has manifest format {manifest.get('format')}, this version reads {FORMAT}: it was written "
            "by another version of mtraining, which can load it"
        )
    if (m := _STEP_DIR.match(path.name)) and int(m.group(1)) != step:
        raise CheckpointError(f"{path.name}/{MANIFEST} is of step {step}: the folder was renamed or copied over")
    if ".metadata" not in files:
        raise CheckpointError(f"{path.name}/{MANIFEST} lists no .metadata")
    return manifest


def older_format(path: Path) -> bool:
    """A whole DCP checkpoint (its .metadata) without a manifest: written before manifests, or copied without."""
    return not (path / MANIFEST).is_file() and (path / ".metadata").is_file()


def _not_verifiable(path: Path) -> bool:
    try:
        read_manifest(path)
    except NotVerifiable:
        return True
    except (CheckpointError, OSError):
        return False
    return False


def _check_file(path: Path, expected: dict, hashes: bool = True) -> str | None:
    size = path.stat().st_size
    if size != expected["bytes"]:
        return f"{path.name} has {size} bytes, {expected['bytes']} were written (truncated or replaced)"
    if hashes and file_digest(path) != expected["sha256"]:
        return f"{path.name} does not match its SHA-256 (bytes changed, or a shard copied from another save)"
    return None


def _manifest_files(path: Path) -> dict | str:
    """The files the manifest lists (name -> size and SHA-256), or why it cannot be read."""
    try:
        return read_manifest(path)["files"]
    except CheckpointError as err:
        return str(err)
    except OSError as err:
        return f"{path.name} cannot be read ({err})"


def _problems(path: Path, files: dict, names: list[str], hashes: bool = True) -> tuple[list[str], list[str]]:
    """(the ``names`` that are absent, every other problem of theirs) against the manifest's ``files``."""
    try:
        missing = [name for name in names if not (path / name).is_file()]
        return missing, [
            why for name in names if name not in missing and (why := _check_file(path / name, files[name], hashes))
        ]
    except OSError as err:
        return [], [f"{path.name} cannot be read ({err})"]


def _verify(path: Path, hashes: bool = True) -> tuple[list[str], list[str]]:
    """Collective when a process group is up: rank 0's manifest, each rank hashing a share of its files in its
    own ``path``. (missing files, other problems). Without ``hashes`` this process alone checks that every file
    is there with its recorded size (what costs no reading: ``mtraining check``, ``checkpoint.keep``)."""
    if not hashes:
        files = _manifest_files(path)
        return ([], [files]) if isinstance(files, str) else _problems(path, files, sorted(files), hashes=False)
    files = from_rank0(_manifest_files(path))
    if isinstance(files, str):
        return [], [files]
    rank, world = _rank_world()
    every = all_gather(_problems(path, files, sorted(files)[rank::world]))
    missing = sorted(name for part, _ in every for name in part)
    return missing, list(dict.fromkeys(p for _, part in every for p in part))


def verify_checkpoint(path: str | Path, hashes: bool = True) -> str | None:
    """None when every file of the checkpoint matches its manifest, else why not.

    Collective when a process group is up: each rank hashes a share of the files and all ranks get
    the same verdict. ``hashes=False``: sizes only, in this process (``_verify``).
    """
    missing, problems = _verify(Path(path), hashes)
    found = [f"{name} is missing" for name in missing] + problems
    return "; ".join(found) if found else None


def _missing_files(path: Path, missing: list[str]) -> CheckpointError:
    return CheckpointError(
        f"{path} lacks {', '.join(missing)}, listed in its {MANIFEST}: the shards of ranks that wrote into another "
        f"folder (checkpoint.dir on each node's own disk?) or files deleted since; copy them into {path} from where "
        f"they were written, or move {path.name} out of {path.parent} to start from the checkpoint before it"
    )


def newest_verified(
    root: str | Path | None, report: Callable[[str], None], hashes: bool = True
) -> tuple[Path, dict] | None:
    """(folder, manifest) of the newest checkpoint under ``root`` that verifies, or None; ``report``
    gets one line per corrupt checkpoint skipped, with the reason (it is kept: a save of its step moves it
    aside). A checkpoint that lacks files its manifest lists, or that this version cannot verify
    (``NotVerifiable``), may still be whole: CheckpointError naming the fix rather than skipping it. Collective
    like ``verify_checkpoint``: every rank walks rank 0's list of folder names, in its own ``root``.
    ``hashes=False``: files checked by their sizes only (``_verify``), without a process group."""
    for path in (Path(root) / name for name in from_rank0([p.name for p in checkpoints(root)])):
        missing, problems = _verify(path, hashes)
        if missing:
            raise _missing_files(path, missing)
        if not problems:
            return path, read_manifest(path)
        if from_rank0(_not_verifiable(path)):
            raise CheckpointError(
                f"{problems[0]}. It is neither loaded nor replaced: move it out of {root} to start from the "
                "checkpoint before it (or from step 0), or point checkpoint.dir at a new folder"
            )
        report(f"skipping checkpoint {path}: {'; '.join(problems)}")
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


def adopt_checkpoint(path: str | Path) -> Path:
    """Write the manifest of an older-format checkpoint (``older_format``) from its files as they are, for a
    user who vouches for them; its run is not recorded, so a resume checks neither model nor schedule (it
    says so). Returns the manifest's path."""
    path = Path(path)
    step = _STEP_DIR.match(path.name)
    if step is None or not older_format(path):
        raise CheckpointError(f"{path} is not a step_N folder with .metadata and without {MANIFEST}; nothing to adopt")
    files = {p.name: _describe(p) for p in sorted(path.iterdir()) if p.is_file()}
    _write_json(path / MANIFEST, {"format": FORMAT, "step": int(step.group(1)), "run": {}, "files": files})
    return path / MANIFEST


def main(argv: list[str] | None = None) -> int:
    """``python -m mtraining.train.checkpoint adopt DIR/step_N``: ``adopt_checkpoint`` (exit 2 when refused)."""
    parser = argparse.ArgumentParser(prog="python -m mtraining.train.checkpoint")
    commands = parser.add_subparsers(dest="command", required=True)
    adopt = commands.add_parser("adopt", help="record the files of a checkpoint without manifest.json as they are")
    adopt.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    try:
        manifest = adopt_checkpoint(args.folder)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {manifest}: its files are verified against it from now on")
    return 0


if __name__ == "__main__":
    sys.exit(main())

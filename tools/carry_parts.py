"""Files too large for one device call, laid out as one folder per call (each at most ``--budget-mb``).

A device call carries at most 64 MiB with the tracked tree, so a set such as FlashAttention-4's wheels (about 102 MB)
travels over several calls. A file larger than the budget is split into ``<name>.part00``, ``.part01`` ... (as
``split -d`` names them); the pieces are packed into ``call1/``, ``call2/`` ... largest first, each folder with one
``SHA256`` (``sha256sum`` lines) of every piece and of every whole file, which ``tools/fa4_wheels.sh`` checks once
all have come before it joins and installs them. Copy ``callN/`` to the carried folder (``.fa4/``) for call N.

    python tools/carry_parts.py --budget-mb 31 --out /tmp/fa4_calls wheels/*.whl
"""

from __future__ import annotations

import argparse
import hashlib
import math
import shutil
from pathlib import Path

MB = 1_000_000


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pieces(files: list[Path], budget: int, work: Path) -> list[Path]:
    """Each file whole if it fits ``budget`` bytes, else split in ``work`` into the fewest equal parts that do."""
    out = []
    for f in files:
        size = f.stat().st_size
        if size <= budget:
            out.append(f)
            continue
        n = math.ceil(size / budget)
        step = math.ceil(size / n)
        with open(f, "rb") as src:
            for i in range(n):
                part = work / f"{f.name}.part{i:02d}"
                part.write_bytes(src.read(step))
                out.append(part)
    return out


def pack(found: list[Path], budget: int) -> list[list[Path]]:
    """The pieces into as few calls as first-fit by decreasing size gives, each call at most ``budget`` bytes."""
    calls: list[list[Path]] = []
    room: list[int] = []
    for p in sorted(found, key=lambda p: -p.stat().st_size):
        size = p.stat().st_size
        i = next((i for i, r in enumerate(room) if size <= r), None)
        if i is None:
            calls.append([])
            room.append(budget)
            i = len(calls) - 1
        calls[i].append(p)
        room[i] -= size
    return calls


def lay_out(files: list[Path], budget_mb: float, out: Path) -> list[Path]:
    """``out/call1``, ``out/call2`` ...: the files' pieces and the shared SHA256; returns the call folders."""
    budget = int(budget_mb * MB)
    work = out / "parts"
    work.mkdir(parents=True, exist_ok=True)
    found = pieces(files, budget, work)
    listing = "".join(f"{sha256(p)}  {p.name}\n" for p in found)
    listing += "".join(f"{sha256(f)}  {f.name}\n" for f in files if f not in found)
    folders = []
    for n, call in enumerate(pack(found, budget), start=1):
        folder = out / f"call{n}"
        folder.mkdir(exist_ok=True)
        for p in call:
            shutil.copy(p, folder / p.name)
        (folder / "SHA256").write_text(listing)
        folders.append(folder)
    shutil.rmtree(work)
    return folders


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", type=Path, nargs="+")
    p.add_argument("--budget-mb", type=float, required=True, help="the most one call carries of these files (MB)")
    p.add_argument("--out", type=Path, required=True, help="where call1/, call2/ ... go")
    args = p.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        p.error(f"--out {args.out} is not empty: give a new folder")
    for folder in lay_out(args.files, args.budget_mb, args.out):
        size = sum(f.stat().st_size for f in folder.iterdir()) / MB
        print(f"{folder}: {len(list(folder.iterdir()))} files, {size:.1f} MB")


if __name__ == "__main__":
    main()

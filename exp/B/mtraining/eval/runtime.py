"""Process-level helpers: the context-parallel group under torchrun, rank-0 output, progress, JSON."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

T = TypeVar("T")


def init_group(device: torch.device) -> dist.ProcessGroup | None:
    """The world group when launched with several ranks (torchrun sets WORLD_SIZE), else None.

    Every rank of the world is one context-parallel rank: NCCL on CUDA devices, gloo on the CPU.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not dist.is_initialized():
        return None
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.group.WORLD if dist.get_world_size() > 1 else None


def shutdown(together: bool = False) -> None:
    """Leave the process group; ``together`` (after success, when every rank gets here) first waits
    for all ranks: a rank tearing gloo down while another still talks to it can abort that one."""
    if dist.is_initialized():
        if together:
            dist.barrier()
        dist.destroy_process_group()


def is_root(group: dist.ProcessGroup | None) -> bool:
    return group is None or dist.get_rank(group) == 0


def console(enabled: bool = True) -> Console:
    """A stderr console that is silent on ranks other than 0."""
    return Console(stderr=True, quiet=not enabled)


def track(items: Iterable[T], total: int, description: str, enabled: bool) -> Iterator[T]:
    """Iterate with a progress bar on rank 0 (plain iteration elsewhere)."""
    if not enabled:
        yield from items
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console(), transient=False) as bar:
        task = bar.add_task(description, total=total)
        for item in items:
            yield item
            bar.advance(task)


def write_json(path: str | Path, data: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def parse_lengths(text: str) -> list[int]:
    """'4K,8K,1M' or '4096,8192' -> sorted unique token counts (K = 1024, M = 1024^2)."""
    out = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        scale = {"k": 1024, "m": 1024 * 1024}.get(part[-1].lower(), 1)
        number = part[:-1] if scale > 1 else part
        try:
            value = int(float(number) * scale)
        except ValueError:
            raise ValueError(f"cannot read length {part!r}; write lengths like 4K,32K,512K or 4096,32768") from None
        if value <= 0:
            raise ValueError(f"lengths must be positive, got {part!r}")
        out.add(value)
    if not out:
        raise ValueError("no lengths given; pass e.g. --lengths 4K,8K,16K")
    return sorted(out)


def parse_numbers(text: str, what: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"cannot read {what} {text!r}; write comma-separated numbers like 0,25,50,75,100") from None
    if not values:
        raise ValueError(f"no {what} given")
    return values

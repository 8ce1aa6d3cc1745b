"""Shared benchmark plumbing: timing, provenance, result files."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@contextlib.contextmanager
def written(path: Path, tag: str = "part") -> Iterator[Path]:
    """A temporary name next to ``path`` (``<name>.<tag>``) to write to, renamed to ``path`` once the block ends
    without error: the file is whole or absent. Writers that may overlap on one path take distinct tags."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{tag}")
    yield tmp
    os.replace(tmp, path)


def commit() -> str:
    """The git commit of the working tree ('+dirty' if it has uncommitted changes); env MTRAINING_COMMIT wins."""
    if os.environ.get("MTRAINING_COMMIT"):
        return os.environ["MTRAINING_COMMIT"]
    try:
        head = subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], text=True, stderr=subprocess.DEVNULL
        ).strip()
        dirty = subprocess.call(["git", "diff", "--quiet", "HEAD"], stderr=subprocess.DEVNULL) != 0
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def command_line() -> str:
    """This process's command: ``python -m package.module args`` for a module run (``-m``), else ``python script args``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.origin and sys.argv and Path(sys.argv[0]).resolve() == Path(spec.origin).resolve():
        return " ".join([Path(sys.executable).name, "-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]])
    return " ".join([Path(sys.executable).name, *sys.argv])


def provenance(on_gpu: bool = True) -> dict[str, str]:
    """The fields every result record starts with: the device (this GPU's name, or 'cpu' for a CPU run), the
    commit and the command line, so a number can be traced to what produced it."""
    return {"device": device_name() if on_gpu else "cpu", "commit": commit(), "command": command_line()}


def add_attention_shape(p: argparse.ArgumentParser, block_help: str | None = None) -> None:
    """The attention shape and budgets every single-GPU attention benchmark takes: Qwen2.5-3B's heads,
    pattern block 128, v_size 1024, s_size 6144."""
    p.add_argument("--heads-q", type=int, default=16)
    p.add_argument("--heads-kv", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128, help=block_help)
    p.add_argument("--v-size", type=int, default=1024)
    p.add_argument("--s-size", type=int, default=6144)


def bench_ms(fn: Callable[[], object], warmup_ms: float = 100, rep_ms: float = 500) -> float:
    """Median milliseconds of fn on the GPU (CUDA events through triton.testing.do_bench)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


_EARLIER: dict[Path, list[dict]] = {}  # each results file's records from before this process first wrote it


def write_results(name: str, records: list[dict], out: Path | None = None) -> Path:
    """Write this run's records after those earlier runs left in bench/results/<name>.json (or ``out``), as one
    JSON list, and return the path. Benchmarks call it after every record with all of this run's so far: the
    earlier records are read once, at the process's first write (one run per process, as every benchmark here),
    and the file is replaced whole, so one stopped mid-write keeps the previous version. ValueError for a file that
    is not a list of records."""
    path = Path(out or RESULTS_DIR / f"{name}.json").resolve()
    if path not in _EARLIER:
        earlier = json.loads(path.read_text()) if path.exists() else []
        if not isinstance(earlier, list):
            raise ValueError(f"{path} is not a list of result records: pass another --out")
        _EARLIER[path] = earlier
    with written(path) as tmp:
        tmp.write_text(json.dumps(_EARLIER[path] + records, indent=1) + "\n")
    return path

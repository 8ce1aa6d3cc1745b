"""One training step under torch.profiler: where the step's time goes, per kernel and op.

``log.profile_step`` names the step. Every rank writes a Chrome trace (open it in Perfetto or
chrome://tracing) and a table of the costliest ops by self time on the device (CUDA) or the host
(CPU) into ``log.dir``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def step_profiler(device: torch.device) -> profile:
    """A profiler over host ops, and CUDA kernels when the step runs on a GPU."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(activities=activities)


def write_profile(
    prof: profile, out_dir: str | Path, step: int, rank: int, device: torch.device, rows: int = 40
) -> Path:
    """Write ``profile_step{step}_rank{rank}.json`` (trace) and ``.txt`` (top ``rows`` ops); return the table's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"profile_step{step}_rank{rank}"
    prof.export_chrome_trace(str(stem.with_suffix(".json")))
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = stem.with_suffix(".txt")
    table.write_text(prof.key_averages().table(sort_by=sort_by, row_limit=rows) + "\n")
    return table

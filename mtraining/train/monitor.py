"""Per-step metrics: throughput, MFU, memory, pattern density/recall; console, JSONL, TensorBoard, W&B.

Only the main rank writes. TensorBoard is optional: without the ``tensorboard`` package the
monitor says so once and writes metrics.jsonl and the console only. W&B logs when ``log.wandb`` is
set (wandb_log.py). The progress bar shows only on a terminal.
"""

from __future__ import annotations

import datetime
import json
import math
import resource
import sys
import uuid
from pathlib import Path

import torch
from torch import nn

from .config import WandbSection

# Dense bf16 tensor-core peak per device (TFLOP/s), by substring of the CUDA device name.
_PEAK_TFLOPS = {"H200": 989.5, "H100": 989.5, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def matmul_params(model: nn.Module) -> int:
    """Parameters that take part in per-token matmuls: all but the input embedding (the head counts, tied or not)."""
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    return total - embed.numel() + (head.numel() if head is embed else 0)


def flops_per_token(
    n_matmul: int, num_layers: int, q_heads: int, head_dim: int, seq_len: int, density: float = 1.0
) -> float:
    """Training FLOPs per token: 6 N for the matmuls plus causal attention (QK^T and PV, forward + backward).

    ``density`` scales attention to the pairs a sparse pattern keeps (1.0 for dense causal).
    """
    return 6.0 * n_matmul + 6.0 * num_layers * q_heads * head_dim * (seq_len + 1) * density


def peak_tflops(device: torch.device, configured: float | None) -> float | None:
    """Peak TFLOP/s of one device: the configured value, a known GPU's, or None (MFU not reported)."""
    if configured is not None:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((v for k, v in _PEAK_TFLOPS.items() if k in name), None)
    return None


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated accelerator memory, or peak resident memory of this process on CPU (GB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


class Monitor:
    """Progress bar, a log line every ``every`` steps, metrics.jsonl, TensorBoard and W&B (main rank only).

    metrics.jsonl holds one row per step (``step``, ``run_id`` and the metrics) and an event row each
    time a run starts (``{"event": "start" | "resume", "run_id", "step", "checkpoint", "time"}``): rows
    after a resume marker at step N replace any earlier rows past N. A resumed run keeps the run id
    of the rows it continues, so TensorBoard, W&B and the JSONL all see one run.
    """

    def __init__(
        self,
        enabled: bool,
        log_dir: str | None,
        total_steps: int,
        start_step: int = 0,
        every: int = 1,
        tensorboard: bool = True,
        progress: bool = True,
        resumed_from: str | None = None,
        wandb: WandbSection | None = None,
        run_config: dict | None = None,
    ) -> None:
        self.enabled = enabled
        self.every = every
        self.total_steps = total_steps
        self.run_id = None
        self._jsonl = self._writer = self._bar = self._wandb = None
        if not enabled:
            return
        jsonl = Path(log_dir) / "metrics.jsonl" if log_dir is not None else None
        self.run_id = (_previous_run_id(jsonl) if start_step else None) or uuid.uuid4().hex[:12]
        if jsonl is not None:
            jsonl.parent.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(jsonl, "a")
            event = "resume" if start_step else "start"
            self._row({"event": event, "step": start_step, "checkpoint": resumed_from, "time": _now()})
            if tensorboard:
                self._writer = _tensorboard_writer(log_dir)
        if wandb is not None:
            from .wandb_log import WandbLogger

            self._wandb = WandbLogger(wandb, self.run_id, log_dir, run_config or {})
        if progress and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def _row(self, row: dict) -> None:
        self._jsonl.write(json.dumps({**row, "run_id": self.run_id}) + "\n")
        self._jsonl.flush()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record the metrics of ``step`` (1-based count of finished steps)."""
        if not self.enabled:
            return
        if self._jsonl is not None:
            self._row({"step": step, **metrics})
        if self._writer is not None:
            for key, value in metrics.items():
                if value is not None and math.isfinite(value):
                    self._writer.add_scalar(f"train/{key}", value, step)
        if self._wandb is not None:
            self._wandb.log(step, metrics)
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{metrics['loss']:.4f}", refresh=False)
            self._bar.update(1)
        if step % self.every == 0 or step == self.total_steps:
            self.write(f"step {step} " + " ".join(_fmt(k, v) for k, v in metrics.items() if v is not None))

    def write(self, line: str) -> None:
        """Print a line above the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        for handle in (self._bar, self._writer, self._jsonl, self._wandb):
            if handle is not None:
                handle.close()
        self._bar = self._writer = self._jsonl = self._wandb = None


def _previous_run_id(jsonl: Path | None) -> str | None:
    """The run id of the last row of an existing metrics.jsonl (the run being resumed)."""
    if jsonl is None or not jsonl.is_file():
        return None
    last = None
    with open(jsonl) as f:
        for line in f:
            if line.strip():
                last = line
    try:
        return json.loads(last).get("run_id") if last else None
    except ValueError:
        return None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _fmt(key: str, value: float) -> str:
    if key in ("loss", "grad_norm", "density", "recall", "mfu"):
        return f"{key}={value:.4f}"
    if key == "lr":
        return f"lr={value:.2e}"
    return f"{key}={value:.4g}"


def _tensorboard_writer(log_dir: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("tensorboard is not installed: skipping TensorBoard logs (pip install tensorboard)", file=sys.stderr)
        return None
    return SummaryWriter(log_dir=str(Path(log_dir) / "tensorboard"))

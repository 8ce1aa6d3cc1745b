"""Per-step metrics: throughput, MFU, memory, pattern density/recall; console, JSONL and TensorBoard.

Only the main rank writes. TensorBoard is optional: without the ``tensorboard`` package the
monitor says so once and writes metrics.jsonl and the console only.
"""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path

import torch
from torch import nn

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
    """Progress bar, a log line every ``every`` steps, metrics.jsonl and TensorBoard (main rank only)."""

    def __init__(
        self,
        enabled: bool,
        log_dir: str | None,
        total_steps: int,
        start_step: int = 0,
        every: int = 1,
        tensorboard: bool = True,
        progress: bool = True,
    ) -> None:
        self.enabled = enabled
        self.every = every
        self.total_steps = total_steps
        self._jsonl = self._writer = self._bar = None
        if not enabled:
            return
        if log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            self._jsonl = open(Path(log_dir) / "metrics.jsonl", "a")
            if tensorboard:
                self._writer = _tensorboard_writer(log_dir)
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record the metrics of ``step`` (1-based count of finished steps)."""
        if not self.enabled:
            return
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self._jsonl.flush()
        if self._writer is not None:
            for key, value in metrics.items():
                if value is not None and math.isfinite(value):
                    self._writer.add_scalar(f"train/{key}", value, step)
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
        for handle in (self._bar, self._writer, self._jsonl):
            if handle is not None:
                handle.close()
        self._bar = self._writer = self._jsonl = None


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

"""Up-front memory check: will the longest length of a grid fit on each rank? (a rough estimate).

Counted per rank, beyond the weights (already loaded when we check): the transient activations of
one layer for the rank's shard, the attention scratch of the backend (the plain-PyTorch backend
materialises score rows; the Triton kernels do not), the KV cache when an answer is generated
(each rank's shard, plus the gathered full cache on group rank 0), and the chunked lm-head logits.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

GIB = float(1 << 30)
_TORCH_ROWS = 1024  # the torch backend's query-row chunk


def _dims(config) -> dict[str, int]:
    hq = config.num_attention_heads
    return {
        "hidden": config.hidden_size,
        "inter": getattr(config, "intermediate_size", 4 * config.hidden_size),
        "layers": config.num_hidden_layers,
        "hq": hq,
        "hkv": getattr(config, "num_key_value_heads", None) or hq,
        "dh": getattr(config, "head_dim", None) or config.hidden_size // hq,
        "vocab": config.vocab_size,
    }


def estimate_bytes(
    config, length: int, world_size: int, dtype: torch.dtype, generate: bool, torch_backend: bool
) -> dict[str, float]:
    """Bytes needed by the busiest rank (group rank 0) for one sequence of ``length`` tokens, by part."""
    d = _dims(config)
    el = torch.empty((), dtype=dtype).element_size()
    local = math.ceil(length / world_size)
    kv_row = 2 * d["hkv"] * d["dh"] * el  # K and V of one token in one layer
    parts = {
        "activations": local * (6 * d["hidden"] + 3 * d["inter"] + 2 * (d["hq"] + 2 * d["hkv"]) * d["dh"]) * el,
        "ring buffers": 3 * local * kv_row if world_size > 1 else 0.0,
        "lm head": 2 * min(local, (1 << 26) // d["vocab"] + 1) * d["vocab"] * 4,
    }
    if torch_backend:
        keys = local  # a ring step sees one shard of keys; one process sees them all
        parts["attention scratch"] = 4 * (3 * min(_TORCH_ROWS, local) * keys * d["hq"] + 2 * keys * d["hq"] * d["dh"])
    if generate:
        parts["kv cache"] = d["layers"] * kv_row * (local + (length if world_size > 1 else 0))
    return {k: float(v) for k, v in parts.items()}


def free_bytes(device: torch.device) -> float:
    """Free memory on ``device`` now (CUDA: the allocator's view; CPU: MemAvailable)."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    return math.inf


def check_memory(
    config,
    lengths: list[int],
    world_size: int,
    dtype: torch.dtype,
    device: torch.device,
    generate: bool,
    torch_backend: bool,
    limit_gib: float | None = None,
) -> None:
    """ValueError naming the fix when the longest length would not fit (90% of free memory or ``limit_gib``)."""
    available = limit_gib * GIB if limit_gib is not None else 0.9 * free_bytes(device)
    need = {n: estimate_bytes(config, n, world_size, dtype, generate, torch_backend) for n in lengths}
    too_big = [n for n in lengths if sum(need[n].values()) > available]
    if not too_big:
        return
    worst = max(too_big)
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in need[worst].items() if v)
    fitting = [n for n in lengths if n not in too_big]
    drop = f"drop lengths above {max(fitting)}" if fitting else "use shorter lengths"
    source = f"--memory-limit-gib {limit_gib:g}" if limit_gib is not None else f"free on {device}"
    raise ValueError(
        f"the grid does not fit memory: length {worst} needs about {sum(need[worst].values()) / GIB:.1f} GiB per rank "
        f"({parts} GiB) but {available / GIB:.1f} GiB is available ({source}); spread it over more ranks "
        f"(torchrun --nproc-per-node N, now {world_size}), {drop}, or pass --memory-limit-gib to override the check"
    )

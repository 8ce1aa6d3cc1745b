"""Process groups for training: a 2-D mesh of data parallel x context parallel ranks.

Launched with torchrun (RANK/WORLD_SIZE/LOCAL_RANK in the environment) this joins the job's
process group (NCCL on GPUs, gloo on CPU); run as a plain process it forms a world of one. Ranks
are laid out context-innermost, so the ranks of one ring are neighbours (one node where possible).
FSDP2 shards parameters over all data x context ranks (they all hold the same weights).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class ParallelState:
    """Where this rank sits: device, data-parallel and context-parallel coordinates, groups."""

    device: torch.device
    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int
    cp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    fsdp_mesh: DeviceMesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def join_group(device: str = "auto", timeout_s: float = 1800.0) -> torch.device:
    """Join (or form) the default process group once; returns this rank's device.

    ``device``: "cuda" (one GPU per rank, NCCL), "cpu" (gloo) or "auto" (CUDA when available).
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device is cuda but no GPU is visible; use train.device=cpu")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        where = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(where)  # before NCCL starts, so each rank talks from its own GPU
    else:
        where = torch.device("cpu")
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        backend = "nccl" if use_cuda else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return where


def init_parallel(data: int, context: int, device: str = "auto", timeout_s: float = 1800.0) -> ParallelState:
    """Join (or form) the process group (``join_group``) and build the data x context mesh; sizes must multiply
    to the world."""
    where = join_group(device, timeout_s)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != data * context:
        raise ValueError(
            f"{world} ranks were launched but parallel.data x parallel.context = {data} x {context}; "
            f"launch {data * context} ranks or change parallel.data"
        )
    mesh = init_device_mesh(where.type, (data, context), mesh_dim_names=("dp", "cp"))
    return ParallelState(
        device=where,
        rank=rank,
        world_size=world,
        dp_rank=mesh.get_local_rank("dp"),
        dp_size=data,
        cp_rank=mesh.get_local_rank("cp"),
        cp_size=context,
        cp_group=mesh.get_group("cp") if context > 1 else None,
        dp_group=mesh.get_group("dp") if data > 1 else None,
        fsdp_mesh=mesh["dp", "cp"]._flatten("dp_cp"),
    )


def shutdown() -> None:
    """Leave the process group (if one was joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()

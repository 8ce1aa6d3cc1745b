"""AdamW with decoupled weight decay on matrices only, and a warm-up + cosine learning-rate schedule.

The schedule is a pure function of the step (no scheduler state to checkpoint).
"""

from __future__ import annotations

import math

import torch
from torch import nn


def build_optimizer(
    model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], eps: float
) -> torch.optim.AdamW:
    """AdamW; biases and norm weights (1-D parameters) get no weight decay (``set_hyperparameters``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": no_decay}], lr=lr)
    set_hyperparameters(optimizer, weight_decay, betas, eps)
    return optimizer


def set_hyperparameters(
    optimizer: torch.optim.Optimizer, weight_decay: float, betas: tuple[float, float], eps: float
) -> None:
    """Set AdamW's betas, eps and weight decay (first group: matrices; the second decays nothing), and its
    list ("foreach") implementation.

    The list implementation is torch's default on CUDA; on the CPU it runs the same per-tensor ops (the
    same results), but dispatches each op once per list instead of once per parameter, which for FSDP's
    DTensor parameters is most of a small model's optimizer step. Loading an optimizer state brings back
    the values it was saved with; a resume applies these again.
    """
    for i, group in enumerate(optimizer.param_groups):
        group.update(betas=tuple(betas), eps=eps, weight_decay=weight_decay if i == 0 else 0.0, foreach=True)


def lr_at(step: int, base_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning rate of (0-based) ``step``: linear warm-up to base_lr, then cosine down to base_lr * min_lr_ratio."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return base_lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr

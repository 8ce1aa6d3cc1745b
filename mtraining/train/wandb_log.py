"""Weights & Biases logging of the training metrics (optional: pip install -e ".[wandb]")."""

from __future__ import annotations

import math

from .config import WandbSection


class WandbLogger:
    """One W&B run per training run: its id is the run id, so a resumed run continues the same W&B run."""

    def __init__(self, settings: WandbSection, run_id: str, log_dir: str | None, config: dict) -> None:
        try:
            import wandb
        except ImportError:
            raise ValueError(
                'log.wandb needs the wandb package: pip install -e ".[wandb]" (or remove log.wandb)'
            ) from None
        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            name=settings.name or run_id,
            id=run_id,
            resume="allow",
            mode=settings.mode,
            dir=log_dir,
            tags=settings.tags,
            config=config,
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        finite = {f"train/{k}": v for k, v in metrics.items() if v is not None and math.isfinite(v)}
        self.run.log(finite, step=step)

    def close(self) -> None:
        self.run.finish()

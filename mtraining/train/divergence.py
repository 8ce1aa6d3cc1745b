"""Stop a diverged run before its NaN reaches the weights, a checkpoint or the export."""

from __future__ import annotations

import math
from pathlib import Path

from .errors import Diverged

_FIX = (
    "Lower optim.lr, lengthen optim.warmup_steps or set optim.grad_clip and run again (resuming with changed "
    "optim settings needs checkpoint.allow_changed_schedule=true)"
)


def _last_good(last_checkpoint: Path | None) -> str:
    return f"the last good checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was saved yet"


def check_finite(step: int, loss: float, grad_norm: float, last_checkpoint: Path | None) -> None:
    """Raise ``Diverged`` unless the loss and gradient norm of (1-based) ``step`` are finite.

    Call it at the optimizer step, before the update: the weights then stay those of the last good
    step, and every rank raises (both values are reduced over all ranks).
    """
    values = (("loss", loss), ("gradient norm", grad_norm))
    bad = [f"the {name} is {value}" for name, value in values if not math.isfinite(value)]
    if not bad:
        return
    raise Diverged(
        f"step {step} diverged: {' and '.join(bad)}. The step was not applied, so no weight, checkpoint or export "
        f"holds it; {_last_good(last_checkpoint)}. {_FIX}"
    )


def check_finite_weights(step: int, weight_norm: float, last_checkpoint: Path | None) -> None:
    """Raise ``Diverged`` unless the weights after (1-based) ``step``'s update have a finite norm.

    ``check_finite`` guards each update before it is applied, from the loss and gradients of the weights
    before it; nothing runs on the weights after the last update, so call this before a checkpoint or the
    export stores them. The norm is float32, as the gradient norm: weights whose squares overflow it
    (about 1e19 and above) overflow the model's own products too.
    """
    if math.isfinite(weight_norm):
        return
    raise Diverged(
        f"step {step} diverged: its update made the weights' norm {weight_norm}. Neither a checkpoint nor the export "
        f"holds these weights; {_last_good(last_checkpoint)}. {_FIX}"
    )

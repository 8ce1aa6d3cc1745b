"""Options that every ``mtraining eval`` command takes (model, attention, output), declared once."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, get_type_hints

import typer


@dataclass(frozen=True)
class SessionOptions:
    """The checkpoint loading, attention, checks and output options of an evaluation command."""

    tokenizer: Annotated[
        Path | None, typer.Option("--tokenizer", help="tokenizer.json or a directory; default: the checkpoint's.")
    ] = None
    config: Annotated[
        Path | None, typer.Option("--config", help="Training YAML, to evaluate a training checkpoint (step_N).")
    ] = None
    attention: Annotated[str, typer.Option("--attention", help="dense or sparse (dynamic vertical-slash).")] = "dense"
    layout: Annotated[str, typer.Option("--layout", help="Context-parallel layout: striped, zigzag or contiguous.")] = (
        "striped"
    )
    block_size: Annotated[int, typer.Option("--block-size", help="Kernel block / layout stripe.")] = 128
    ring: Annotated[
        str, typer.Option("--ring", help="Context-parallel ring: flat, or hierarchical (inner rings per node).")
    ] = "flat"
    inner_size: Annotated[
        int | None,
        typer.Option("--inner-size", help="Hierarchical ring: ranks per inner ring (default: ranks per node)."),
    ] = None
    context_mode: Annotated[
        str,
        typer.Option(
            "--context-mode",
            help="Context parallelism: ring (K/V around --ring) or allgather (K/V gathered per layer).",
        ),
    ] = "ring"
    backend: Annotated[str, typer.Option("--backend", help="auto, torch or triton.")] = "auto"
    v_size: Annotated[int | None, typer.Option("--v-size", help="Sparse: verticals per head.")] = None
    s_size: Annotated[int | None, typer.Option("--s-size", help="Sparse: slashes per head.")] = None
    last_q: Annotated[int | None, typer.Option("--last-q", help="Sparse: queries that estimate the pattern.")] = None
    local_window: Annotated[int | None, typer.Option("--local-window", help="Sparse: offsets always kept.")] = None
    threshold: Annotated[
        float | None, typer.Option("--threshold", help="Sparse: keep lines up to this score mass.")
    ] = None
    block_columns: Annotated[
        int | None, typer.Option("--block-columns", help="Sparse: key columns per query block.")
    ] = None
    budgets: Annotated[Path | None, typer.Option("--budgets", help="Sparse: per-layer/head budgets YAML.")] = None
    dense_layers: Annotated[
        str | None,
        typer.Option(
            "--dense-layers", help="Sparse: layers that stay dense, e.g. 0 (as attention.dense_layers in training)."
        ),
    ] = None
    device: Annotated[str | None, typer.Option("--device", help="Default: this rank's GPU, else cpu.")] = None
    dtype: Annotated[
        str | None, typer.Option("--dtype", help="bfloat16 (GPU default), float16 or float32 (CPU default).")
    ] = None
    out_dir: Annotated[Path | None, typer.Option("--out-dir", help="Default: eval-results/LABEL.")] = None
    label: Annotated[str | None, typer.Option("--label", help="Name in reports; default: checkpoint-attention.")] = None
    allow_extrapolation: Annotated[
        bool, typer.Option("--allow-extrapolation", help="Allow lengths beyond the model's RoPE range.")
    ] = False
    memory_limit_gib: Annotated[
        float | None, typer.Option("--memory-limit-gib", help="Memory per rank for the up-front check.")
    ] = None

    def pattern(self) -> dict:
        """The sparse pattern options given (``PatternConfig.from_settings`` fields; the budgets file as a path)."""
        names = ("v_size", "s_size", "last_q", "local_window", "threshold", "block_columns")
        pattern = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        if self.budgets is not None:
            pattern["budgets"] = str(self.budgets)
        return pattern

    def ring_inner_size(self, world_size: int) -> int | None:
        """Ranks per inner ring for --ring hierarchical (validated against the world size), None for flat."""
        if self.ring not in ("flat", "hierarchical"):
            raise ValueError(f"--ring must be flat or hierarchical, got {self.ring!r}")
        if self.context_mode not in ("ring", "allgather"):
            raise ValueError(f"--context-mode must be ring or allgather, got {self.context_mode!r}")
        if self.context_mode == "allgather" and self.ring == "hierarchical":
            raise ValueError("--ring hierarchical is a ring schedule; --context-mode allgather runs no ring: drop one")
        if self.ring == "flat":
            if self.inner_size is not None:
                raise ValueError(
                    "--inner-size sizes the inner rings of --ring hierarchical; add it or drop --inner-size"
                )
            return None
        if world_size == 1:
            return None  # one process runs no ring
        from ..parallel.topology import resolve_inner_size

        try:
            return resolve_inner_size(world_size, self.inner_size)
        except ValueError as err:
            raise ValueError(f"--ring hierarchical over {world_size} ranks: {err} (--inner-size N)") from None

    def folder(self, label: str) -> Path:
        """Where the results go: --out-dir, else eval-results/LABEL."""
        return self.out_dir or Path("eval-results") / label


def with_session_options(command: Callable[..., None]) -> Callable[..., None]:
    """Declare the SessionOptions fields as typer options in place of ``command``'s ``opts`` parameter.

    ``opts`` must be keyword-only (after ``*``); the command receives the parsed values as one SessionOptions.
    """
    hints = get_type_hints(SessionOptions, include_extras=True)
    own = inspect.signature(command, eval_str=True)
    kind = own.parameters["opts"].kind
    common = [
        inspect.Parameter(f.name, kind, default=f.default, annotation=hints[f.name]) for f in fields(SessionOptions)
    ]
    params = [p for own_p in own.parameters.values() for p in (common if own_p.name == "opts" else [own_p])]

    @functools.wraps(command)
    def wrapper(**kwargs) -> None:
        opts = SessionOptions(**{f.name: kwargs.pop(f.name) for f in fields(SessionOptions)})
        command(opts=opts, **kwargs)

    wrapper.__signature__ = own.replace(parameters=params)  # type: ignore[attr-defined]
    return wrapper

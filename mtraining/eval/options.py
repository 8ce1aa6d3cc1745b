"""Options that every ``mtraining eval`` command takes (model, attention, output), declared once.

With ``--config TRAIN.yaml`` the attention runs as in training: every attention option left out takes the
training config's value (attention.*, parallel.ring and inner_size), and ``section.key=value`` arguments
after the checkpoint override that config as they do for ``mtraining train``. Without it, the defaults below.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, get_type_hints

import typer

if TYPE_CHECKING:
    from ..train.config import Config
    from .engine import AttentionSpec


@dataclass(frozen=True)
class SessionOptions:
    """The checkpoint loading, attention, checks and output options of an evaluation command."""

    overrides: Annotated[
        list[str] | None,
        typer.Argument(
            help="section.key=value overrides of the --config training config (e.g. attention.v_size=2048), as for "
            "mtraining train.",
            show_default=False,
        ),
    ] = None
    tokenizer: Annotated[
        Path | None, typer.Option("--tokenizer", help="tokenizer.json or a directory; default: the checkpoint's.")
    ] = None
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="Training YAML: evaluate a training checkpoint (step_N), with that training's attention settings "
            "as the defaults of the attention options below.",
        ),
    ] = None
    attention: Annotated[
        str | None,
        typer.Option("--attention", help="dense or sparse (dynamic vertical-slash); default: --config's, else dense."),
    ] = None
    layout: Annotated[
        str | None,
        typer.Option("--layout", help="Context-parallel layout: striped, zigzag or contiguous; default: striped."),
    ] = None
    block_size: Annotated[
        int | None, typer.Option("--block-size", help="Kernel block / layout stripe; default: 128.")
    ] = None
    ring: Annotated[
        str | None,
        typer.Option("--ring", help="Context-parallel ring: flat (default), or hierarchical (inner rings per node)."),
    ] = None
    inner_size: Annotated[
        int | None,
        typer.Option("--inner-size", help="Hierarchical ring: ranks per inner ring (default: ranks per node)."),
    ] = None
    context_mode: Annotated[
        str | None,
        typer.Option(
            "--context-mode",
            help="Context parallelism: ring (K/V around --ring) or allgather (K/V gathered per layer); default: ring.",
        ),
    ] = None
    backend: Annotated[str | None, typer.Option("--backend", help="auto (default), torch or triton.")] = None
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

    def training_config(self) -> Config | None:
        """The --config training config with the overrides applied; None without --config (where overrides are
        refused)."""
        if self.config is None:
            if self.overrides:
                raise ValueError(
                    f"{self.overrides[0]!r}: section.key=value overrides change the training config of --config "
                    "TRAIN.yaml; pass --config, or use the attention options (--v-size, --layout, ...)"
                )
            return None
        from ..train.config import load_config, split_overrides

        other, overrides = split_overrides(self.overrides)
        if other:
            raise ValueError(
                f"{other[0]!r} is not a section.key=value override of --config (e.g. attention.v_size=2048)"
            )
        return load_config(self.config, overrides)

    def attention_spec(self, world_size: int) -> AttentionSpec:
        """How this evaluation runs attention: each option given, else the training config's, else the default;
        ValueError naming the option for settings that cannot run."""
        from .engine import AttentionSpec

        cfg = self.training_config()
        att, par = (cfg.attention, cfg.parallel) if cfg is not None else (None, None)
        attention = self.attention or ("sparse" if att is not None and att.sparse else "dense")
        if attention not in ("dense", "sparse"):
            raise ValueError(f"--attention must be dense or sparse, got {attention!r}")
        trained_ring = "flat" if par is None or par.ring == "auto" else par.ring  # auto picks flat on one node
        ring = self.ring or trained_ring
        inner = self.inner_size if self.ring is not None or par is None else par.inner_size
        context_mode = self.context_mode or (par.context_mode if par else "ring")
        if self.dense_layers is not None:
            dense_layers = _layers(self.dense_layers)
        else:
            dense_layers = tuple(att.dense_layers) if att else ()
        spec = AttentionSpec(
            sparse=attention == "sparse",
            layout=self.layout or (att.layout if att else "striped"),
            block_size=self.block_size or (att.block_size if att else 128),
            backend=self.backend or (att.backend if att else "auto"),
            pattern=self._pattern(att),
            min_sparse_len=att.min_sparse_len if att else 0,
            max_density=att.max_density if att else None,
            dense_layers=dense_layers,
            ring=ring,
            inner_size=self.ring_inner_size(world_size, ring, inner, context_mode),
            context_mode=context_mode,
        )
        if spec.layout not in ("striped", "zigzag", "contiguous"):
            raise ValueError(f"--layout must be striped, zigzag or contiguous, got {spec.layout!r}")
        if spec.backend not in ("auto", "torch", "triton"):
            raise ValueError(f"--backend must be auto, torch or triton, got {spec.backend!r}")
        spec.pattern_config()  # budgets file, sizes: refused here, before the model loads
        return spec

    def _pattern(self, att) -> dict:
        """The sparse pattern's ``PatternConfig.from_settings`` fields: the training config's (if any) under the
        options given; --v-size or --s-size replace the config's budgets file, --budgets its sizes."""
        names = ("v_size", "s_size", "last_q", "local_window", "threshold", "block_columns")
        given = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        if self.budgets is not None:
            given["budgets"] = str(self.budgets)
        if att is None:
            return given
        trained = {"last_q": att.last_q, "sink_tokens": att.sink_tokens, "local_window": att.local_window}
        trained |= {"threshold": att.threshold} if att.threshold is not None else {}
        trained |= {"block_columns": att.block_columns} if att.block_columns else {}
        if att.budgets is None:
            trained |= {} if "budgets" in given else {"v_size": att.v_size, "s_size": att.s_size}
        elif not {"v_size", "s_size"} & set(given):
            trained["budgets"] = att.budgets
        return trained | given

    @staticmethod
    def ring_inner_size(world_size: int, ring: str, inner_size: int | None, context_mode: str = "ring") -> int | None:
        """Ranks per inner ring for a hierarchical ring (validated against the world size and the context mode),
        None for flat."""
        if ring not in ("flat", "hierarchical"):
            raise ValueError(f"--ring must be flat or hierarchical, got {ring!r}")
        if context_mode not in ("ring", "allgather"):
            raise ValueError(f"--context-mode must be ring or allgather, got {context_mode!r}")
        if context_mode == "allgather" and ring == "hierarchical":
            raise ValueError("--ring hierarchical is a ring schedule; --context-mode allgather runs no ring: drop one")
        if ring == "flat":
            if inner_size is not None:
                raise ValueError(
                    "--inner-size sizes the inner rings of --ring hierarchical; add it or drop --inner-size"
                )
            return None
        if world_size == 1:
            return None  # one process runs no ring
        from ..parallel.topology import resolve_inner_size

        try:
            return resolve_inner_size(world_size, inner_size)
        except ValueError as err:
            raise ValueError(f"--ring hierarchical over {world_size} ranks: {err} (--inner-size N)") from None

    def folder(self, label: str) -> Path:
        """Where the results go: --out-dir, else eval-results/LABEL."""
        return self.out_dir or Path("eval-results") / label


def _layers(text: str) -> tuple[int, ...]:
    """Layer indices from '0' or '0,1' (empty: none)."""
    try:
        layers = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--dense-layers takes layer indices like 0 or 0,1, got {text!r}") from None
    if any(layer < 0 for layer in layers):
        raise ValueError(f"--dense-layers takes layer indices >= 0, got {text!r}")
    return layers


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

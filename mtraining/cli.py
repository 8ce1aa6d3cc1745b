"""Command line: ``mtraining train CONFIG.yaml [key=value ...]``, ``mtraining export``, ``mtraining tokenize``,
and the evaluation suite under ``mtraining eval`` (ppl, niah, ruler, infinitebench, report).

Run under torchrun for several ranks (``torchrun --nproc_per_node 4 -m mtraining.cli train ...``)
or let ``--nproc N`` start torchrun for you on this machine.
"""

from __future__ import annotations

import os
from pathlib import Path

import typer

from .eval.cli import eval_app

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Ultra-long-context training with dynamic sparse attention."
)
app.add_typer(eval_app, name="eval")


def _fail(err: Exception | str, code: int = 2, prefix: str = "error") -> None:
    typer.secho(f"{prefix}: {err}", fg=typer.colors.RED if prefix == "error" else typer.colors.YELLOW, err=True)
    raise typer.Exit(code)


@app.command(
    epilog="Exit codes: 0 done; 1 crash (traceback printed); 2 the config or command cannot run; 3 the loss or "
    "gradient norm became NaN/inf (the step was not applied); 4 a rank stopped responding (parallel.timeout_minutes); "
    "5 a checkpoint or the export could not be written (full disk, permissions); 130 interrupted (SIGINT); "
    "143 SIGTERM: the ranks finished the step and saved a checkpoint, run the same command to resume."
)
def train(
    config: Path = typer.Argument(..., help="YAML config (see configs/)."),
    overrides: list[str] = typer.Argument(None, help="section.key=value overrides, e.g. train.steps=10."),
    nproc: int = typer.Option(1, "--nproc", help="Start this many local ranks with torchrun (CPU: gloo, GPU: NCCL)."),
) -> None:
    """Train a model as the config says (resumes from the newest checkpoint in checkpoint.dir that verifies).

    SIGTERM (preemption) makes the ranks finish the current step, save a checkpoint and exit 143.
    """
    from .train.config import load_config
    from .train.outputs import check_output_dirs

    overrides = overrides or []
    try:
        cfg = load_config(config, overrides)
        if nproc > 1 and "RANK" not in os.environ:
            from .train.torchrun import launch

            cfg.check_world_size(nproc)
            check_output_dirs(cfg)
            args = ["--standalone", f"--nproc_per_node={nproc}", "-m", "mtraining.cli", "train", str(config)]
            raise typer.Exit(launch([*args, *overrides]))
    except ValueError as err:
        _fail(err)
    from .train.distributed import shutdown
    from .train.errors import EXIT_INTERRUPTED, Preempted, RankStalled, RunStopped
    from .train.trainer import Trainer

    try:
        trainer = Trainer(cfg)
    except ValueError as err:
        shutdown()
        _fail(err)
    try:
        trainer.run()
    except RunStopped as err:
        if trainer.par.is_main or isinstance(err, RankStalled):  # a stall is seen differently by each rank
            _fail(err, err.exit_code, "stopped" if isinstance(err, Preempted) else "error")
        raise typer.Exit(err.exit_code) from None
    except KeyboardInterrupt:
        if trainer.par.is_main:
            _fail(f"interrupted after step {trainer.step}; nothing was saved", EXIT_INTERRUPTED, "stopped")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    finally:
        trainer.close()
        shutdown()


@app.command()
def export(
    config: Path = typer.Argument(..., help="The YAML config the checkpoint was trained with."),
    out: Path = typer.Argument(..., help="Output HF directory (config.json + model.safetensors)."),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="A step_N folder; default: newest in checkpoint.dir."),
    overrides: list[str] = typer.Option([], "--set", help="section.key=value overrides."),
) -> None:
    """Write the weights of a distributed checkpoint as a Hugging Face model directory (one process).

    The checkpoint is verified against its manifest first; without --checkpoint, the newest one of
    checkpoint.dir that verifies is used.
    """
    from .train.config import load_config
    from .train.errors import SaveFailed
    from .train.export import export_checkpoint

    try:
        cfg = load_config(config, overrides)
        path = export_checkpoint(cfg, checkpoint or cfg.checkpoint.dir, out, report=typer.echo)
    except ValueError as err:
        _fail(err)
    except SaveFailed as err:
        _fail(err, err.exit_code)
    typer.echo(f"exported {path} to {out}")


@app.command()
def tokenize(
    config: Path = typer.Argument(..., help="YAML config whose data.sources and tokenizer to use."),
    out: Path = typer.Argument(..., help="Output .npy token file (use it as data.sources: [OUT.npy])."),
    overrides: list[str] = typer.Option([], "--set", help="section.key=value overrides."),
) -> None:
    """Tokenise the config's text sources once into a token file, so ranks need not tokenise at start."""
    import numpy as np

    from .train.config import load_config
    from .train.data import TextTokenizer, token_stream

    try:
        cfg = load_config(config, overrides)
        d = cfg.data
        tok_path = d.tokenizer or cfg.model.path
        stream = token_stream(
            d.sources, TextTokenizer(tok_path) if tok_path else None, d.text_field, d.separator, d.token_dtype
        )
    except ValueError as err:
        _fail(err)
    dtype = np.uint16 if stream.max() < 2**16 else np.uint32
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, stream.astype(dtype))
    typer.echo(f"wrote {len(stream)} tokens ({np.dtype(dtype).name}) to {out}")


if __name__ == "__main__":
    app()

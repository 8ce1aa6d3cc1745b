"""Command line: ``mtraining train CONFIG.yaml [key=value ...]``, ``mtraining export``, ``mtraining tokenize``,
and the evaluation suite under ``mtraining eval`` (ppl, niah, ruler, infinitebench, report).

Run under torchrun for several ranks (``torchrun --nproc_per_node 4 -m mtraining.cli train ...``)
or let ``--nproc N`` start torchrun for you on this machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import typer

from .eval.cli import eval_app

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Ultra-long-context training with dynamic sparse attention."
)
app.add_typer(eval_app, name="eval")


def _fail(err: Exception) -> None:
    typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


@app.command()
def train(
    config: Path = typer.Argument(..., help="YAML config (see configs/)."),
    overrides: list[str] = typer.Argument(None, help="section.key=value overrides, e.g. train.steps=10."),
    nproc: int = typer.Option(1, "--nproc", help="Start this many local ranks with torchrun (CPU: gloo, GPU: NCCL)."),
) -> None:
    """Train a model as the config says (resumes from the newest checkpoint in checkpoint.dir)."""
    from .train.config import load_config

    overrides = overrides or []
    try:
        cfg = load_config(config, overrides)
        if nproc > 1 and "RANK" not in os.environ:
            cfg.check_world_size(nproc)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
            cmd += ["-m", "mtraining.cli", "train", str(config), *overrides]
            raise typer.Exit(subprocess.call(cmd))
    except ValueError as err:
        _fail(err)
    from .train.distributed import shutdown
    from .train.trainer import Trainer

    try:
        trainer = Trainer(cfg)
    except ValueError as err:
        shutdown()
        _fail(err)
    try:
        trainer.run()
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
    """Write the weights of a distributed checkpoint as a Hugging Face model directory (one process)."""
    from .train.checkpoint import latest_checkpoint
    from .train.config import load_config
    from .train.export import export_checkpoint

    try:
        cfg = load_config(config, overrides)
        path = checkpoint or latest_checkpoint(cfg.checkpoint.dir)
        if path is None:
            raise ValueError(f"no complete checkpoint in {cfg.checkpoint.dir}; pass --checkpoint DIR/step_N")
        export_checkpoint(cfg, path, out)
    except ValueError as err:
        _fail(err)
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

"""Command line: ``mtraining train CONFIG.yaml [key=value ...]``, ``mtraining export``, ``mtraining tokenize``,
and the evaluation suite under ``mtraining eval`` (ppl, niah, ruler, report).

Run under torchrun for several ranks (``torchrun --nproc_per_node 4 -m mtraining.cli train ...``)
or let ``--nproc N`` start torchrun for you (with ``--nnodes/--node-rank/--rdzv-endpoint`` on each
node of a multi-node job).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import typer

from .eval.cli import eval_app

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Ultra-long-context training with dynamic sparse attention."
)
app.add_typer(eval_app, name="eval")


def _fail(err: Exception) -> None:
    """Print the error (once per job: a SharedError is every rank's, rank 0 reports it) and exit 2."""
    from .train.agree import SharedError

    if not isinstance(err, SharedError) or int(os.environ.get("RANK", "0")) == 0:
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


@app.command()
def train(
    config: Path = typer.Argument(
        ..., help="YAML config (see configs/); relative paths in it are relative to its folder."
    ),
    overrides: list[str] = typer.Argument(None, help="section.key=value overrides, e.g. train.steps=10."),
    nproc: int = typer.Option(
        1,
        "--nproc",
        help="Start this many ranks on this machine with torchrun (CPU: gloo, GPU: NCCL; one per GPU). Alone it is "
        "a single-node job; with --nnodes/--node-rank/--rdzv-endpoint it is the ranks of this node.",
    ),
    nnodes: int = typer.Option(
        1, "--nnodes", help="Nodes of a multi-node job: run this same command on every node with its --node-rank."
    ),
    node_rank: int = typer.Option(None, "--node-rank", help="This node's index, 0 .. nnodes-1 (multi-node)."),
    rdzv_endpoint: str = typer.Option(
        None, "--rdzv-endpoint", help="HOST:PORT of node 0, where the nodes meet (multi-node; a free port)."
    ),
) -> None:
    """Train a model as the config says (resumes from the newest checkpoint in checkpoint.dir).

    One node: `mtraining train CONFIG --nproc 8`. Several: on node n of N, `mtraining train CONFIG --nproc 8
    --nnodes N --node-rank n --rdzv-endpoint NODE0:29500` (torchrun with the same options works too:
    `torchrun --nnodes N --node-rank n --rdzv-endpoint NODE0:29500 --nproc-per-node 8 -m mtraining.cli train
    CONFIG`). Before starting the ranks the launcher checks the config, data, tokenizer and model once and
    tokenises text sources into the token cache.
    """
    from .train.config import load_config
    from .train.launch import torchrun_command
    from .train.preflight import preflight

    overrides = overrides or []
    try:
        cfg = load_config(config, overrides)
        launch = nproc > 1 or nnodes > 1 or node_rank is not None or rdzv_endpoint is not None
        if launch and "RANK" not in os.environ:
            cmd = torchrun_command(nproc, nnodes, node_rank, rdzv_endpoint)
            for warning in preflight(cfg, nproc * nnodes, nproc):
                typer.secho(warning, fg=typer.colors.YELLOW, err=True)
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
    out: Path = typer.Argument(None, help="Also write every source's tokens, concatenated, to this .npy file."),
    overrides: list[str] = typer.Option([], "--set", help="section.key=value overrides."),
) -> None:
    """Tokenise the config's text sources into the token cache now (e.g. on a login node before a job), so
    ranks only memory-map them; with OUT, also write all sources end to end as one token file."""
    from .train.config import load_config
    from .train.data import load_sources

    try:
        cfg = load_config(config, overrides)
        sources = load_sources(cfg, tokenize=True, log=typer.echo)
    except ValueError as err:
        _fail(err)
    for s in sources:
        typer.echo(f"{s.name}: {s.files} files, {len(s.stream):,} tokens, largest id {s.max_id}")
    if out is not None:
        import numpy as np

        dtype = np.uint16 if max(s.max_id for s in sources) < 1 << 16 else np.uint32
        total = sum(len(s.stream) for s in sources)
        out.parent.mkdir(parents=True, exist_ok=True)
        target = np.lib.format.open_memmap(out, mode="w+", dtype=dtype, shape=(total,))
        done = 0
        for s in sources:
            for start in range(0, len(s.stream), 1 << 24):
                window = s.stream.read(start, min(len(s.stream), start + (1 << 24)))
                target[done : done + len(window)] = window
                done += len(window)
        target.flush()
        typer.echo(f"wrote {total} tokens ({np.dtype(dtype).name}) to {out}")


if __name__ == "__main__":
    app()

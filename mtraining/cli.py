"""Command line: ``mtraining train CONFIG.yaml [key=value ...]``, ``mtraining check``, ``mtraining export``,
``mtraining tokenize``, ``mtraining convert`` (GGUF -> Hugging Face folder), ``mtraining corpus`` (long documents
from local files) and the evaluation suite under ``mtraining eval`` (ppl, niah, ruler, infinitebench, report).

Every command that reads a training config takes its overrides the same way: ``section.key=value``
arguments after the positional ones (``train.steps=10 data.cache_dir=/scratch/cache``), values read as YAML.

Run under torchrun for several ranks (``torchrun --nproc_per_node 4 -m mtraining.cli train ...``)
or let ``--nproc N`` start torchrun for you (with ``--nnodes/--node-rank/--rdzv-endpoint`` on each
node of a multi-node job).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import typer

from .eval.cli import eval_app
from .rank_exit import run_command

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Ultra-long-context training with dynamic sparse attention."
)
app.add_typer(eval_app, name="eval")


Overrides = typer.Argument(None, help="section.key=value overrides, e.g. train.steps=10 (values are YAML).")


def _only_overrides(args: list[str] | None) -> list[str]:
    """The overrides of a command whose positional arguments after its own are all overrides."""
    from .train.config import split_overrides

    other, overrides = split_overrides(args)
    if other:
        raise ValueError(
            f"{other[0]!r} is not a section.key=value override (e.g. train.steps=10); overrides come after the "
            "command's own arguments"
        )
    return overrides


def _fail(err: Exception | str, code: int = 2, prefix: str = "error") -> None:
    """Print the error and exit with ``code``. A SharedError (train/agree.py) is every rank's: rank 0 reports it."""
    from .train.agree import SharedError

    if not isinstance(err, SharedError) or int(os.environ.get("RANK", "0")) == 0:
        typer.secho(f"{prefix}: {err}", fg=typer.colors.RED if prefix == "error" else typer.colors.YELLOW, err=True)
    raise typer.Exit(code)


@app.command(
    epilog="Exit codes: 0 done; 1 crash (traceback printed); 2 the config or command cannot run; 3 the loss or "
    "gradient norm became NaN/inf (the step was not applied); 4 a rank stopped responding (parallel.timeout_minutes); "
    "5 a checkpoint or the export could not be written (full disk, permissions); 130 interrupted (SIGINT); "
    "143 SIGTERM: the ranks finished the step and saved a checkpoint, run the same command to resume."
)
def train(
    config: Path = typer.Argument(
        ..., help="YAML config (see configs/); relative paths in it are relative to its folder."
    ),
    overrides: list[str] = Overrides,
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
    """Train a model as the config says (resumes from the newest checkpoint in checkpoint.dir that verifies).

    One node: `mtraining train CONFIG --nproc 8`. Several: on node n of N, `mtraining train CONFIG --nproc 8
    --nnodes N --node-rank n --rdzv-endpoint NODE0:29500` (torchrun with the same options works too:
    `torchrun --nnodes N --node-rank n --rdzv-endpoint NODE0:29500 --nproc-per-node 8 -m mtraining.cli train
    CONFIG`). Before starting the ranks the launcher runs the checks of `mtraining check` (every problem at
    once, exit 2) and tokenises text sources into the token cache.

    SIGTERM (preemption) makes the ranks finish the current step, save a checkpoint and exit 143.
    """
    from .train.config import load_config
    from .train.errors import EXIT_INTERRUPTED, Preempted, RankStalled, RunStopped

    try:
        overrides = _only_overrides(overrides)
        cfg = load_config(config, overrides)
        launcher = nproc != 1 or nnodes != 1 or node_rank is not None or rdzv_endpoint is not None
        if launcher and "RANK" not in os.environ:
            from .train.check import CHECKED_ENV
            from .train.preflight import preflight
            from .train.rendezvous import meet_nodes
            from .train.torchrun import launch, torchrun_command

            args = torchrun_command(nproc, nnodes, node_rank, rdzv_endpoint)
            for warning in preflight(cfg, nproc * nnodes, nproc):
                typer.secho(warning, fg=typer.colors.YELLOW, err=True)
            if nnodes > 1:
                meet_nodes(rdzv_endpoint, nnodes, node_rank, cfg.parallel.timeout_minutes * 60, say=typer.echo)
            args += ["-m", "mtraining.cli", "train", str(config), *overrides]
            os.environ[CHECKED_ENV] = "1"  # the ranks need not check again
            raise typer.Exit(launch(args))
    except ValueError as err:
        _fail(err)
    except RunStopped as err:  # a node missing at the rendezvous
        _fail(err, err.exit_code)
    except KeyboardInterrupt:
        _fail("interrupted before the ranks started; nothing was trained", EXIT_INTERRUPTED, "stopped")
    from .train.distributed import shutdown
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


@app.command(epilog="Exit codes: 0 nothing stops the run (warnings may be printed); 2 problems (all listed).")
def check(
    config: Path = typer.Argument(..., help="YAML config, as for train."),
    overrides: list[str] = Overrides,
    nproc: int = typer.Option(
        None, "--nproc", help="Ranks per node, as the run will be launched (default: all on one)."
    ),
    nnodes: int = typer.Option(1, "--nnodes", help="Nodes, as the run will be launched."),
    node_rank: int = typer.Option(None, "--node-rank", help="Accepted so that train's launch options can be pasted."),
    rdzv_endpoint: str = typer.Option(None, "--rdzv-endpoint", help="Accepted and checked as train checks it."),
    gpu: str = typer.Option("h100", "--gpu", help="GPU of the estimates: h100, h200, a100 or a100-40gb."),
    usd_per_gpu_hour: float = typer.Option(None, "--usd-per-gpu-hour", help="Also print the run's cost at this price."),
) -> None:
    """Check a run without GPUs and report every problem at once: the config (with "did you mean"), the world
    and ring shape as launched, output folders, packages, the model folder (config.json, the weights' shapes from
    the safetensors headers), the tokenizer, every data source, the resume against the newest checkpoint (a changed
    schedule is refused here), free disk, shared storage on several nodes; then an estimate of the memory per GPU
    and of the time per step (train/estimate.py says how). The trainer runs the same checks before it starts.
    """
    from .train.check import Launch, Report, check_run
    from .train.config import parse_config_partly, read_config
    from .train.estimate import GPUS, ModelShape, cost_line, memory_per_gpu, time_per_step
    from .train.torchrun import torchrun_command

    started = time.perf_counter()
    report = Report()
    try:
        if gpu not in GPUS:
            raise ValueError(f"--gpu must be one of {', '.join(GPUS)}, got {gpu!r}")
        data, relative_to = read_config(config, _only_overrides(overrides))
        if node_rank is not None or rdzv_endpoint is not None:
            torchrun_command(nproc or 1, nnodes, node_rank, rdzv_endpoint)
    except ValueError as err:
        _fail(err)
    cfg, report.problems = parse_config_partly(data)
    if cfg is not None:
        cfg._relative_to = relative_to
        launch = Launch(nproc or max(1, cfg.world_size // nnodes), nnodes)
        found_report, found = check_run(cfg, launch)
        for name in ("problems", "warnings", "notes"):
            getattr(report, name).extend(getattr(found_report, name))
        typer.echo(
            f"{config}: {launch.nnodes} node(s) x {launch.nproc} ranks, {cfg.parallel.data} data x "
            f"{cfg.parallel.context} context"
        )
        if cfg.train.device == "cpu":
            report.notes.append("estimates: none for train.device=cpu (they are for GPUs)")
        elif found.model is not None and found.ring is not None and cfg.world_size == launch.world_size:
            shape = ModelShape.of(found.model)
            memory = memory_per_gpu(cfg, shape, GPUS[gpu])
            timing = time_per_step(cfg, shape, GPUS[gpu], launch.nproc, found.ring)
            report.notes += memory.lines + timing.lines
            if usd_per_gpu_hour is not None:
                report.notes.append(cost_line(timing.total, cfg.train.steps, cfg.world_size, usd_per_gpu_hour))
            if memory.total > GPUS[gpu].memory:
                report.warnings.append(
                    f"the estimated memory per GPU ({memory.total / 1e9:.0f} GB) exceeds the {GPUS[gpu].name}'s: "
                    "spread the sequence over more ranks (parallel.context), keep activation checkpointing on, or "
                    "lower train.loss_chunk_tokens"
                )
    for line in report.notes:
        typer.echo(line)
    for line in report.warnings:
        typer.secho(f"warning: {line}", fg=typer.colors.YELLOW, err=True)
    elapsed = time.perf_counter() - started
    if report.problems:
        typer.secho(
            f"{len(report.problems)} problem{'s' if len(report.problems) > 1 else ''} (checked in {elapsed:.1f} s):",
            fg=typer.colors.RED,
            err=True,
        )
        for line in report.problems:
            typer.secho(f"  - {line}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    typer.echo(f"no problems found (checked in {elapsed:.1f} s)")


@app.command()
def export(
    config: Path = typer.Argument(..., help="The YAML config the checkpoint was trained with."),
    out: Path = typer.Argument(..., help="Output HF directory (config.json + model.safetensors)."),
    overrides: list[str] = Overrides,
    checkpoint: Path = typer.Option(None, "--checkpoint", help="A step_N folder; default: newest in checkpoint.dir."),
) -> None:
    """Write the weights of a distributed checkpoint as a Hugging Face model directory (one process).

    The checkpoint is verified against its manifest first; without --checkpoint, the newest one of
    checkpoint.dir that verifies is used.
    """
    from .train.config import load_config
    from .train.errors import SaveFailed
    from .train.export import export_checkpoint

    try:
        cfg = load_config(config, _only_overrides(overrides))
        if checkpoint is not None and not checkpoint.exists():
            raise ValueError(
                f"--checkpoint {checkpoint} does not exist; pass a step_N folder of checkpoint.dir "
                f"({cfg.checkpoint.dir}), or leave --checkpoint out for its newest checkpoint that verifies"
            )
        path = export_checkpoint(cfg, checkpoint or cfg.checkpoint.dir, out, report=typer.echo)
    except ValueError as err:
        _fail(err)
    except SaveFailed as err:
        _fail(err, err.exit_code)
    typer.echo(f"exported {path} to {out}")


@app.command()
def tokenize(
    config: Path = typer.Argument(..., help="YAML config whose data.sources and tokenizer to use."),
    args: list[str] = typer.Argument(
        None,
        help="[OUT.npy] [section.key=value ...]: also write every source's tokens, concatenated, to OUT.npy; "
        "overrides as for train.",
    ),
) -> None:
    """Tokenise the config's text sources into the token cache now (e.g. on a login node before a job), so
    ranks only memory-map them; with OUT, also write all sources end to end as one token file."""
    from .train.config import load_config, split_overrides
    from .train.data import check_token_file_target, load_sources, write_token_file
    from .train.errors import SaveFailed

    try:
        paths, overrides = split_overrides(args)
        if len(paths) > 1:
            raise ValueError(f"tokenize takes one OUT file, got {paths}; overrides look like section.key=value")
        out = Path(paths[0]) if paths else None
        cfg = load_config(config, overrides)
        if out is not None:
            check_token_file_target(out)
        sources = load_sources(cfg, tokenize=True, log=typer.echo)
    except ValueError as err:
        _fail(err)
    for s in sources:
        typer.echo(f"{s.name}: {s.files} files, {len(s.stream):,} tokens, largest id {s.max_id}")
    if out is not None:
        try:
            dtype = write_token_file(sources, out)
        except SaveFailed as err:
            _fail(err, err.exit_code)
        typer.echo(f"wrote {sum(len(s.stream) for s in sources)} tokens ({dtype.name}) to {out}")


@app.command()
def convert(
    gguf_file: Path = typer.Argument(
        ..., help="A .gguf checkpoint (llama.cpp's format): Llama, Qwen2, Qwen3 or Mistral."
    ),
    out_dir: Path = typer.Argument(..., help="New Hugging Face folder to write (must not exist or be empty)."),
    dtype: str = typer.Option(
        "float32",
        "--dtype",
        help="Weights' dtype on disk: float32 (the dequantized values exactly), bfloat16, float16.",
    ),
) -> None:
    """Write a GGUF checkpoint as a Hugging Face folder (config.json, model.safetensors, tokenizer files) that
    model.path and `mtraining eval` accept: quantized weights are dequantized, the tokenizer is rebuilt from the
    file's vocabulary. Needs the gguf and accelerate packages (pip install -e ".[gguf]")."""
    from .models.convert import convert_gguf, summary

    try:
        result = convert_gguf(gguf_file, out_dir, dtype, report=lambda line: typer.echo(line, err=True))
    except ValueError as err:
        _fail(err)
    typer.echo(summary(result))


@app.command()
def corpus(
    out_dir: Path = typer.Argument(..., help="New folder for train/*.npy, heldout/*.jsonl and manifest.json."),
    tokenizer: Path = typer.Option(..., "--tokenizer", help="The model's tokenizer.json or Hugging Face folder."),
    code: list[Path] = typer.Option(
        [], "--code", help="A site-packages folder (or tar archive): a document per package."
    ),
    python: list[str] = typer.Option([], "--python", help="An interpreter whose site-packages to add as --code."),
    prose: list[Path] = typer.Option(
        [], "--prose", help="A folder or tar archive of text files: a document per top-level entry (a book)."
    ),
    heldout_fraction: float = typer.Option(
        0.05, "--heldout-fraction", help="Share of the documents within the held-out token range held out."
    ),
    heldout_min_tokens: int = typer.Option(
        0, "--heldout-min-tokens", help="Shorter documents always train (e.g. 131072 to hold out 128K-long ones)."
    ),
    heldout_max_tokens: int = typer.Option(
        2_000_000, "--heldout-max-tokens", help="Longer documents always train (the largest packages, big manuals)."
    ),
    min_tokens: int = typer.Option(0, "--min-tokens", help="Drop documents shorter than this."),
    seed: int = typer.Option(0, "--seed", help="Seed of the held-out split."),
    skip_tests: bool = typer.Option(False, "--skip-tests", help="Leave out folders named test or tests."),
    max_file_bytes: int = typer.Option(1 << 20, "--max-file-bytes", help="Leave out larger files."),
    separator: str = typer.Option(None, "--separator", help="Token ending each document (default: the EOS)."),
    heldout: list[str] = typer.Option([], "--heldout", help="Hold out this document too, e.g. prose/howto."),
    workers: int = typer.Option(None, "--workers", help="Tokenising processes (default: one per CPU core)."),
) -> None:
    """Build a corpus of long documents from local files: Python packages (one document per package, its
    files concatenated in sorted path order under a path header each) and prose (one document per book),
    tokenised into token files for data.sources, with whole documents held out as JSONL for evaluation."""
    import shlex
    import sys

    from .data.corpus import CorpusOptions, build_corpus
    from .data.trees import site_packages

    try:
        trees = [("code", p) for p in code] + [("code", p) for exe in python for p in site_packages(exe)]
        trees += [("prose", p) for p in prose]
        if not trees:
            raise ValueError("give at least one --code, --python or --prose source")
        options = CorpusOptions(
            heldout_fraction=heldout_fraction,
            heldout_min_tokens=heldout_min_tokens,
            heldout_max_tokens=heldout_max_tokens,
            min_tokens=min_tokens,
            seed=seed,
            skip_tests=skip_tests,
            max_file_bytes=max_file_bytes,
            separator=separator,
            heldout=tuple(heldout),
        )
        count = workers or len(os.sched_getaffinity(0))
        manifest = build_corpus(out_dir, tokenizer, trees, options, count, shlex.join(["mtraining", *sys.argv[1:]]))
    except ValueError as err:
        _fail(err)
    typer.echo(json.dumps(manifest["totals"], indent=1))


def main() -> None:
    """The ``mtraining`` script and ``python -m mtraining.cli`` (torchrun's command on every rank): the app,
    ended as rank_exit.py says."""
    run_command(app)


if __name__ == "__main__":
    main()

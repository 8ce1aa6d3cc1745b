"""``mtraining eval``: ppl, niah, ruler, infinitebench and report commands (a typer sub-app: ``eval_app``).

Several ranks (context parallelism): run under torchrun, e.g.
``torchrun --nproc-per-node 4 -m mtraining.eval.cli niah CKPT --lengths 128K,512K``, or pass
``--nproc 4`` to have the command start torchrun on this machine: it first checks everything it can
without the model's weights (options, lengths, files, the model's config, RoPE range and memory), so a
mistake is one message and exit status 2 before any rank starts. Rank 0 prints and writes files; an
error every rank meets is printed once, by rank 0.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ..rank_exit import run_command
from .options import SessionOptions, with_session_options

if TYPE_CHECKING:
    from .answers import Prompting
    from .documents import Haystack

eval_app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Evaluate checkpoints: perplexity, needle in a haystack, RULER-style tasks, InfiniteBench.",
)

Checkpoint = Annotated[Path, typer.Argument(help="Local HF model directory, or a training checkpoint with --config.")]
Lengths = Annotated[str, typer.Option("--lengths", help="Context lengths, e.g. 4K,32K,128K,512K.")]
Samples = Annotated[int, typer.Option("--samples", help="Sequences / prompts per cell.")]
Seed = Annotated[int, typer.Option("--seed", help="Seed of the generated prompts.")]
HaystackOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--haystack",
        help="Real filler: held-out documents (JSONL with a text field, text files, ...); default: built-in filler.",
    ),
]
TeacherForcing = Annotated[
    bool,
    typer.Option(
        "--teacher-forcing/--no-teacher-forcing",
        help="Also score the expected answer teacher-forced, in the same prefill as the generated answer.",
    ),
]
Nproc = Annotated[int, typer.Option("--nproc", help="Start this many local context-parallel ranks with torchrun.")]
TextField = Annotated[str, typer.Option("--text-field", help="JSONL/parquet/arrow field holding the text.")]
DataFiles = Annotated[
    list[Path] | None,
    typer.Option("--data", help="The benchmark's own JSONL files or their directory, instead of generated prompts."),
]
TaskName = Annotated[
    str | None, typer.Option("--task", help="With --data: the task of every file (default: from file/folder names).")
]
Limit = Annotated[int | None, typer.Option("--limit", help="With --data: the first N records of each file.")]
Truncate = Annotated[
    bool,
    typer.Option(
        "--truncate", help="With --data: cut the middle out of prompts longer than the longest length (else refused)."
    ),
]
MaxNewTokens = Annotated[int | None, typer.Option("--max-new-tokens", help="Answer tokens; default: per task.")]


def _fail(err: Exception) -> None:
    """Print the error and exit 2; under torchrun only rank 0 prints (every rank meets the same error)."""
    if int(os.environ.get("RANK", "0")) == 0:
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _relaunch(command: str, nproc: int) -> None:
    """Run this same command under torchrun with ``nproc`` local ranks and exit with its status: the ranks' own
    code when they say why (2 for a mistake), without torchrun's traceback (mtraining/train/torchrun.py)."""
    from ..train.torchrun import launch, torchrun_command

    argv = sys.argv[1:]
    args = argv[argv.index(command) + 1 :] if command in argv else argv
    cleaned, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            cleaned.append(arg)
    raise typer.Exit(launch(torchrun_command(nproc) + ["-m", "mtraining.eval.cli", command, *cleaned]))


def _model_checks(hf_config, spec, opts: SessionOptions, lengths: list[int], world_size: int, generate: bool) -> None:
    """What the model's config decides: dense layers that exist, sparse budgets within the lengths, the RoPE range,
    the memory of the longest length."""
    from .loading import check_rope_range, pick_device, pick_dtype
    from .memory import check_memory

    missing = [layer for layer in spec.dense_layers if layer >= hf_config.num_hidden_layers]
    if spec.sparse and missing:
        raise ValueError(
            f"dense layers {missing} do not exist: the model has {hf_config.num_hidden_layers} layers (0 to "
            f"{hf_config.num_hidden_layers - 1}); fix --dense-layers (or attention.dense_layers of --config)"
        )
    pattern = spec.pattern_config()
    sparse_lengths = [n for n in lengths if n >= spec.min_sparse_len]
    if pattern is not None and sparse_lengths:  # budgets above a length: refused here, not at its first prefill
        for layer in sorted(set(range(hf_config.num_hidden_layers)) - set(spec.dense_layers)):
            pattern.head_budgets(layer, hf_config.num_attention_heads, min(sparse_lengths))
    check_rope_range(lengths, 0, getattr(hf_config, "max_position_embeddings", None), opts.allow_extrapolation)
    device = pick_device(opts.device)
    torch_backend = spec.backend == "torch" or (spec.backend == "auto" and device.type != "cuda")
    dtype = pick_dtype(opts.dtype, device)
    check_memory(hf_config, lengths, world_size, dtype, device, generate, torch_backend, opts.memory_limit_gib)


def _precheck(checkpoint: Path, opts: SessionOptions, world_size: int, lengths: list[int], generate: bool) -> None:
    """The checks of a session that need no weights and no ranks (the launcher's, before torchrun starts)."""
    from .engine import layout_unit
    from .loading import load_tokenizer, model_config

    spec = opts.attention_spec(world_size)
    training = opts.training_config()
    hf_config = model_config(checkpoint, training)
    fallback = None
    if training is not None:
        from ..train.data import tokenizer_path

        fallback = tokenizer_path(training)
    load_tokenizer(checkpoint, opts.tokenizer, fallback)
    if not generate:  # the loss runs every length through the layout
        unit = layout_unit(spec.layout, world_size, spec.block_size)
        if bad := [n for n in lengths if n % unit]:
            raise ValueError(
                f"length {bad[0]} cannot be split by the {spec.layout} layout over {world_size} ranks; use lengths "
                f"that are multiples of {unit}"
            )
    _model_checks(hf_config, spec, opts, lengths, world_size, generate)


class _Session:
    """Loaded model, tokenizer, context-parallel group and engine for one command on this rank."""

    def __init__(self, checkpoint: Path, opts: SessionOptions) -> None:
        import torch.distributed as dist

        from ..train.outputs import check_output_dir
        from .engine import Engine
        from .loading import load, pick_device
        from .runtime import init_group, is_root

        self.opts = opts
        self.group = init_group(pick_device(opts.device))
        self.root = is_root(self.group)
        world_size = 1 if self.group is None else dist.get_world_size(self.group)
        self.spec = opts.attention_spec(world_size)
        self.loaded = load(checkpoint, opts.tokenizer, opts.training_config(), opts.device, opts.dtype)
        self.engine = Engine(self.loaded.model, self.spec, self.group)
        self.checkpoint = str(checkpoint)
        check_output_dir(str(opts.folder(self._label())), "--out-dir")  # before the evaluation runs
        self.started = time.time()

    def check(self, lengths: list[int], generate: bool) -> None:
        """Dense layers, RoPE range and memory; every rank agrees on the outcome (no rank left waiting)."""
        error = None
        try:
            _model_checks(self.loaded.model.config, self.spec, self.opts, lengths, self.engine.world_size, generate)
        except ValueError as err:
            error = str(err)
        if self.group is not None:
            import torch.distributed as dist

            errors = [None] * self.engine.world_size
            dist.all_gather_object(errors, error, group=self.group)
            error = next((e for e in errors if e), None)
        if error:
            raise ValueError(error)

    def save(self, kind: str, settings: dict, result: object) -> tuple[dict, Path]:
        """The result under its header, written to FOLDER/KIND.json on rank 0: (that dict, FOLDER)."""
        from .runtime import write_json

        out = self._header(kind, settings) | {"result": result}
        folder = self.opts.folder(out["label"])
        if self.root:
            write_json(folder / f"{kind}.json", out)
        return out, folder

    def _label(self) -> str:
        return self.opts.label or f"{self.loaded.name}-{self.spec.name}"

    def _header(self, kind: str, settings: dict) -> dict:
        return {
            "kind": kind,
            "label": self._label(),
            "checkpoint": self.checkpoint,
            "attention": self.spec.name,
            "pattern": self.spec.pattern if self.spec.sparse else None,
            "dense_layers": list(self.spec.dense_layers) if self.spec.sparse else None,
            "sparse_density": sum(self.engine.densities) / len(self.engine.densities)
            if self.engine.densities
            else None,
            "layout": self.spec.layout,
            "ring": self.spec.ring,
            "inner_size": self.spec.inner_size,
            "context_mode": self.spec.context_mode,
            "block_size": self.spec.block_size,
            "world_size": self.engine.world_size,
            "device": str(next(self.loaded.model.parameters()).device),
            "dtype": str(next(self.loaded.model.parameters()).dtype).removeprefix("torch."),
            "settings": settings,
            "elapsed_s": round(time.time() - self.started, 2),
        }


def _run(command: str, nproc: int, body: Callable[[], None], precheck: Callable[[], None]) -> None:
    """Run ``body`` with clean errors and always leave the group; with ``--nproc N`` (outside torchrun) run
    ``precheck`` first (everything that needs no weights and no ranks), then relaunch under torchrun."""
    from .runtime import shutdown

    try:
        if nproc > 1 and "RANK" not in os.environ:
            precheck()
            _relaunch(command, nproc)
        body()
    except ValueError as err:
        shutdown()
        _fail(err)
    shutdown(together=True)


@eval_app.command()
@with_session_options
def ppl(
    checkpoint: Checkpoint,
    data: Annotated[
        list[Path],
        typer.Option("--data", help="Text/JSONL/parquet/arrow files or directories (e.g. PG-19's test/ folder)."),
    ],
    lengths: Lengths = "4K,8K,16K,32K",
    samples: Samples = 1,
    first_bucket: Annotated[
        int, typer.Option("--first-bucket", help="Positions in the first loss bucket; then doubling.")
    ] = 1024,
    pack: Annotated[
        bool, typer.Option("--pack", help="Join documents (EOS between) instead of needing each to be long enough.")
    ] = False,
    text_field: TextField = "text",
    *,
    opts: SessionOptions,
    nproc: Nproc = 1,
) -> None:
    """Perplexity of long documents at each length, with the loss per position bucket."""

    def inputs() -> tuple[list[int], list[str]]:
        from .documents import load_documents
        from .runtime import parse_lengths

        return parse_lengths(lengths), load_documents(data, text_field)

    def body() -> None:
        from .ppl import run_ppl
        from .runtime import console

        grid, docs = inputs()
        s = _Session(checkpoint, opts)
        s.check(grid, generate=False)
        results = run_ppl(s.engine, s.loaded.tokenizer, docs, grid, samples, first_bucket, pack, s.root)
        settings = {
            "lengths": grid,
            "samples": samples,
            "first_bucket": first_bucket,
            "pack": pack,
            "data": [str(p) for p in data],
        }
        out, folder = s.save("ppl", settings, results)
        if s.root:
            _print_ppl(console(), out)
            console().print(f"wrote {folder / 'ppl.json'}")

    _run("ppl", nproc, body, lambda: _precheck(checkpoint, opts, nproc, inputs()[0], generate=False))


@eval_app.command()
@with_session_options
def niah(
    checkpoint: Checkpoint,
    lengths: Lengths = "4K,8K,16K,32K",
    depths: Annotated[
        str, typer.Option("--depths", help="Needle depths in percent of the haystack.")
    ] = "0,25,50,75,100",
    samples: Samples = 1,
    seed: Seed = 0,
    haystack: HaystackOpt = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Answer tokens to generate.")] = 24,
    text_field: TextField = "text",
    teacher_forcing: TeacherForcing = True,
    generated: Annotated[
        int | None,
        typer.Option(
            "--generated",
            help="Generate answers for the first N of each cell's --samples prompts only; the others are scored "
            "teacher-forced alone (one prefill each, no decoding). Default: all generated.",
        ),
    ] = None,
    *,
    opts: SessionOptions,
    nproc: Nproc = 1,
) -> None:
    """Needle in a haystack over lengths x depths: a JSON of the grid and a heatmap PNG."""

    def inputs() -> tuple[list[int], list[float], Haystack]:
        from .runtime import parse_lengths, parse_numbers

        return parse_lengths(lengths), parse_numbers(depths, "depths"), _haystack(haystack, text_field, seed)

    def body() -> None:
        from .niah import run_niah
        from .plots import niah_heatmaps
        from .runtime import console

        grid, depth_list, stack = inputs()
        s, prompting = _prompted(
            checkpoint, opts, grid, stack, seed, samples, max_new_tokens, teacher_forcing, generated
        )
        result = run_niah(s.engine, s.loaded.tokenizer, grid, depth_list, prompting)
        settings = {
            "lengths": grid,
            "depths": depth_list,
            "samples": samples,
            "seed": seed,
            "max_new_tokens": max_new_tokens,
            "haystack": [str(p) for p in haystack or []],
            "teacher_forcing": teacher_forcing,
            "generated": generated,
        }
        out, folder = s.save("niah", settings, result)
        if s.root:
            png = niah_heatmaps([(out["label"], result)], folder / "niah.png")
            _print_grid(console(), out)
            console().print(f"wrote {folder / 'niah.json'} and {png}")

    _run("niah", nproc, body, lambda: _precheck(checkpoint, opts, nproc, inputs()[0], generate=True))


@eval_app.command()
@with_session_options
def ruler(
    checkpoint: Checkpoint,
    lengths: Lengths = "4K,8K,16K,32K",
    tasks: Annotated[
        str | None,
        typer.Option(
            "--tasks",
            help="'all' (default) or some of: niah_single, niah_multikey, niah_multivalue, niah_multiquery, vt, cwe, fwe.",
        ),
    ] = None,
    samples: Samples = 4,
    seed: Seed = 0,
    haystack: HaystackOpt = None,
    max_new_tokens: MaxNewTokens = None,
    text_field: TextField = "text",
    data: DataFiles = None,
    task: TaskName = None,
    limit: Limit = None,
    truncate: Truncate = False,
    teacher_forcing: TeacherForcing = True,
    *,
    opts: SessionOptions,
    nproc: Nproc = 1,
) -> None:
    """RULER-style tasks generated from a seed, or RULER's own JSONL (--data): scores per task and length."""

    def inputs() -> tuple[list[int], _Files | None, list, Haystack | None]:
        """(lengths, the files, their records or the task names, the haystack of generated prompts)."""
        from .ruler import parse_tasks
        from .runtime import parse_lengths

        grid = parse_lengths(lengths)
        files = _Files.of(data, task, limit, truncate, max_new_tokens, tasks=tasks, haystack=haystack)
        if files:
            return grid, files, files.samples("ruler"), None
        return grid, None, parse_tasks(tasks or "all"), _haystack(haystack, text_field, seed)

    def body() -> None:
        from .ruler import run_ruler

        grid, files, what, stack = inputs()
        if files:
            s, result = _from_files("ruler", checkpoint, opts, grid, files, what, teacher_forcing)
            settings = files.settings(grid) | {"teacher_forcing": teacher_forcing}
        else:
            s, prompting = _prompted(checkpoint, opts, grid, stack, seed, samples, max_new_tokens, teacher_forcing)
            result = run_ruler(s.engine, s.loaded.tokenizer, what, grid, prompting)
            settings = _generated(grid, what, prompting, haystack)
        _save_table(s, "ruler", "RULER-style tasks", settings, result)

    _run("ruler", nproc, body, lambda: _precheck(checkpoint, opts, nproc, inputs()[0], generate=True))


@eval_app.command()
@with_session_options
def infinitebench(
    checkpoint: Checkpoint,
    lengths: Lengths = "4K,8K,16K,32K",
    tasks: Annotated[
        str | None,
        typer.Option("--tasks", help="'all' (default) or some of: passkey, number_string, kv_retrieval, math_find."),
    ] = None,
    samples: Samples = 4,
    seed: Seed = 0,
    haystack: HaystackOpt = None,
    max_new_tokens: MaxNewTokens = None,
    text_field: TextField = "text",
    data: DataFiles = None,
    task: TaskName = None,
    limit: Limit = None,
    truncate: Truncate = False,
    teacher_forcing: TeacherForcing = True,
    *,
    opts: SessionOptions,
    nproc: Nproc = 1,
) -> None:
    """InfiniteBench's passkey, number string, key-value and Math.Find tasks, generated from a seed (passkey and
    number string in real filler with --haystack) or read from the benchmark's JSONL (--data): scores per task and
    length."""

    def inputs() -> tuple[list[int], _Files | None, list, Haystack | None]:
        """(lengths, the files, their records or the task names, the haystack of generated prompts)."""
        from .infinitebench import TASKS
        from .ruler import parse_tasks
        from .runtime import parse_lengths

        grid = parse_lengths(lengths)
        files = _Files.of(data, task, limit, truncate, max_new_tokens, tasks=tasks, haystack=haystack)
        if files:
            return grid, files, files.samples("infinitebench"), None
        return grid, None, parse_tasks(tasks or "all", TASKS), _haystack(haystack, text_field, seed)

    def body() -> None:
        from .infinitebench import run_infinitebench

        grid, files, what, stack = inputs()
        if files:
            s, result = _from_files("infinitebench", checkpoint, opts, grid, files, what, teacher_forcing)
            settings = files.settings(grid) | {"teacher_forcing": teacher_forcing}
        else:
            s, prompting = _prompted(checkpoint, opts, grid, stack, seed, samples, max_new_tokens, teacher_forcing)
            result = run_infinitebench(s.engine, s.loaded.tokenizer, what, grid, prompting)
            settings = _generated(grid, what, prompting, haystack)
        _save_table(s, "infinitebench", "InfiniteBench", settings, result)

    _run("infinitebench", nproc, body, lambda: _precheck(checkpoint, opts, nproc, inputs()[0], generate=True))


@dataclass(frozen=True)
class _Files:
    """The benchmark's own files (--data) and how to read them (--task, --limit, --truncate, --max-new-tokens)."""

    data: list[Path]
    task: str | None
    limit: int | None
    truncate: bool
    max_new_tokens: int | None

    @classmethod
    def of(
        cls,
        data: list[Path] | None,
        task: str | None,
        limit: int | None,
        truncate: bool,
        max_new_tokens: int | None,
        **generating: object,
    ) -> _Files | None:
        """The files given, or None to generate prompts; ValueError for options of the other mode
        (``generating``: the options that shape generated prompts, by name)."""
        if data:
            wrong = [f"--{name}" for name, value in generating.items() if value]
            fix = "the prompts and tasks come from the files (--task names the task of every file)"
        else:
            wrong = [name for name, value in (("--task", task), ("--limit", limit), ("--truncate", truncate)) if value]
            fix = "they read the benchmark's files: pass --data FILE.jsonl or drop them"
        if wrong:
            raise ValueError(f"{wrong[0]} does not apply {'with' if data else 'without'} --data: {fix}")
        return cls(data, task, limit, truncate, max_new_tokens) if data else None

    def samples(self, kind: str) -> list:
        """The benchmark's records, read and checked (format errors name the file and line, before the model)."""
        from . import datafiles

        load = datafiles.ruler_samples if kind == "ruler" else datafiles.infinitebench_samples
        return load(self.data, self.task, self.limit, self.max_new_tokens)

    def settings(self, lengths: list[int]) -> dict:
        return {
            "lengths": lengths,
            "data": [str(p) for p in self.data],
            "task": self.task,
            "limit": self.limit,
            "truncate": self.truncate,
            "max_new_tokens": self.max_new_tokens,
        }


def _generated(lengths: list[int], tasks: list[str], prompting: Prompting, haystack: list[Path] | None) -> dict:
    """The settings of a ruler or infinitebench command whose prompts are generated from a seed."""
    return {
        "lengths": lengths,
        "tasks": tasks,
        "samples": prompting.samples,
        "seed": prompting.seed,
        "max_new_tokens": prompting.max_new_tokens,
        "haystack": [str(p) for p in haystack or []],
        "teacher_forcing": prompting.forced,
    }


def _from_files(
    kind: str, checkpoint: Path, opts: SessionOptions, lengths: list[int], files: _Files, samples: list, forced: bool
) -> tuple[_Session, dict]:
    """The session and result of a ruler or infinitebench command run on the benchmark's own files (``samples``:
    their records)."""
    from . import datafiles

    s = _Session(checkpoint, opts)
    s.check(lengths, generate=True)
    tokenizer = s.loaded.tokenizer
    datafiles.refuse_special_tokens(samples, tokenizer.special_tokens)
    placed = datafiles.place(samples, lengths, tokenizer.count, files.truncate)
    return s, datafiles.run_samples(s.engine, tokenizer, placed, lengths, kind, s.root, forced)


def _save_table(s: _Session, kind: str, title: str, settings: dict, result: dict) -> None:
    """KIND.json and KIND.md (the task x length table) on rank 0, and the table on the console."""
    from .ruler import markdown_table
    from .runtime import console

    out, folder = s.save(kind, settings, result)
    if s.root:
        table = markdown_table(result)
        (folder / f"{kind}.md").write_text(f"# {title}: {out['label']}\n\n{table}\n")
        console().print(table)
        console().print(f"wrote {folder / f'{kind}.json'} and {folder / f'{kind}.md'}")


@eval_app.command()
def report(
    results: Annotated[list[Path], typer.Argument(help="Result JSON files or directories (e.g. eval-results/).")],
    out_dir: Annotated[Path, typer.Option("--out-dir", help="Where report.md and its PNGs go.")] = Path("eval-report"),
) -> None:
    """One Markdown report with comparison plots from the JSONs of several checkpoints."""
    from .report import build_report

    try:
        path = build_report(results, out_dir)
    except ValueError as err:
        _fail(err)
    typer.echo(f"wrote {path}")


def _haystack(haystack: list[Path] | None, text_field: str, seed: int) -> Haystack:
    """The filler of generated prompts: the --haystack documents, else the built-in filler."""
    from .documents import Haystack, load_documents

    return Haystack(load_documents(haystack, text_field), seed=seed) if haystack else Haystack(seed=seed)


def _prompted(
    checkpoint: Path,
    opts: SessionOptions,
    lengths: list[int],
    stack: Haystack,
    seed: int,
    samples: int,
    max_new_tokens: int | None,
    forced: bool,
    generated: int | None = None,
) -> tuple[_Session, Prompting]:
    """The session of a command with generated prompts, checked for generating at ``lengths``, and how it prompts."""
    from .answers import Prompting

    s = _Session(checkpoint, opts)
    s.check(lengths, generate=True)
    return s, Prompting(samples, seed, stack, max_new_tokens, s.root, forced, generated)


def _print_ppl(out, data: dict) -> None:
    from rich.table import Table

    table = Table(title=f"perplexity: {data['label']}")
    for col in ("length", "windows", "ppl", "first bucket", "last bucket", "last bucket 95%"):
        table.add_column(col, justify="right")
    for r in data["result"]:
        first, last = r["buckets"][0], r["buckets"][-1]
        interval = last["ppl_interval"]
        table.add_row(
            str(r["length"]),
            str(r["windows"]),
            f"{r['ppl']:.3f}",
            f"{first['ppl']:.3f} (≤{first['end']})",
            f"{last['ppl']:.3f} ({last['start']}–{last['end']})",
            "–" if interval is None else f"[{interval[0]:.3f}, {interval[1]:.3f}]",
        )
    out.print(table)


def _print_grid(out, data: dict) -> None:
    from rich.table import Table

    res = data["result"]
    table = Table(title=f"needle in a haystack (% found): {data['label']}")
    table.add_column("depth \\ length")
    for n in res["lengths"]:
        table.add_column(str(n), justify="right")
    for depth, row in zip(res["depths"], res["scores"]):
        table.add_row(f"{depth:g}%", *(f"{v:.0f}" for v in row))
    table.add_row("all depths", *(_with_interval(c["score"], c["interval"]) for c in res["by_length"]))
    if res["by_length"] and res["by_length"][0]["forced"] is not None:
        forced = (_with_interval(c["forced"], c["forced_interval"]) for c in res["by_length"])
        table.add_row("teacher-forced", *forced)
    out.print(table)


def _with_interval(value: float, interval: list[float]) -> str:
    return f"{value:.1f} [{interval[0]:.1f}, {interval[1]:.1f}]"


if __name__ == "__main__":  # the command torchrun starts on every rank (rank_exit.py: how it ends)
    run_command(eval_app)

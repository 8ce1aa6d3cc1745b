"""One reading of one model at every evaluation length, through ``mtraining.eval``.

A read is a model (the converted base, or a trained arm's export) with an attention (dense, or a sparse arm's own
setting at each length). At each length it runs, on the same held-out inputs for every model:

- NIAH (``run_niah``): ``niah_prompts`` prompts over the depths, filler from the held-out documents, answered by
  generation and scored teacher-forced in the same prefill (the whole prompt through the attention under test), and
  up to ``Settings.forced_prompts`` in all scored teacher-forced (the others a prefill each, no decoding);
- the RULER-style tasks (``run_ruler``), ``ruler_samples`` prompts each, the same filler;
- perplexity by position (``run_ppl``) on the first ``length`` tokens of ``ppl_windows`` held-out documents.

Each length is a cell cached on its own (``<work>/eval/<read>/<length>.json``), so a call stopped by the deadline
loses at most one cell. Prompts are the same for every model: built once per machine (``build_prompts``, on the
spare cores while the GPU trains) from the evaluation seed, the tokenizer and the held-out documents, and kept in
``<work>/eval/prompts.pkl`` for the next call.
"""

from __future__ import annotations

import contextlib
import functools
import math
import pickle
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.common import written

from .settings import Arm, Settings

NIAH_TITLE = "needle in a haystack"  # run_niah's title: the first field of its prompts' cache keys
PPL_CHARS_PER_TOKEN = 8  # a held-out document's first length x this many characters hold its first window


@dataclass(frozen=True)
class Read:
    """Model ``model`` (``base``, ``seed<S>/<arm>``, or an earlier phase's ``seed<S>/<arm>_at_<length>``) read with
    ``arm``'s attention at the evaluation's lengths, up to ``upto`` tokens where given (an earlier phase's model is
    read only up to the length it was trained at)."""

    model: str
    arm: Arm
    upto: int | None = None

    def lengths(self, settings: Settings) -> tuple[int, ...]:
        return tuple(n for n in settings.lengths if self.upto is None or n <= self.upto)

    @property
    def attention(self) -> str:
        return self.arm.name if self.arm.sparse else "dense"

    @property
    def label(self) -> str:
        """The read's file name: ``base__dense``, ``seed0_adaptive__sparse`` ..."""
        return f"{self.model.replace('/', '_')}__{'sparse' if self.arm.sparse else 'dense'}"


def spec(arm: Arm, length: int, settings: Settings):
    """The ``AttentionSpec`` of ``arm`` at ``length`` (one process; the arm's budgets capped at the length)."""
    from mtraining.eval.engine import AttentionSpec

    return AttentionSpec(
        sparse=arm.sparse,
        layout="striped",
        block_size=settings.block_size,
        backend=settings.backend,
        pattern=arm.pattern(length, settings),
    )


def per_depth(prompts: int, settings: Settings) -> int:
    """NIAH prompts per depth for ``prompts`` per length (rounded up)."""
    return -(-prompts // len(settings.depths))


class Inputs:
    """What every read of one process shares: the tokenizer, the held-out documents as haystack and as perplexity
    windows, and the prompts built so far (keyed as ``mtraining.eval.answers.score_samples`` keys them)."""

    def __init__(self, tokenizer_dir: Path, heldout: list[Path], settings: Settings) -> None:
        from mtraining.eval.documents import Haystack, load_documents
        from mtraining.eval.loading import load_tokenizer

        self.settings = settings
        self.tokenizer = load_tokenizer(tokenizer_dir)
        docs = load_documents(heldout)
        self.haystack = Haystack(docs, seed=settings.eval_seed)
        self.ppl_docs = [d[: PPL_CHARS_PER_TOKEN * settings.length] for d in docs]
        self.prompts: dict = {}

    def load_prompts(self, path: Path) -> None:
        """Add the prompts an earlier call built (``build_prompts``'s file), if any."""
        if path.exists():
            self.prompts.update(pickle.loads(path.read_bytes()))

    def prompting(self, samples: int, generated: int | None = None):
        """``samples`` prompts per cell, the first ``generated`` of them generated (None: all)."""
        from mtraining.eval.answers import Prompting

        s = self.settings
        return Prompting(
            samples, s.eval_seed, self.haystack, None, show_progress=False, generated=generated, cache=self.prompts
        )


def read_length(model, inputs: Inputs, arm: Arm, length: int, niah_prompts: int | None = None) -> dict:
    """One cell: NIAH, RULER-style tasks and perplexity of ``model`` (loaded) read with ``arm`` at ``length``.
    ``niah_prompts`` (default the settings'): NIAH alone, that many prompts, all generated (the base check)."""
    from mtraining.eval.engine import Engine
    from mtraining.eval.niah import run_niah
    from mtraining.eval.ppl import run_ppl
    from mtraining.eval.ruler import run_ruler

    s, tok = inputs.settings, inputs.tokenizer
    engine = Engine(model, spec(arm, length, s))
    generated = per_depth(s.niah_prompts if niah_prompts is None else niah_prompts, s)
    forced = per_depth(s.forced_prompts, s) if niah_prompts is None else generated
    seconds: dict[str, dict] = {}
    with _timed(seconds, "niah") as items:
        niah = run_niah(engine, tok, [length], list(s.depths), inputs.prompting(forced, generated))
        items.append(len(niah["records"]))
    _split_forced(seconds, niah["records"], engine.phases)
    cell = {"length": length, "niah": _niah_cell(niah)}
    if niah_prompts is None:
        with _timed(seconds, "ruler") as items:
            ruler = run_ruler(engine, tok, list(s.ruler_tasks), [length], inputs.prompting(s.ruler_samples))
            items.append(len(ruler["records"]))
        cell["ruler"] = _ruler_cell(ruler)
        with _timed(seconds, "ppl") as items:
            (ppl,) = run_ppl(engine, tok, inputs.ppl_docs, [length], s.ppl_windows, s.first_bucket, show_progress=False)
            items.append(ppl["windows"])
        cell["ppl"] = ppl
    cell["density"] = sum(engine.densities) / len(engine.densities) if engine.densities else None
    cell["seconds"] = seconds
    cell["phases"] = asdict(engine.phases)
    return cell


@contextlib.contextmanager
def _timed(into: dict, task: str):
    """Wall seconds of one task of a read and its item count (appended by the caller): ``into[task]``."""
    items: list[int] = []
    started = time.perf_counter()
    yield items
    total = round(time.perf_counter() - started, 2)
    into[task] = {"s": total, "items": items[0] if items else 0}


def _split_forced(seconds: dict, records: list[dict], phases) -> None:
    """``seconds["niah"]`` split into the generated prompts' and ``seconds["niah_forced"]``, the prompts read
    teacher-forced alone: every prompt does the same work but for decoding (a prompt of the same length tokenised
    and prefilled), so those take their share of the NIAH seconds less the decoding (``phases``: the engine has run
    NIAH alone so far), the generated ones the rest. Nothing to split without such prompts."""
    alone = sum(not r["generated"] for r in records)
    if not alone:
        return
    niah = seconds["niah"]
    forced_s = round(alone * (niah["s"] - phases.decode_s) / niah["items"], 2)
    seconds["niah"] = {"s": round(niah["s"] - forced_s, 2), "items": niah["items"] - alone}
    seconds["niah_forced"] = {"s": forced_s, "items": alone}


def _niah_cell(result: dict) -> dict:
    """NIAH at one length: the depths pooled (``by_length``), the depth grid and every prompt's record."""
    (pooled,) = result["by_length"]
    return {
        **pooled,
        "depths": result["depths"],
        "by_depth": [row[0] for row in result["scores"]],
        "records": result["records"],
    }


def _ruler_cell(result: dict) -> dict:
    """The RULER-style tasks at one length: each task's score, the average over tasks and every prompt's record."""
    return {
        "tasks": result["tasks"],
        "scores": {t: v[0] for t, v in result["scores"].items()},
        "forced": {t: v[0] for t, v in result["forced"].items()},
        "average": result["average"][0],
        "average_interval": result["average_interval"][0],
        "records": result["records"],
    }


def last_bucket_ppl(cell: dict) -> float:
    """Perplexity of the last position bucket of a cell's windows (the tokens with the most context)."""
    return cell["ppl"]["buckets"][-1]["ppl"]


def load_model(export: Path, settings: Settings):
    """The model of ``export`` for reading, on the settings' device in their dtype."""
    from mtraining.eval.loading import load

    return load(export, device=settings.device, dtype=settings.dtype).model


# ---------------------------------------------------------------------------------------------- prompts
def prompt_keys(settings: Settings, native: int) -> list[tuple]:
    """The cache key of every prompt the experiment asks for: the base check's at ``native``, then every read's
    (NIAH per length, depth and seed, teacher-forced alone or not: one prompt either way; RULER-style per task,
    length and seed), the longest first within each."""
    s = settings
    seeds = lambda count: range(s.eval_seed, s.eval_seed + count)  # noqa: E731
    base = [(NIAH_TITLE, native, d, k) for d in s.depths for k in seeds(per_depth(s.base_prompts, s))]
    niah = [(NIAH_TITLE, n, d, k) for n in s.lengths for d in s.depths for k in seeds(per_depth(s.forced_prompts, s))]
    ruler = [("ruler", t, n, k) for t in s.ruler_tasks for n in s.lengths for k in seeds(s.ruler_samples)]
    rest = sorted(niah + ruler, key=lambda key: -(key[2] if key[0] == "ruler" else key[1]))
    return list(dict.fromkeys(base + rest))


def build_prompts(path: Path, keys: Iterable[tuple], job: tuple, pool=None) -> dict:
    """The prompts of ``keys`` that ``path`` lacks, built (on ``pool``'s workers, else here) and added to ``path``
    a batch at a time (a call stopped midway keeps the batches done); returns all of ``path``'s prompts.
    ``job``: (tokenizer folder, held-out files, evaluation seed)."""
    saved = pickle.loads(path.read_bytes()) if path.exists() else {}
    missing = [key for key in keys if key not in saved]
    size = 2 * pool.workers if pool is not None else len(missing)
    for start in range(0, len(missing), max(1, size)):
        batch = [(job, key) for key in missing[start : start + size]]
        built = pool.map(_build_prompt, batch) if pool is not None else list(map(_build_prompt, batch))
        saved.update(zip([key for _, key in batch], built, strict=True))
        with written(path, "building") as tmp:
            tmp.write_bytes(pickle.dumps(saved))
    return saved


def _build_prompt(item: tuple):
    """The sample of one cache key, as ``run_niah`` and ``run_ruler`` build it (a worker process)."""
    from mtraining.eval.niah import TASK
    from mtraining.eval.tasks import generate

    job, key = item
    tokenizer, haystack = _worker_inputs(*job)
    if key[0] == "ruler":
        _, task, length, seed = key
        return generate(task, length, seed, tokenizer.count, haystack, max_new_tokens=None)
    _, length, depth, seed = key
    return generate(TASK, length, seed, tokenizer.count, haystack, depth / 100, None)


@functools.cache
def _worker_inputs(tokenizer_dir: str, heldout: tuple[str, ...], seed: int):
    """The tokenizer and haystack a worker builds prompts with (once per process)."""
    from mtraining.eval.documents import Haystack, load_documents
    from mtraining.eval.loading import load_tokenizer

    return load_tokenizer(tokenizer_dir), Haystack(load_documents(list(heldout)), seed=seed)


def niah_percent(cell: dict, forced: bool = False) -> float:
    """A cell's NIAH score (percent), generated or teacher-forced."""
    value = cell["niah"]["forced" if forced else "score"]
    return math.nan if value is None else value

"""Greedy answers to prompts, scored per cell of an evaluation grid (NIAH, RULER-style, InfiniteBench).

Prompts come from the seeded generators (``score_cells``) or from official files on disk
(``score_samples`` with samples already made); either way each answer is scored by its sample's
metric and the records keep every prompt's prediction and expected answers.

Beside generation, the reference answer is scored teacher-forced in the same prefill (``Engine.respond``):
the expected answers joined by ", " after the prompt (``reference_text``), each token's loss and whether it
is the greedy prediction. ``forced`` in a cell is the percentage of prompts whose every reference token is
greedy: what greedy decoding through the attention under test would produce, on every answer token (generation
decodes the tokens after the first dense). For several expected answers the reference is one order of them, so
there the teacher-forced reading is stricter than the generated one, which scores them in any order.
Every cell carries 95% intervals over its prompts (``intervals``).

``Prompting.generated`` generates the answers of only the first prompts of each cell: the others are built alike and
scored teacher-forced alone (one prefill, no decoding), so that a cell's teacher-forced reading can rest on many more
prompts than its generated one for the same time. Their records say ``"generated": False``; a cell's generated score
and its interval come from the generated records, its teacher-forced figures from all.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from ..data.tokenizer import Tokenizer
from .documents import Haystack
from .engine import Engine, Forced
from .intervals import mean_of_means_interval, score_interval
from .runtime import track
from .scoring import mean_percent, score
from .tasks import Sample


def middle_cut(ids: list[int], keep: int) -> list[int]:
    """The first ``keep // 2`` and last ``keep - keep // 2`` ids (InfiniteBench's truncation: the
    instruction at the start and the question at the end survive, the middle of the context goes)."""
    if len(ids) <= keep:
        return ids
    head = keep // 2
    return ids[:head] + ids[len(ids) - (keep - head) :]


def reference_text(sample: Sample) -> str:
    """The answer a teacher-forced reading scores after ``sample.prompt``: its expected answers joined by ", ",
    after a space unless the prompt ends in whitespace."""
    return ("" if sample.prompt[-1:].isspace() else " ") + ", ".join(sample.answers)


@dataclass(frozen=True)
class Answered:
    """The model's greedy answer to a sample (None when not generated) and, when asked, its reference answer scored
    teacher-forced."""

    prediction: str | None
    forced: Forced | None = None


def tokenised(sample: Sample, tokenizer: Tokenizer) -> Sample:
    """``sample`` with the token ids of its prompt and reference answer (``Sample.ids``), so that answering it
    tokenises nothing: built once with the prompt (on spare cores), not once per model that answers it."""
    reference = tokenizer.continuation(sample.prompt, reference_text(sample))
    return dataclasses.replace(sample, ids=tokenizer.encode(sample.prompt), reference_ids=reference)


def answer(
    engine: Engine, tokenizer: Tokenizer, sample: Sample, forced: bool = True, generate: bool = True
) -> Answered:
    """The model's greedy answer to ``sample`` (prefill through the configured attention; without ``generate`` none:
    the prefill alone, no decoding) and with ``forced`` the reference answer's teacher-forced scores; a prompt longer
    than its length allows is cut in the middle first (see ``middle_cut``: by the sample's answer budget either way,
    so both read the same prompt). Token ids the sample carries (``tokenised``) are used as they are."""
    if not (generate or forced):
        raise ValueError("a prompt neither generated nor teacher-forced scores nothing: keep one of them")
    ids = tokenizer.encode(sample.prompt) if sample.ids is None else list(sample.ids)
    reference = None
    if forced:
        given = sample.reference_ids
        reference = tokenizer.continuation(sample.prompt, reference_text(sample)) if given is None else list(given)
    ids = middle_cut(ids, sample.length - sample.max_new_tokens)
    response = engine.respond(ids, sample.max_new_tokens if generate else 1, tokenizer.stop_ids, reference)
    return Answered(tokenizer.decode(response.tokens) if generate else None, response.forced)


@dataclass(frozen=True)
class Prompting:
    """How each cell of a grid is prompted: ``samples`` prompts seeded ``seed ..``, from ``haystack``; with
    ``generated`` the answers of the first that many are generated and the rest scored teacher-forced alone."""

    samples: int = 1
    seed: int = 0
    haystack: Haystack | None = None  # None: the built-in filler, seeded with ``seed``
    max_new_tokens: int | None = None  # None: the task's own
    show_progress: bool = True
    forced: bool = True  # also score the reference answer teacher-forced
    generated: int | None = None  # generate the first this many of a cell's prompts, the rest forced; None: all
    # Samples already built with these settings and the same tokenizer, filled as samples are built:
    # several models that share a tokenizer build each prompt once (keys: see ``score_samples``).
    cache: dict | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(f"samples must be at least 1, got {self.samples}")
        if self.generated is not None and not 1 <= self.generated <= self.samples:
            raise ValueError(f"generated must be in 1..samples ({self.samples}), got {self.generated}")
        if self.generated is not None and self.generated < self.samples and not self.forced:
            raise ValueError("prompts that are not generated are scored teacher-forced alone: keep teacher forcing on")
        if self.haystack is None:
            object.__setattr__(self, "haystack", Haystack(seed=self.seed))


Run = tuple[dict, dict, Callable[[], Sample]]  # (cell, record fields, the sample, made when its turn comes)
_AHEAD, _BUILDERS = 4, 2  # samples built ahead of the one answered, on this many threads


def score_samples(
    engine: Engine,
    tokenizer: Tokenizer,
    runs: Sequence[Run],
    title: str,
    show_progress: bool = True,
    cache: dict | None = None,
    forced: bool = True,
    generated: int | None = None,
) -> tuple[dict[tuple, list[float]], list[dict]]:
    """Answer and score each run's sample: the generated scores per cell (keyed by the tuple of the cell's
    values) and a record per prompt (the cell's fields, then the run's own, then the outcome, with ``forced``
    the reference's teacher-forced scores). ``cache``: see ``Prompting.cache`` (keyed by title, the cell's and
    the run's values). ``generated``: see ``Prompting.generated`` (a cell's first runs in order are generated);
    the others' records hold None as prediction and score."""
    scores: dict[tuple, list[float]] = {}
    records = []
    for cell, fields, sample in track(_built(runs, title, cache), len(runs), title, show_progress):
        key = tuple(cell.values())
        generate = generated is None or len(scores.get(key, [])) < generated
        got = answer(engine, tokenizer, sample, forced, generate)
        value = score(sample.metric, got.prediction, sample.answers) if generate else None
        if generate:
            scores.setdefault(key, []).append(value)
        records.append(
            {
                **cell,
                **fields,
                "prompt_tokens": min(sample.prompt_tokens, sample.length - sample.max_new_tokens),
                "answers": sample.answers,
                "generated": generate,
                "prediction": got.prediction,
                "metric": sample.metric,
                "score": value,
                **_forced_fields(got.forced),
            }
        )
    return scores, records


def _built(runs: Sequence[Run], title: str, cache: dict | None) -> Iterator[tuple[dict, dict, Sample]]:
    """(cell, fields, sample) of each run in order, samples taken from ``cache`` or built ``_AHEAD`` runs ahead on
    ``_BUILDERS`` threads (building tokenises whole prompts, which releases the GIL: it overlaps the model's work)."""
    keys = [(title, *cell.values(), *fields.values()) for cell, fields, _ in runs]
    with ThreadPoolExecutor(_BUILDERS) as pool:
        pending: dict[int, Future] = {}
        for i, (cell, fields, _) in enumerate(runs):
            for j in range(i, min(i + _AHEAD, len(runs))):
                if j not in pending and (cache is None or keys[j] not in cache):
                    pending[j] = pool.submit(runs[j][2])
            sample = cache[keys[i]] if i not in pending else pending.pop(i).result()
            if cache is not None:
                cache[keys[i]] = sample
            yield cell, fields, sample


def _forced_fields(forced: Forced | None) -> dict:
    """A prompt record's teacher-forced fields: per reference token its loss and whether it is greedy, and
    ``forced_score`` 1.0 when all are (else 0.0); none without a teacher-forced reading."""
    if forced is None:
        return {}
    return {"forced_nll": forced.nll, "forced_greedy": forced.greedy, "forced_score": float(forced.all_greedy)}


def _generated_scores(records: Sequence[dict]) -> list[float]:
    """The scores of the records whose answer was generated."""
    return [r["score"] for r in records if r["generated"]]


def summarise(records: Sequence[dict]) -> dict:
    """One cell's prompts: from the generated records ``score`` (mean percent) with its 95% ``interval``
    (``intervals.score_interval``) and their count ``generated``; ``prompts`` (all records), and from every
    teacher-forced record ``forced`` (percent all greedy), ``forced_interval`` and ``forced_nll`` (mean loss per
    reference token); None for the teacher-forced fields without them."""
    scores = _generated_scores(records)
    out = {"score": mean_percent(scores), "interval": list(score_interval(scores)), "prompts": len(records)}
    out["generated"] = len(scores)
    forced = [r for r in records if "forced_score" in r]
    if forced:
        tokens = sum(len(r["forced_nll"]) for r in forced)
        out["forced"] = mean_percent([r["forced_score"] for r in forced])
        out["forced_interval"] = list(score_interval([r["forced_score"] for r in forced]))
        out["forced_nll"] = sum(sum(r["forced_nll"]) for r in forced) / tokens if tokens else None
    else:
        out |= {"forced": None, "forced_interval": None, "forced_nll": None}
    return out


def score_prompted(
    engine: Engine, tokenizer: Tokenizer, runs: Sequence[Run], title: str, prompting: Prompting
) -> tuple[dict[tuple, list[float]], list[dict]]:
    """``score_samples`` as ``prompting`` says: its progress, prompt cache, teacher forcing and generated count."""
    return score_samples(
        engine, tokenizer, runs, title, prompting.show_progress, prompting.cache, prompting.forced, prompting.generated
    )


def score_cells(
    engine: Engine,
    tokenizer: Tokenizer,
    cells: Sequence[dict],
    prompt: Callable[[dict, int], Sample],
    prompting: Prompting,
    title: str,
) -> tuple[dict[tuple, float], list[dict]]:
    """Answer ``prompting.samples`` prompts per cell, built by ``prompt(cell, seed)`` (the first
    ``prompting.generated`` generated, the rest teacher-forced alone).

    Returns the mean percent of the generated answers per cell (keyed by the tuple of the cell's values) and a
    record per prompt (the cell's fields first).
    """
    seeds = range(prompting.seed, prompting.seed + prompting.samples)
    runs = [(cell, {"seed": s}, functools.partial(prompt, cell, s)) for cell in cells for s in seeds]
    scores, records = score_prompted(engine, tokenizer, runs, title, prompting)
    return {key: mean_percent(values) for key, values in scores.items()}, records


def task_grid(
    tasks: Sequence[str], lengths: Sequence[int], scores: dict[tuple, list[float]], records: list[dict]
) -> dict:
    """{"tasks", "lengths", "scores": {task: [percent or None per length]}, "counts", "average", "intervals",
    "forced", "forced_intervals", "forced_nll", "average_interval", "records"} from per-(task, length) scores and
    the prompts' records; a cell without prompts scores None, the average skips it. ``intervals`` and
    ``forced_intervals`` are [low, high] per cell (``summarise``); ``average_interval`` resamples every task's
    prompts at once (``intervals.mean_of_means_interval``)."""
    cells = {(t, n): [r for r in records if r["task"] == t and r["length"] == n] for t in tasks for n in lengths}
    summary = {key: summarise(found) if found else None for key, found in cells.items()}

    def grid(field: str) -> dict:
        return {t: [None if summary[(t, n)] is None else summary[(t, n)][field] for n in lengths] for t in tasks}

    table = {t: [mean_percent(scores[(t, n)]) if scores.get((t, n)) else None for n in lengths] for t in tasks}
    counts = {t: [len(scores.get((t, n), [])) for n in lengths] for t in tasks}
    average = []
    for i in range(len(lengths)):
        values = [table[t][i] for t in tasks if table[t][i] is not None]
        average.append(sum(values) / len(values) if values else None)
    average_interval = [
        list(mean_of_means_interval([_generated_scores(cells[(t, n)]) for t in tasks]))
        if any(cells[(t, n)] for t in tasks)
        else None
        for n in lengths
    ]
    return {
        "tasks": list(tasks),
        "lengths": list(lengths),
        "scores": table,
        "counts": counts,
        "average": average,
        "intervals": grid("interval"),
        "average_interval": average_interval,
        "forced": grid("forced"),
        "forced_intervals": grid("forced_interval"),
        "forced_nll": grid("forced_nll"),
        "records": records,
    }

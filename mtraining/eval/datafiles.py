"""Official benchmark files on disk as scored samples: InfiniteBench's JSONL and RULER's generated JSONL.

- InfiniteBench (huggingface.co/datasets/xinrongzhang2022/InfiniteBench: one TASK.jsonl per task):
  records {id, context, input, answer, options}; the task comes from the file name (passkey.jsonl,
  passkey_8192.jsonl, ...) or ``task``; prompts and scores as in ``infinitebench``.
- RULER (github.com/NVIDIA/RULER: scripts/data/prepare.py writes SAVE_DIR/TASK/validation.jsonl):
  records {index, input, outputs, length, answer_prefix}; the prompt is input + answer_prefix (what
  RULER's call_api.py sends), the task is the folder name (or the file name, or ``task``); scored as
  RULER's evaluate.py scores: string_match_part for its qa tasks, string_match_all for the others,
  with its answer budgets per task family (niah 128 tokens, vt 30, cwe 120, fwe 50, qa 32).

Files (``--data``: files, globs or folders of .jsonl, also gzipped) are found and read by the shared
reader (mtraining.data.documents), whose errors name the file and line.

``place`` puts each record in the smallest asked length that holds its prompt and answer, in the
model's tokenizer. A record longer than the largest length is refused with a message naming the fix,
or with ``truncate`` cut in the middle to fit it, as InfiniteBench's scripts cut prompts to 128K.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ..data.documents import KINDS, find_files, read_records
from ..data.tokenizer import Tokenizer
from . import infinitebench
from .answers import score_samples, task_grid
from .engine import Engine
from .scoring import check_answers
from .tasks import Sample

# RULER task family (name prefix): (answer tokens, metric), from its constants.py files
RULER_FAMILIES = {
    "niah": (128, "substring_all"),
    "vt": (30, "substring_all"),
    "variable_tracking": (30, "substring_all"),
    "cwe": (120, "substring_all"),
    "common_words": (120, "substring_all"),
    "fwe": (50, "substring_all"),
    "freq_words": (50, "substring_all"),
    "qa": (32, "substring_any"),
}


def _jsonl_files(paths: Sequence[str | Path]) -> list[Path]:
    if not paths:
        raise ValueError("no data given; pass --data with a .jsonl file or a directory of them")
    return [file for path in paths for file in find_files(path, ("jsonl",))]


def _stem(path: Path) -> str:
    """The file name without its JSONL ending (passkey.jsonl.gz -> passkey)."""
    ending = next(e for e in sorted(KINDS["jsonl"], key=len, reverse=True) if path.name.lower().endswith(e))
    return path.name[: -len(ending)]


def _records(path: Path, limit: int | None) -> Iterator[tuple[int, dict]]:
    """(line number, record) of the first ``limit`` records of a JSONL file (the shared reader's)."""
    for count, (line_no, record) in enumerate(read_records(path)):
        if limit is not None and count >= limit:
            return
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{line_no} is a JSON {type(record).__name__}, not an object")
        yield line_no, record


def _load(
    paths: Sequence[str | Path], limit: int | None, task_of: Callable[[Path], str], make: Callable[[str, dict], Sample]
) -> list[Sample]:
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be at least 1 record per file, got {limit}")
    samples = []
    for path in _jsonl_files(paths):
        task = task_of(path)
        for line_no, record in _records(path, limit):
            try:
                sample = make(task, record)
            except ValueError as e:
                raise ValueError(f"{path}:{line_no}: {e}") from None
            sample.meta = {"file": str(path), "id": record.get("id", record.get("index", line_no))}
            samples.append(sample)
    if not samples:
        raise ValueError(f"no records in {', '.join(map(str, paths))}")
    return samples


def infinitebench_samples(
    paths: Sequence[str | Path], task: str | None = None, limit: int | None = None, max_new_tokens: int | None = None
) -> list[Sample]:
    """The records of InfiniteBench JSONL files (the first ``limit`` of each) as unplaced samples."""
    tasks = infinitebench.TASKS

    def task_of(path: Path) -> str:
        if task is not None:
            if task not in tasks:
                raise ValueError(f"unknown InfiniteBench task {task!r}; use one of {', '.join(tasks)}")
            return task
        stem = _stem(path)
        named = [t for t in tasks if stem == t or stem.startswith(t + "_")]
        if not named:
            raise ValueError(
                f"cannot tell the InfiniteBench task of {path} from its name; name it TASK.jsonl or pass --task, "
                f"one of {', '.join(tasks)} (the book, dialogue, code and Math.Calc tasks are not supported)"
            )
        return max(named, key=len)

    return _load(paths, limit, task_of, lambda t, r: infinitebench.sample_from_record(t, r, max_new_tokens))


def _ruler_sample(task: str, record: dict, max_new_tokens: int | None) -> Sample:
    family = next((f for f in sorted(RULER_FAMILIES, key=len, reverse=True) if task.startswith(f)), None)
    if family is None and max_new_tokens is None:
        raise ValueError(
            f"unknown RULER task {task!r} (known families: {', '.join(RULER_FAMILIES)}); "
            "pass --task with its name, or --max-new-tokens to score it with string_match_all"
        )
    budget, metric = RULER_FAMILIES.get(family, (max_new_tokens, "substring_all"))
    prompt, outputs = record.get("input"), record.get("outputs")
    if not isinstance(prompt, str) or not isinstance(outputs, list) or not outputs:
        raise ValueError(f"a RULER record needs a string input and a list of outputs; found fields {sorted(record)}")
    if not all(isinstance(o, (str, int, float)) and not isinstance(o, bool) for o in outputs):
        raise ValueError(f"a RULER record's outputs must be strings, got {outputs!r}")
    check_answers(metric, [str(o) for o in outputs])
    prefix = record.get("answer_prefix", "")
    if not isinstance(prefix, str):
        raise ValueError(f"answer_prefix must be a string, got {prefix!r}")
    if not prompt + prefix:
        raise ValueError("the prompt (input + answer_prefix) is empty; fix or drop the record")
    new_tokens = budget if max_new_tokens is None else max_new_tokens
    return Sample(task, 0, prompt + prefix, [str(o) for o in outputs], new_tokens, metric=metric)


def ruler_samples(
    paths: Sequence[str | Path], task: str | None = None, limit: int | None = None, max_new_tokens: int | None = None
) -> list[Sample]:
    """The records of RULER JSONL files (the first ``limit`` of each) as unplaced samples."""

    def task_of(path: Path) -> str:
        if task is not None:
            return task
        stem = _stem(path)
        return path.parent.name if stem in ("validation", "test") else stem

    return _load(paths, limit, task_of, lambda t, r: _ruler_sample(t, r, max_new_tokens))


def refuse_special_tokens(samples: Sequence[Sample], special_tokens: Sequence[str]) -> None:
    """ValueError naming the record when a prompt spells one of the tokenizer's special tokens: a file prepared
    with a chat template. Prompts are read as text (the BOS comes from the tokenizer), so the template would
    reach the model as plain characters."""
    for s in samples:
        spelled = next((t for t in special_tokens if t in s.prompt), None)
        if spelled is not None:
            raise ValueError(
                f"{s.meta['file']} record {s.meta['id']} spells the special token {spelled!r} (a chat template?); "
                "prompts are read as text and get the tokenizer's BOS, so prepare the files without a template "
                "(RULER: prepare.py --model_template_type base) or remove the token from the record"
            )


def place(
    samples: list[Sample], lengths: Sequence[int], count_tokens: Callable[[str], int], truncate: bool = False
) -> list[Sample]:
    """Give each sample the smallest of ``lengths`` that holds its prompt and answer (see the module docstring)."""
    longest = max(lengths)
    too_long = []
    for s in samples:
        if s.max_new_tokens >= longest:
            raise ValueError(f"{s.max_new_tokens} answer tokens leave no room for a prompt in length {longest}")
        s.prompt_tokens = count_tokens(s.prompt)
        need = s.prompt_tokens + s.max_new_tokens
        s.length = next((n for n in sorted(lengths) if need <= n), longest)
        if need > longest:
            too_long.append(s)
    if too_long and not truncate:
        worst = max(too_long, key=lambda s: s.prompt_tokens)
        raise ValueError(
            f"{len(too_long)} of {len(samples)} records are longer than the longest length {longest} (the longest: "
            f"{worst.meta['file']} record {worst.meta['id']}, {worst.prompt_tokens} prompt tokens + "
            f"{worst.max_new_tokens} answer tokens); add a length of at least {worst.prompt_tokens + worst.max_new_tokens} "
            "to --lengths, or pass --truncate to cut the middle out of longer prompts as InfiniteBench's scripts do "
            "(the answer may go with it)"
        )
    return samples


def run_samples(
    engine: Engine,
    tokenizer: Tokenizer,
    samples: Sequence[Sample],
    lengths: Sequence[int],
    title: str,
    show_progress: bool = True,
    forced: bool = True,
) -> dict:
    """Answer placed samples: ``answers.task_grid``'s table (records carry each sample's file and id, and its
    prompt tokens before any truncation); ``forced``: also score each record's answers teacher-forced."""
    runs = [
        (
            {"task": s.task, "length": s.length},
            {**s.meta, "full_prompt_tokens": s.prompt_tokens},
            (lambda s=s: s),
        )
        for s in samples
    ]
    scores, records = score_samples(engine, tokenizer, runs, title, show_progress, forced=forced)
    tasks = list(dict.fromkeys(s.task for s in samples))
    return task_grid(tasks, sorted(lengths), scores, records)

"""InfiniteBench's generated tasks: passkey, number string, key-value retrieval and Math.Find.

InfiniteBench (Zhang et al., ACL 2024, github.com/OpenBMB/InfiniteBench) ships these four tasks as
JSONL records {id, context, input, answer, options} of about 128K tokens. Here they are generated
from a seed at any length, in the same format, and rendered with the benchmark's prompt templates
for base (non-chat) models, the ones its scripts use for YaRN-Mistral, Yi and ChatGLM3 and that
MInference's runner uses by default; ``sample_from_record`` renders an official record the same way:

- ``passkey``: a 5-digit key in a repeated filler line ("The grass is green. ..."); the prompt ends
  with "The pass key is";
- ``number_string``: the same with a 10-digit string in which digits repeat;
- ``kv_retrieval``: a JSON object of UUID keys and values, one key asked;
- ``math_find``: a Python-style list of integers in 0..99, asked for its largest, second or third
  largest, smallest, second or third smallest (distinct values) or median number.

With a ``Haystack`` of real text (``--haystack``: held-out documents), passkey and number string take their
filler from it (``Haystack.context``: each prompt's own stretch of the documents, the needle on a line of its
own) instead of the repeated lines; key-value retrieval and Math.Find take no filler.

Passkey, number string and key-value samples place their needle at a depth drawn from the seed; every
sample's size knob (filler lines, pairs, list entries) is the largest whose prompt fits the length.
Answers are scored as InfiniteBench's compute_scores.py does (``scoring``): the first integer of
the answer (passkey, number string), the value among its words (key-value), the first number
compared numerically (Math.Find). Answer budgets are the benchmark's: 6, 12, 50 and 3 tokens.
"""

from __future__ import annotations

import functools
import json
import random
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..data.tokenizer import Tokenizer
from .answers import Prompting, score_prompted, task_grid
from .documents import Haystack
from .engine import Engine
from .scoring import check_answers
from .tasks import Sample, fit_prompt

TASKS = ("passkey", "number_string", "kv_retrieval", "math_find")
RETRIEVED = ("passkey", "number_string", "kv_retrieval")
"""Tasks whose answer is copied from the context: a record whose context lacks it cannot be answered."""
MAX_NEW_TOKENS = {"passkey": 6, "number_string": 12, "kv_retrieval": 50, "math_find": 3}
METRICS = {
    "passkey": "first_integer",
    "number_string": "first_integer",
    "kv_retrieval": "word",
    "math_find": "first_number",
}

_FIND_IT = "There is an important info hidden inside a lot of irrelevant text. Find it"
TEMPLATES = {
    "passkey": _FIND_IT + " and memorize it. I will quiz you about the important information.\n\n"
    "{context}\n\n{input}\n\nThe pass key is",
    "number_string": _FIND_IT + ". I will quiz you about the important information there.\n\n"
    "{context}\n\n{input}\n\nThe sequence of digits is",
    "kv_retrieval": "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}\n\n{input}",
    "math_find": "{prefix}\n\n{context}\n\n{input}",
}
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
_MATH_FIND = (
    "largest",
    "second largest",
    "third largest",
    "smallest",
    "second smallest",
    "third smallest",
    "median",
)
_ASKED = re.compile(r"The .+ of")


@dataclass
class Record:
    """One InfiniteBench example: the text, the question, the expected answers (and where the needle is)."""

    context: str
    input: str
    answers: list[str]
    depth: float | None = None


def render(task: str, record: Record) -> str:
    """The prompt of ``record`` in the benchmark's base-model template."""
    if task != "math_find":
        return TEMPLATES[task].format(context=record.context, input=record.input)
    asked = _ASKED.search(record.input)
    if asked is None:
        raise ValueError(f"a math_find input must name what it asks ('The ... of the list'), got {record.input!r}")
    # the official prefix keeps the space before "of" ("What is the largest number  in the ...")
    target = asked.group(0)[: -len("of")].lower()
    return TEMPLATES[task].format(
        prefix=f"What is {target} in the following list?", context=record.context, input=record.input
    )


# ---------------------------------------------------------------------------- generators (rng, knob -> record)
def _in_filler(
    needle: str, key: str, rng: random.Random, lines: int, haystack: Haystack | None, draw: int
) -> tuple[str, float]:
    """The context: ``lines`` filler lines (or haystack pieces) with the needle at a depth drawn from ``rng``."""
    depth = rng.random()
    text = needle.format(key=key)
    if haystack is not None:
        return haystack.context(lines, [(depth, text.rstrip("\n"))], draw), depth
    before = round(depth * lines)
    return FILLER * before + text + FILLER * (lines - before), depth


def _passkey(rng: random.Random, knob: int, haystack: Haystack | None = None, draw: int = 0) -> Record:
    key = "".join(str(rng.randint(0, 9)) for _ in range(5))
    needle = "The pass key is {key}. Remember it. {key} is the pass key.\n"
    context, depth = _in_filler(needle, key, rng, knob, haystack, draw)
    return Record(context, "What is the pass key?", [key], depth)


def _number_string(rng: random.Random, knob: int, haystack: Haystack | None = None, draw: int = 0) -> Record:
    digits = [str(rng.randint(0, 9)) for _ in range(5)]
    for _ in range(5):  # five digits repeated in place: 10 digits with runs
        at = rng.randint(0, len(digits) - 1)
        digits.insert(at, digits[at])
    key = "".join(digits)
    needle = "The sequence of digits is {key}. Remember it. {key} is the sequence of digits.\n"
    context, depth = _in_filler(needle, key, rng, knob, haystack, draw)
    return Record(context, "What is the sequence of digits?", [key], depth)


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _kv_retrieval(rng: random.Random, knob: int) -> Record:
    depth = rng.random()
    pairs = [(_uuid(rng), _uuid(rng)) for _ in range(knob + 1)]
    key, value = pairs[min(int(depth * len(pairs)), len(pairs) - 1)]
    question = f'\nKey: "{key}"\nThe value associated with the specified key is: '
    return Record("JSON data:\n" + json.dumps(dict(pairs)), question, [value], depth)


def _math_find(rng: random.Random, knob: int, asked: str) -> Record:
    high = asked.endswith("largest") or (asked == "median" and rng.random() < 0.5)
    low, top = (0, rng.randint(79, 99)) if high else (rng.randint(0, 19), 99)
    values = [rng.randint(low, top) for _ in range(knob + 3)]
    while len(set(values)) < 3:  # a third distinct value exists
        values.append(rng.randint(low, top))
    if asked == "median":
        ordered, mid = sorted(values), len(values) // 2
        answer = ordered[mid] if len(values) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    else:
        rank = ("second" in asked) + 2 * ("third" in asked)
        distinct = sorted(set(values), reverse=asked.endswith("largest"))
        answer = distinct[rank]
    question = f"You should answer with only one number, no other words. The {asked} number of the list is: "
    return Record(str(values), question, [f"{answer:g}"])


def _builder(task: str, seed: int, haystack: Haystack | None) -> Callable[[int], Record]:
    """knob -> record, from a fresh rng per call: the key, depth and question do not depend on the knob."""
    rng = functools.partial(random.Random, f"infinitebench-{task}-{seed}")
    if task == "math_find":
        asked = _MATH_FIND[seed % len(_MATH_FIND)]  # the seven questions in turn
        return lambda knob: _math_find(rng(), knob, asked)
    if task == "kv_retrieval":
        return lambda knob: _kv_retrieval(rng(), knob)
    build = {"passkey": _passkey, "number_string": _number_string}[task]
    return lambda knob: build(rng(), knob, haystack, seed)


def generate(
    task: str,
    length: int,
    seed: int,
    count_tokens: Callable[[str], int],
    max_new_tokens: int | None = None,
    haystack: Haystack | None = None,
) -> Sample:
    """One sample of ``task`` whose prompt has at most ``length - max_new_tokens`` tokens (see the module docstring;
    ``haystack``: real text for the filler of passkey and number string, None: the benchmark's lines)."""
    if task not in TASKS:
        raise ValueError(f"unknown InfiniteBench task {task!r}; use one of {', '.join(TASKS)}")
    new_tokens = MAX_NEW_TOKENS[task] if max_new_tokens is None else max_new_tokens
    build = _builder(task, seed, haystack)
    knob, tokens = fit_prompt(lambda k: render(task, build(k)), count_tokens, task, length, new_tokens)
    record = build(knob)
    meta = {"knob": knob, "seed": seed, "depth": record.depth}
    return Sample(task, length, render(task, record), record.answers, new_tokens, tokens, meta, METRICS[task])


def run_infinitebench(
    engine: Engine,
    tokenizer: Tokenizer,
    tasks: Sequence[str],
    lengths: Sequence[int],
    prompting: Prompting = Prompting(),
) -> dict:
    """Generated samples of ``tasks`` at each length: ``answers.task_grid``'s table (scores, intervals, teacher-forced
    readings, records). A haystack of documents in ``prompting`` fills passkey and number string."""
    haystack = prompting.haystack if prompting.haystack.name == "documents" else None
    seeds = range(prompting.seed, prompting.seed + prompting.samples)
    runs = [
        (
            {"task": t, "length": n},
            {"seed": s},
            functools.partial(generate, t, n, s, tokenizer.count, prompting.max_new_tokens, haystack),
        )
        for t in tasks
        for n in lengths
        for s in seeds
    ]
    scores, records = score_prompted(engine, tokenizer, runs, "infinitebench", prompting)
    return task_grid(tasks, lengths, scores, records) | {"haystack": prompting.haystack.name}


# ---------------------------------------------------------------------------- official records
def _answers(raw: object) -> list[str]:
    values = raw if isinstance(raw, list) else [raw]
    if not values or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in values):
        raise ValueError(f"its answer must be a string or number, or a list of them, got {raw!r}")
    return [str(v) for v in values]


def sample_from_record(task: str, raw: dict, max_new_tokens: int | None = None) -> Sample:
    """An official record {id, context, input, answer, options} as a sample (length set when placed)."""
    missing = [k for k in ("context", "input", "answer") if k not in raw]
    if missing or not isinstance(raw.get("context"), str) or not isinstance(raw.get("input"), str):
        found = sorted(raw)
        raise ValueError(f"an InfiniteBench record needs string context and input and an answer; found fields {found}")
    record = Record(raw["context"], raw["input"], _answers(raw["answer"]))
    check_answers(METRICS[task], record.answers)
    lost = [a for a in record.answers if task in RETRIEVED and a not in record.context]
    if lost:
        raise ValueError(
            f"the answer {lost[0]!r} cannot be scored with {METRICS[task]}: it is not in the context, so no model "
            "can retrieve it; fix or drop the record"
        )
    new_tokens = MAX_NEW_TOKENS[task] if max_new_tokens is None else max_new_tokens
    return Sample(task, 0, render(task, record), record.answers, new_tokens, metric=METRICS[task])

"""Seeded generators of needle-in-a-haystack and RULER-style samples, fitted to a token budget.

Every task builds a prompt from a size knob (haystack sentences, list entries, words) and a seed;
``generate`` searches the largest knob whose prompt fits ``length - max_new_tokens`` tokens, so a
sample plus its answer fits the context length under test. The same (task, length, seed, depth)
and the same tokenizer always give the same sample, and every sample carries the answers that
``scoring`` checks the model's output against:

- ``niah_single``: one "secret number" needle; ``niah_multikey``: the queried needle among
  distractors with other keys; ``niah_multivalue``: one key with several numbers, all asked;
  ``niah_multiquery``: several keys, all asked;
- ``vt`` (variable tracking): a chain of ``VAR X = VAR Y`` assignments from one value (and a
  distractor chain); name every variable holding the value;
- ``cwe`` (common words): a numbered word list; name the words that occur most often;
- ``fwe`` (frequent words): Zipf-distributed words; name the three most frequent.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .documents import Haystack

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
MAX_NEW_TOKENS = {
    "niah_single": 24,
    "niah_multikey": 24,
    "niah_multivalue": 64,
    "niah_multiquery": 64,
    "vt": 48,
    "cwe": 96,
    "fwe": 48,
}

_ADJECTIVES = (
    "amber",
    "brave",
    "calm",
    "dusty",
    "eager",
    "fading",
    "gentle",
    "hollow",
    "icy",
    "jolly",
    "kind",
    "lofty",
    "misty",
    "noble",
    "olive",
    "proud",
    "quick",
    "rusty",
    "silver",
    "tidy",
    "upper",
    "vivid",
    "wild",
    "young",
    "zesty",
    "bold",
    "crisp",
    "dim",
    "frosty",
    "golden",
)
_NOUNS = (
    "heron",
    "anchor",
    "badger",
    "candle",
    "dolphin",
    "ember",
    "falcon",
    "garden",
    "harbor",
    "island",
    "jacket",
    "kettle",
    "lantern",
    "meadow",
    "needle",
    "orchard",
    "pebble",
    "quarry",
    "river",
    "saddle",
    "thistle",
    "umbrella",
    "valley",
    "walnut",
    "willow",
    "beacon",
    "cliff",
    "fern",
    "glacier",
    "hammer",
)
KEY_WORDS = _ADJECTIVES + _NOUNS  # every word a needle key is made of
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


@dataclass
class Sample:
    """One prompt with its expected answers, scored by ``metric`` (a name in ``scoring.METRICS``).

    ``meta`` says how it was built. A prompt longer than ``length - max_new_tokens`` tokens (only
    official files run with truncation allowed) is cut in the middle when answered (``answers``).
    ``ids`` and ``reference_ids``: the prompt's and its reference answer's token ids under the tokenizer that
    answers it (``answers.tokenised``), read instead of tokenising the prompt again; None: tokenised when answered.
    """

    task: str
    length: int
    prompt: str
    answers: list[str]
    max_new_tokens: int
    prompt_tokens: int = 0
    meta: dict = field(default_factory=dict)
    metric: str = "match_all"
    ids: Sequence[int] | None = field(default=None, repr=False)
    reference_ids: Sequence[int] | None = field(default=None, repr=False)


@dataclass
class _Parts:
    context: str
    question: str
    answer_prefix: str
    answers: list[str]
    intro: str = "Some facts are hidden in the text below. Read it, then answer the question after it."


def _render(parts: _Parts) -> str:
    return f"{parts.intro}\n\n{parts.context}\n\nQuestion: {parts.question}\nAnswer: {parts.answer_prefix}"


# ---------------------------------------------------------------------------- random pieces
def needle_keys(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct needle keys, each an adjective-noun pair (e.g. 'amber-falcon')."""
    pairs = rng.sample([(a, b) for a in _ADJECTIVES for b in _NOUNS], n)
    return [f"{a}-{b}" for a, b in pairs]


def needle_numbers(rng: random.Random, n: int, digits: int = 7) -> list[str]:
    """``n`` distinct needle values of ``digits`` digits."""
    return [str(v) for v in rng.sample(range(10 ** (digits - 1), 10**digits), n)]


def pseudo_words(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct pronounceable three-syllable words (e.g. 'bamiko')."""
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    words: dict[str, None] = {}
    while len(words) < n:
        words["".join(rng.choice(syllables) for _ in range(3))] = None
    return list(words)


def _variables(rng: random.Random, n: int) -> list[str]:
    names: dict[str, None] = {}
    while len(names) < n:
        names["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))] = None
    return list(names)


def _needle(key: str, value: str) -> str:
    return f"The secret number of {key} is {value}."


# ---------------------------------------------------------------------------- builders (knob -> parts)
def _build_niah(task: str, seed: int, knob: int, haystack: Haystack, depth: float | None) -> _Parts:
    rng = random.Random(f"{task}-{seed}")
    n_keys = {"niah_single": 1, "niah_multikey": 4, "niah_multivalue": 1, "niah_multiquery": 4}[task]
    n_values = 4 if task == "niah_multivalue" else 1
    keys = needle_keys(rng, n_keys)
    values = needle_numbers(rng, n_keys * n_values)
    needles = [_needle(keys[i // n_values], v) for i, v in enumerate(values)]
    fracs = [rng.random() for _ in needles]
    if depth is not None:
        fracs[0] = depth
    context = haystack.context(knob, list(zip(fracs, needles)), draw=seed)
    if task in ("niah_single", "niah_multikey"):
        return _Parts(
            context, f"What is the secret number of {keys[0]}?", f"The secret number of {keys[0]} is", values[:1]
        )
    if task == "niah_multivalue":
        return _Parts(
            context, f"What are all the secret numbers of {keys[0]}?", f"The secret numbers of {keys[0]} are", values
        )
    listed = ", ".join(keys[:-1]) + f" and {keys[-1]}"
    return _Parts(context, f"What are the secret numbers of {listed}?", f"The secret numbers of {listed} are", values)


def _build_vt(seed: int, knob: int, haystack: Haystack) -> _Parts:
    rng = random.Random(f"vt-{seed}")
    hops = 4
    names = _variables(rng, 2 * (hops + 1))
    value, other = needle_numbers(rng, 2, digits=5)
    items: list[tuple[float, str]] = []
    for chain, start in ((names[: hops + 1], value), (names[hops + 1 :], other)):
        fracs = sorted(rng.random() for _ in chain)
        items.append((fracs[0], f"VAR {chain[0]} = {start}."))
        items.extend((f, f"VAR {b} = VAR {a}.") for f, a, b in zip(fracs[1:], chain, chain[1:]))
    return _Parts(
        haystack.context(knob, items, draw=seed),
        f"Which variables are assigned the value {value}, directly or through other variables?",
        f"The variables assigned the value {value} are",
        names[: hops + 1],
        intro="Memorise every variable assignment in the text below, then answer the question after it.",
    )


def _cwe_params(length: int) -> tuple[int, int, int]:
    """(number of common words, their count, count of each other word) for a context length."""
    return (10, 30, 3) if length >= 8192 else (5, 4, 1)


def _build_cwe(seed: int, knob: int, length: int) -> _Parts:
    n_common, f_common, f_rare = _cwe_params(length)
    words = pseudo_words(random.Random(f"cwe-words-{seed}"), n_common + knob)
    entries = words[:n_common] * f_common + words[n_common:] * f_rare
    random.Random(f"cwe-order-{seed}-{knob}").shuffle(entries)
    listing = "\n".join(f"{i}. {w}" for i, w in enumerate(entries, 1))
    return _Parts(
        listing,
        f"What are the {n_common} most common words in the list above?",
        f"The {n_common} most common words in the list are:",
        words[:n_common],
        intro="Below is a numbered list of words. Some words occur many times. Find the most common ones.",
    )


def _zipf_stream(seed: int, n: int, vocab: list[str], alpha: float = 2.0) -> list[str]:
    rng = random.Random(f"fwe-stream-{seed}")
    weights = [1.0 / (r + 1) ** alpha for r in range(len(vocab))]
    return rng.choices(vocab, weights=weights, k=n)


def top_words(words: list[str], n: int) -> list[str]:
    """The ``n`` most frequent words, ties broken by first occurrence."""
    counts = Counter(words)
    return sorted(counts, key=lambda w: (-counts[w], words.index(w)))[:n]


def _build_fwe(seed: int, knob: int) -> _Parts:
    vocab = pseudo_words(random.Random(f"fwe-vocab-{seed}"), 200)
    words = _zipf_stream(seed, max(knob, 3), vocab)
    counts = Counter(words)
    ranked = top_words(words, 4)
    if len(ranked) == 4 and counts[ranked[2]] == counts[ranked[3]]:
        words.insert(len(words) // 2, ranked[2])  # break the tie at the boundary of the answer
    lines = [" ".join(words[i : i + 16]) for i in range(0, len(words), 16)]
    return _Parts(
        "\n".join(lines),
        "What are the 3 most frequent words in the text above?",
        "The 3 most frequent words are:",
        top_words(words, 3),
        intro="Below is a text of made-up words. Some words occur far more often than others.",
    )


def _builder(task: str, seed: int, length: int, haystack: Haystack, depth: float | None) -> Callable[[int], _Parts]:
    if task.startswith("niah_"):
        return lambda knob: _build_niah(task, seed, knob, haystack, depth)
    if task == "vt":
        return lambda knob: _build_vt(seed, knob, haystack)
    if task == "cwe":
        return lambda knob: _build_cwe(seed, knob, length)
    return lambda knob: _build_fwe(seed, knob)


def sized_prompt(
    task: str, seed: int, knob: int, haystack: Haystack | None = None, length: int = 0
) -> tuple[str, list[str]]:
    """``task``'s prompt at size ``knob`` and its answers, unfitted: what ``generate`` renders at the knob it fits.

    ``length`` sizes the cwe list only. Corpora in the evaluation's formats are made with it.
    """
    parts = _builder(task, seed, length, haystack or Haystack(seed=seed), None)(knob)
    return _render(parts), parts.answers


# ---------------------------------------------------------------------------- fitting
def fit_knob(
    tokens_at: Callable[[int], int], budget: int, first_step: int = 16, max_evals: int = 40
) -> tuple[int, int]:
    """Largest knob >= 0 with ``tokens_at(knob) <= budget`` (interpolation search); (knob, tokens).

    Assumes token counts grow roughly linearly with the knob; raises ValueError if knob 0 does not fit. Each
    ``tokens_at`` tokenises a whole prompt (a third of a second at 64K tokens on a loaded CPU), so the search
    trusts the interpolation while it lands next to the bracket's end it last moved, the usual case once the
    bracket is a few knobs wide, and bisects only when it keeps landing at the same end.
    """
    lo, t_lo = 0, tokens_at(0)
    if t_lo > budget:
        raise ValueError(f"needs at least {t_lo} tokens")
    hi, t_hi = None, None
    probe, t_probe = first_step, tokens_at(first_step)
    stalled = 0  # interpolated probes in a row at one end of the bracket
    for _ in range(max_evals):
        if t_probe <= budget:
            lo, t_lo = probe, t_probe
        else:
            hi, t_hi = probe, t_probe
        if hi is not None and hi - lo <= 1:
            break
        if hi is None:
            slope = max((t_lo - tokens_at(0)) / max(lo, 1), 1e-3) if lo else 1.0
            probe = lo + max(1, int((budget - t_lo) / slope * 1.02) + 1)
        else:
            guess = lo + int((budget - t_lo) * (hi - lo) / max(t_hi - t_lo, 1))
            probe = min(max(guess, lo + 1), hi - 1)
            stalled = stalled + 1 if probe in (lo + 1, hi - 1) else 0
            if stalled > 2 and hi - lo > 8:
                probe, stalled = (lo + hi) // 2, 0  # interpolation creeps at one end: bisect
        t_probe = tokens_at(probe)
    return lo, t_lo


def fit_prompt(
    prompt_at: Callable[[int], str], count_tokens: Callable[[str], int], task: str, length: int, new_tokens: int
) -> tuple[int, int]:
    """(knob, tokens) of the largest ``prompt_at(knob)`` that leaves ``new_tokens`` of ``length`` for the answer."""
    cache: dict[int, int] = {}

    def tokens_at(knob: int) -> int:
        if knob not in cache:
            cache[knob] = count_tokens(prompt_at(knob))
        return cache[knob]

    try:
        return fit_knob(tokens_at, length - new_tokens)
    except ValueError as e:
        raise ValueError(
            f"task {task} does not fit length {length} ({e}, plus {new_tokens} answer tokens); use a longer length"
        ) from None


def generate(
    task: str,
    length: int,
    seed: int,
    count_tokens: Callable[[str], int],
    haystack: Haystack | None = None,
    depth: float | None = None,
    max_new_tokens: int | None = None,
) -> Sample:
    """One sample of ``task`` whose prompt has at most ``length - max_new_tokens`` tokens.

    ``depth`` (0..1) places the first needle (NIAH tasks only); ``count_tokens`` is the tokenizer's
    length of a prompt (special tokens included).
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; use one of {', '.join(TASKS)}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be a fraction in [0, 1], got {depth}")
    new_tokens = MAX_NEW_TOKENS[task] if max_new_tokens is None else max_new_tokens
    build = _builder(task, seed, length, haystack or Haystack(seed=seed), depth)
    knob, tokens = fit_prompt(lambda knob: _render(build(knob)), count_tokens, task, length, new_tokens)
    parts = build(knob)
    return Sample(
        task, length, _render(parts), parts.answers, new_tokens, tokens, {"knob": knob, "seed": seed, "depth": depth}
    )

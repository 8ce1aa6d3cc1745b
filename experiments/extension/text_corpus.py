"""The text corpus of the GPU scale of pipeline.py: documents in the formats that ``mtraining eval
niah`` and ``ruler`` ask about, and a BPE tokenizer trained on them.

The mixture (each document a pure function of its kind and seed; training seeds never reach the
evaluation's prompt seeds, which start at 0):

- ``niah``: a haystack of the built-in filler with "The secret number of KEY is N." needles, then
  the question and its answer, exactly as ``mtraining eval niah/ruler`` render them (single,
  multi-key, multi-value and multi-query variants);
- ``vt``: variable-tracking chains in the RULER format, with their answer;
- ``recall``: filler in which facts are stated at random points and asked again later, with the
  answer: associative recall in the needles' own sentence, at every distance;
- ``facts`` (not in the default mixture; a curriculum stage may ask for it): the same at a rate that
  makes most sentences a fact or a question, for a dense retrieval signal; ``facts_word``: the same
  with single-word keys, an easier lookup than the eval's three-token ones; ``copy``: a span of random
  words and numbers repeated (induction without grammar to lean on); ``tokens`` (a stage of its own): random token
  ids repeated, the quickest route to induction.

``cwe``/``fwe`` (word counting) are not in the mixture: the RULER average reports them as they come.
The tokenizer is a byte-level BPE trained on a sample of the mixture, with digits split one per
token, so a needle costs about ten tokens and a number is copied digit by digit.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import os
import random
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from bench.common import written
from mtraining.eval.documents import filler_sentences
from mtraining.eval.tasks import KEY_WORDS, needle_keys, needle_numbers, sized_prompt

if TYPE_CHECKING:
    from mtraining.data import TextTokenizer

    from ..common.background import Pool

KINDS = ("niah", "niah", "niah", "vt", "recall", "recall", "recall", "recall")
_NIAH = ("niah_single", "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery")
EOS = "<|endoftext|>"
_SEED_BASE = 1_000_000  # document seeds of training sets start here (eval prompts use 0, 1, ...)


def _listing(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + f" and {items[-1]}"


def recall_log(seed: int, sentences: int, rate: float = 0.05, word_keys: bool = False) -> str:
    """Filler with facts stated at random points and asked again later, answered (any distance back).
    ``word_keys``: keys are single words (one token each) instead of the eval's adjective-noun pairs."""
    rng = random.Random(f"recall-{seed}")
    keys = rng.sample(KEY_WORDS, len(KEY_WORDS)) if word_keys else needle_keys(rng, 300)
    values = needle_numbers(rng, 300)
    stated: list[int] = []
    out = []
    for sentence in filler_sentences(sentences, seed):
        out.append(sentence)
        r = rng.random()
        if r < rate and len(stated) < len(keys):
            i = len(stated)
            stated.append(i)
            out.append(f"The secret number of {keys[i]} is {values[i]}.")
        elif r < 2 * rate and stated:
            i = rng.choice(stated)
            out.append(
                f"Question: What is the secret number of {keys[i]}? Answer: The secret number of {keys[i]} is {values[i]}."
            )
    return " ".join(out)


def repeat_document(seed: int, sentences: int) -> str:
    """A few random filler sentences and needles, repeated in the same order up to ``sentences``: every
    token after the first period is predicted by copying what followed its previous occurrence (the
    induction circuit retrieval needs, from a dense signal: the curriculum's first stage)."""
    rng = random.Random(f"repeat-{seed}")
    period = filler_sentences(rng.randint(2, 6), seed)
    period += [f"The secret number of {k} is {v}." for k, v in zip(needle_keys(rng, 2), needle_numbers(rng, 2))]
    rng.shuffle(period)
    return " ".join((period * (sentences // len(period) + 1))[:sentences])


def copy_document(seed: int, sentences: int) -> str:
    """Random words and numbers (no grammar to predict them by), a span of them repeated: after its first
    occurrence every token is predicted only by copying (a denser induction signal than ``repeat_document``)."""
    rng = random.Random(f"copy-{seed}")
    pool = sorted({w.strip(".,").lower() for s in filler_sentences(200, seed % 7) for w in s.split()})
    pool += list(KEY_WORDS)
    span = [rng.choice(pool) if rng.random() < 0.8 else needle_numbers(rng, 1)[0] for _ in range(rng.randint(4, 24))]
    words = sentences * 8
    return " ".join((span * (words // len(span) + 1))[:words])


def token_span_document(seed: int, length: int, vocab_size: int) -> list[int]:
    """Token ids (not text): a span of 8-24 random ids (any but EOS, id 0) repeated to ``length`` tokens. Copying is
    the only way to predict them and a single token finds the span's next one: the quickest route to the induction
    circuit (the CPU scale's first stage, in this tokenizer's ids); the ``copy`` kind's words and numbers follow."""
    rng = random.Random(f"tokens-{seed}")
    span = [rng.randrange(1, vocab_size) for _ in range(rng.randint(8, 24))]
    return (span * (length // len(span) + 1))[:length]


def make_document(kind: str, seed: int, max_sentences: int, min_sentences: int = 8) -> str:
    """One document of ``kind`` (see KINDS) with ``min_sentences`` to ``max_sentences`` filler sentences."""
    rng = random.Random(f"text-{kind}-{seed}")
    knob = int(math.exp(rng.uniform(math.log(min(min_sentences, max_sentences)), math.log(max_sentences))))
    if kind == "niah":
        prompt, answers = sized_prompt(rng.choice(_NIAH), seed, knob)
        return prompt + " " + _listing(answers) + "."
    if kind == "vt":
        prompt, answers = sized_prompt("vt", seed, knob)
        return prompt + " " + _listing(answers) + "."
    if kind in ("facts", "facts_word"):
        return recall_log(seed, knob, rate=0.3, word_keys=kind == "facts_word")
    if kind == "copy":
        return copy_document(seed, max_sentences)
    if kind == "recall":
        return recall_log(seed, knob, rate=rng.choice((0.05, 0.1, 0.2)))
    if kind == "tokens":
        raise ValueError("tokens documents are token ids, not text: give them a stage of their own, kinds=('tokens',)")
    raise ValueError(f"unknown document kind {kind!r}; use one of niah, vt, recall, facts, facts_word, copy")


def documents(
    first_seed: int, count: int, max_sentences: int, kinds: tuple[str, ...] = KINDS, min_sentences: int = 8
) -> list[str]:
    """``count`` documents from ``first_seed`` on, each of a kind drawn uniformly from ``kinds``."""
    return [
        make_document(document_kind(first_seed + i, kinds), first_seed + i, max_sentences, min_sentences)
        for i in range(count)
    ]


def document_kind(seed: int, kinds: tuple[str, ...] = KINDS) -> str:
    """The kind of document ``seed`` of a mixture of ``kinds`` (drawn uniformly, a pure function of the seed)."""
    return kinds[random.Random(f"text-kind-{seed}").randrange(len(kinds))]


def write_tokenizer(path: Path, vocab_size: int, seed: int = 0) -> Path:
    """A byte-level BPE with single-digit tokens, trained on a sample of the mixture."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(documents(_SEED_BASE // 2 + 1000 * seed, 400, 120), trainer=trainer)
    with written(path) as tmp:
        tok.save(str(tmp))
    return path


def train_stream(
    path: Path,
    tokenizer: Path,
    tokens: int,
    seq_len: int,
    seed: int,
    stage: int,
    repeat: bool = False,
    kinds: tuple[str, ...] = KINDS,
    min_fill: float = 0.0,
    pool: Pool | None = None,
) -> dict:
    """At least ``tokens`` tokens of training documents (EOS-separated) sized for ``seq_len``, as .npy: the
    mixture of ``kinds``, or repeated sentences (``repeat_document``) when ``repeat``; mixture documents are
    drawn from ``min_fill`` of a sample (at least 8 sentences) to about one sample, log-uniform.

    No document crosses a sample boundary (the trainer's sample i is tokens [i N, (i + 1) N + 1)): a stage
    of induction kinds only (``WHOLE_KINDS``) writes documents of exactly ``seq_len`` tokens, EOS last, so
    that sample i is document i whole (packed across windows, a 105M model's token-copy loss was still 3.9
    after 1000 steps in a plain loop, where one span per row copies from step ~750:
    bench/results/induction_paths.json); other stages pack whole documents into samples (``_whole_samples``),
    since a window that cuts a document between a needle and its question teaches answers without evidence,
    the more often the farther apart they are.

    Documents are generated and tokenised in chunks of ``_CHUNK`` seeds on every CPU core (on ``pool``'s
    workers when given: background.Pool), a small file in this process; the file is the same whatever
    the number of cores (chunks are kept in seed order up to the first that reaches ``tokens``). It is written
    whole, then renamed."""
    first = stage_seed(stage, seed)
    # a chunk holds roughly _CHUNK x seq_len / 2 tokens; a pool pays only for several chunks per core
    workers = min(
        pool.workers if pool is not None else os.cpu_count() or 1, math.ceil(tokens / (_CHUNK * seq_len / 2)) // 4
    )
    parts: list[np.ndarray] = []
    total, start = 0, first
    with contextlib.ExitStack() as stack:
        if pool is None and workers > 1:
            pool = stack.enter_context(ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")))
        while total < tokens:
            jobs = [
                (str(tokenizer), start + i * _CHUNK, seq_len, repeat, kinds, min_fill) for i in range(max(workers, 1))
            ]
            start += len(jobs) * _CHUNK
            for chunk in pool.map(_chunk, jobs) if workers > 1 else map(_chunk, jobs):
                if total < tokens:
                    parts.append(chunk)
                    total += chunk.size
    stream = np.concatenate(parts)
    with written(path) as tmp, open(tmp, "wb") as f:
        np.save(f, stream)
    kind = "repeat" if repeat else "mixture of " + ", ".join(sorted(set(kinds)))
    documents = len(parts) * _CHUNK
    return {"path": str(path), "tokens": int(stream.size), "seq_len": seq_len, "documents": documents, "kind": kind}


_CHUNK = 256  # documents per task of the corpus' process pool
WHOLE_KINDS = ("tokens", "copy")  # induction stages: one document of seq_len tokens per sample


def _chunk(job: tuple[str, int, int, bool, tuple[str, ...], float]) -> np.ndarray:
    """``_CHUNK`` documents from seed ``first`` on, tokenised, each followed by EOS (one pool task)."""
    tokenizer, first, seq_len, repeat, kinds, min_fill = job
    from mtraining.data import TextTokenizer

    tok = TextTokenizer(tokenizer)
    eos = tok.separator_id(None)
    seeds = range(first, first + _CHUNK)
    if kinds == ("tokens",):
        docs = [token_span_document(s, seq_len - 1, tok.vocab_size) for s in seeds]
    elif not repeat and set(kinds) <= set(WHOLE_KINDS):
        # copy documents of at least seq_len words (a word is a token or more), cut to seq_len - 1 tokens
        docs = [ids[: seq_len - 1] for ids in tok.encode(documents(first, _CHUNK, seq_len // 8 + 1, kinds))]
        assert all(len(ids) == seq_len - 1 for ids in docs)
    else:
        render, max_sentences = packed_render(seq_len, repeat, kinds, min_fill)
        docs = [_fitting(tok, render, s, max_sentences, seq_len - 1) for s in seeds]
        return _whole_samples(docs, seq_len, eos, lambda n, i: _filler(tok, -(first + i), n))
    return np.concatenate([np.asarray(ids + [eos], dtype=np.uint16) for ids in docs])


def stage_seed(stage: int, seed: int) -> int:
    """The first document seed of training run ``stage`` (curriculum stage i, then the extension) of corpus ``seed``."""
    return _SEED_BASE + 10_000_000 * stage + 100_000 * seed


def packed_render(
    seq_len: int, repeat: bool, kinds: tuple[str, ...], min_fill: float
) -> tuple[Callable[[int, int], str], int]:
    """(render, most) for a stage whose documents are packed whole into samples of ``seq_len``: ``render(seed, m)``
    is document ``seed`` with at most ``m`` filler sentences, ``most`` the sentences it is first tried with."""
    most = max(16, seq_len // 10)  # ~12 tokens per filler sentence: documents up to about one sample
    min_sentences = max(8, round(min_fill * most))

    def render(seed: int, m: int) -> str:
        if repeat:
            return repeat_document(seed, m)
        return make_document(document_kind(seed, kinds), seed, m, min(min_sentences, m))

    return render, most


def _fitting(tok: TextTokenizer, render: Callable[[int, int], str], seed: int, most: int, limit: int) -> list[int]:
    """Token ids of document ``seed`` rendered with at most ``most`` sentences, fewer until at most ``limit``."""
    while True:
        ids = tok.encode([render(seed, most)])[0]
        if len(ids) <= limit:
            return ids
        if most == 1:
            raise ValueError(
                f"document {seed} takes {len(ids)} tokens with one filler sentence, over a sample's {limit}: "
                "give this stage a longer seq_len or other kinds"
            )
        most = max(1, min(most - 1, most * limit // len(ids)))


def _filler(tok: TextTokenizer, seed: int, length: int) -> list[int]:
    """``length`` tokens of filler text (no retrieval in it) ending with ``tok``'s EOS: a sample's unused end."""
    text = " ".join(filler_sentences(length // 4 + 1, seed))  # a sentence is ~12 tokens: more than enough
    return tok.encode([text])[0][: length - 1] + [tok.separator_id(None)]


def _whole_samples(
    docs: list[list[int]], seq_len: int, eos: int, filler: Callable[[int, int], list[int]]
) -> np.ndarray:
    """The documents (each at most ``seq_len - 1`` tokens), EOS after each, packed first-fit into samples of
    ``seq_len`` tokens so that none crosses a sample boundary; ``filler(n, i)`` ends sample ``i`` with its
    ``n`` unused tokens. Samples keep the order in which they were opened."""
    samples: list[list[int]] = []
    for ids in docs:
        need = len(ids) + 1
        home = next((s for s in samples if seq_len - len(s) >= need), None)
        if home is None:
            home = []
            samples.append(home)
        home.extend(ids + [eos])
    for i, s in enumerate(samples):
        if len(s) < seq_len:
            s.extend(filler(seq_len - len(s), i))
    return np.asarray([t for s in samples for t in s], dtype=np.uint16)


def heldout(path: Path, tokenizer: Path, min_tokens: int, count: int, seed: int) -> dict:
    """JSONL of ``count`` held-out recall logs of at least ``min_tokens`` tokens (perplexity by position)."""
    from mtraining.data import TextTokenizer

    tok = TextTokenizer(tokenizer)
    docs, s, sentences = [], 0, min_tokens // 10
    while len(docs) < count:
        doc = recall_log(9 * _SEED_BASE + 10_000 * seed + s, sentences)
        s += 1
        if len(tok.encode([doc])[0]) > min_tokens:
            docs.append(doc)
        else:
            sentences = int(sentences * 1.2) + 1
    with written(path) as tmp:
        tmp.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return {"path": str(path), "documents": len(docs), "min_tokens": min_tokens}

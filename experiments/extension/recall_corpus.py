"""The generated corpus of the context-extension experiment (pipeline.py): a word-level
vocabulary, key-value retrieval documents with a bursty filler, and the files each stage reads.

Every document is a pure function of (seed, length, shape): it starts with ``</s>`` (the separator,
which also serves as the attention sink), then a *context* of filler with ``pairs`` needles, then
``queries`` question triples at the end:

    </s> w12 w7 w93 ... k41 v180 ... w7 w93 ... k3 v17 ... | Q k3 v17 Q k41 v180 ...

- needles ``k v``: a key token and a value token (disjoint sub-vocabularies, keys distinct within a
  document); a query ``Q k`` asks for the value stored with ``k``: the model must find ``k`` in the
  context and copy the token after it (associative recall, as in the Zoology MQAR task);
- filler: phrases of 2-6 filler words; each document draws its own phrases and repeats them with a
  Zipf law, so some phrases recur at every distance and a model that looks further back predicts
  more of the filler (perplexity falls with position, the signal of perplexity by position bucket).

Training documents place needles uniformly and ask every needle; evaluation documents place the
queried needles at fixed depths (fractions of the context) and the rest uniformly, so one task is
scored at every length, as a depth x length grid, and the same documents give perplexity by
position. The curriculum's first stage reads ``repeat_document``s instead (a random segment
repeated: induction first). Seeds of the training and evaluation sets are disjoint (string seeds
with the set's name first). One word is one token (``write_tokenizer``), so lengths are exact.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

EOS, UNK, QUERY = "</s>", "<unk>", "Q"


@dataclass(frozen=True)
class Vocab:
    """Sizes of the sub-vocabularies; ids are laid out as specials, keys, values, filler words."""

    keys: int = 256
    values: int = 256
    words: int = 256

    @property
    def specials(self) -> list[str]:
        return [EOS, UNK, QUERY]

    @property
    def size(self) -> int:
        return len(self.specials) + self.keys + self.values + self.words

    def tokens(self) -> list[str]:
        """Every token in id order."""
        return (
            self.specials
            + [f"k{i}" for i in range(self.keys)]
            + [f"v{i}" for i in range(self.values)]
            + [f"w{i}" for i in range(self.words)]
        )

    def key(self, i: int) -> int:
        return len(self.specials) + i

    def value(self, i: int) -> int:
        return len(self.specials) + self.keys + i

    def word(self, i: int) -> int:
        return len(self.specials) + self.keys + self.values + i

    @property
    def eos_id(self) -> int:
        return 0

    @property
    def query_id(self) -> int:
        return 2


def write_tokenizer(vocab: Vocab, path: Path) -> Path:
    """A word-level tokenizer.json (whitespace split, one token per word) for ``vocab``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    tok = Tokenizer(WordLevel({t: i for i, t in enumerate(vocab.tokens())}, unk_token=UNK))
    tok.pre_tokenizer = WhitespaceSplit()
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


@dataclass(frozen=True)
class Document:
    """Token ids of one document and where its retrieval questions are.

    Attributes:
        ids: the tokens, ``</s>`` first.
        answers: position of each queried value token (predicted from the position before it).
        depths: depth of each queried needle in the context (0: first token after ``</s>``, 1: last
            needle slot before the queries), in the order of ``answers``.
    """

    ids: list[int]
    answers: list[int]
    depths: list[float]


def _phrases(rng: random.Random, vocab: Vocab, count: int) -> list[list[int]]:
    return [[vocab.word(rng.randrange(vocab.words)) for _ in range(rng.randint(2, 6))] for _ in range(count)]


def _filler(rng: random.Random, vocab: Vocab, length: int) -> list[int]:
    """``length`` filler tokens: the document's own phrases, drawn with a Zipf law (rank r: weight 1/r)."""
    phrases = _phrases(rng, vocab, max(8, length // 12))
    weights = [1.0 / (r + 1) for r in range(len(phrases))]
    out: list[int] = []
    while len(out) < length:
        out.extend(rng.choices(phrases, weights)[0])
    return out[:length]


def make_document(
    seed: str, length: int, vocab: Vocab, pairs: int, queries: int, depths: Sequence[float] | None = None
) -> Document:
    """One document of exactly ``length`` tokens (see the module docstring).

    ``depths``: fractions in [0, 1] of the context where the first ``len(depths)`` needles go (they
    are the ones queried; ``queries`` is then ``len(depths)``); None: needles uniform, the first
    ``queries`` of them (in random order) queried.
    """
    rng = random.Random(seed)
    if depths is not None:
        queries = len(depths)
    if not 1 <= queries <= pairs <= min(vocab.keys, vocab.values):
        raise ValueError(f"need 1 <= queries ({queries}) <= pairs ({pairs}) <= keys and values of the vocabulary")
    context = length - 1 - 3 * queries
    if context < 2 * pairs + 1:
        raise ValueError(f"length {length} is too short for {pairs} needles and {queries} queries")
    keys = rng.sample(range(vocab.keys), pairs)
    values = rng.sample(range(vocab.values), pairs)
    # needle slots: starts of 2-token needles among context - 2 * pairs filler tokens, in filler order
    gaps = context - 2 * pairs
    if depths is None:
        slots = [rng.randint(0, gaps) for _ in range(pairs)]
    else:
        slots = [round(d * gaps) for d in depths] + [rng.randint(0, gaps) for _ in range(pairs - len(depths))]
    order = sorted(range(pairs), key=lambda i: (slots[i], i))
    filler = _filler(rng, vocab, gaps)
    ids, start, needle_at = [vocab.eos_id], 0, {}
    for i in order:
        ids += filler[start : slots[i]]
        start = slots[i]
        needle_at[i] = len(ids)
        ids += [vocab.key(keys[i]), vocab.value(values[i])]
    ids += filler[start:]
    asked = list(range(queries))
    rng.shuffle(asked)
    answers = []
    for i in asked:
        ids += [vocab.query_id, vocab.key(keys[i])]
        answers.append(len(ids))
        ids.append(vocab.value(values[i]))
    assert len(ids) == length
    return Document(ids, answers, [(needle_at[i] - 1) / max(1, context - 2) for i in asked])


def repeat_document(seed: str, length: int, vocab: Vocab, shortest: int = 8, longest: int = 24) -> list[int]:
    """``</s>`` and one random segment (any keys, values and words) repeated to ``length`` tokens.

    Every token after the first period is predicted by finding the previous occurrence of the
    current token and copying the one after it: the induction circuit that associative recall
    needs, learned here from a dense signal (the curriculum's first stage).
    """
    rng = random.Random(seed)
    first = vocab.key(0)
    segment = [rng.randrange(first, vocab.size) for _ in range(rng.randint(shortest, longest))]
    return [vocab.eos_id] + (segment * (length // len(segment) + 1))[: length - 1]


@dataclass(frozen=True)
class Shape:
    """How many needles and queries a document of a given length holds."""

    pairs: int
    queries: int


def train_stream(
    path: Path, vocab: Vocab, seq_len: int, samples: int, shape: Shape | None, seed: int, stage: int = 0
) -> dict:
    """``samples + 1`` training documents of ``seq_len`` tokens, back to back in one .npy token file:
    recall documents of ``shape``, or repeated segments (``repeat_document``) when ``shape`` is None.

    The trainer cuts sample i as tokens [i N, (i + 1) N + 1) with N = seq_len; each document is N
    tokens, so sample i is document i plus the ``</s>`` that starts document i + 1 (its last label).
    """
    seeds = [f"train-{seed}-{stage}-{i}" for i in range(samples + 1)]
    if shape is None:
        docs = [repeat_document(s, seq_len, vocab) for s in seeds]
    else:
        docs = [make_document(s, seq_len, vocab, shape.pairs, shape.queries).ids for s in seeds]
    stream = np.asarray([t for d in docs for t in d], dtype=np.uint16)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, stream)
    kind = {"kind": "repeat"} if shape is None else {"kind": "recall", **asdict(shape)}
    return {"path": str(path), "documents": samples + 1, "tokens": int(stream.size), "seq_len": seq_len, **kind}


def eval_set(
    vocab: Vocab, length: int, samples: int, shape: Shape, depths: Sequence[float], seed: int
) -> list[Document]:
    """``samples`` evaluation documents of ``length`` tokens, queried needles at ``depths``."""
    return [make_document(f"eval-{seed}-{length}-{i}", length, vocab, shape.pairs, 0, depths) for i in range(samples)]

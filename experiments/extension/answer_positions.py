"""Where the retrieval answers of pipeline.py's text corpus lie in their documents, and how much of
its packed samples is filler.

Under document masking the sparse pattern of each packed document is estimated from its last ``last_q``
query rows (mtraining.ops.estimate.estimator.scoring_rows). NIAH and variable-tracking documents ask their
question at their end; recall logs ask throughout. This measures it: the documents of a scale's packed
training runs (the extension and every curriculum stage that packs mixture documents) are generated and
tokenised as the corpus does (text_corpus: the stage's seeds, sentence range, fitting and packing),
every retrieval answer is located in token space (niah/vt: the listing appended after the question;
recall logs: each value V of "Answer: The secret number of K is V."), with its evidence (the value's
first statement: needle, fact or variable assignment). Per kind and for the mixture (kinds weighted as
the mixture draws them): the share of answer tokens inside their document's estimation rows, the
distances answer -> document end and answer -> evidence, document lengths; per stage the share of
filler tokens in the packed samples.

A document's positions are its tokens and the EOS after it (the masking's document: it ends after the
separator); an answer token at position p of a document of n positions is in the estimation rows iff
n - 1 - p < last_q (its distance to the end). Distances are from an answer's first token.

    python -m experiments.extension.answer_positions --scale gpu --docs 200      # bench/results/extension_gpu_answers.json
    python -m experiments.extension.answer_positions --scale gpu --kinds niah,vt --out /tmp/a.json

The scale's tokenizer is trained once into ``--work`` (default runs/answer_positions) and reused.
"""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from bench.common import RESULTS_DIR, provenance

from ..common.stages import cpu_seconds, write_json
from ..common.training import ROOT
from . import text_corpus
from .settings import SCALES, Scale, Stage

QUANTILES = (0.1, 0.5, 0.9)
_RECALL_ANSWER = re.compile(r"Answer: The secret number of \S+ is (\d+)\.")
_FINAL_ANSWER = re.compile(r"\nAnswer: [^\n]* (?:is|are) ([^\n]+)\.\Z")  # the listing after the last is/are
_RECALL_KINDS = ("recall", "facts", "facts_word")


@dataclass(frozen=True)
class Answer:
    """One retrieval answer of a document's text: its character span and its evidence's first character."""

    start: int
    end: int
    evidence: int


def locate(kind: str, document: str) -> list[Answer]:
    """Every retrieval answer of ``document`` of ``kind`` (niah, vt: the listing after the final question;
    recall logs: each answered value), with the value's first occurrence before it as the evidence."""
    if kind in _RECALL_KINDS:
        spans = [m.span(1) for m in _RECALL_ANSWER.finditer(document)]
    elif kind in ("niah", "vt"):
        final = _FINAL_ANSWER.search(document)
        if final is None:
            raise ValueError(f"no final 'Answer: ... is/are <listing>.' in this {kind} document: {document[-200:]!r}")
        spans = [(final.start(1) + m.start(), final.start(1) + m.end()) for m in re.finditer(r"[^\s,]+", final[1])]
        spans = [(a, b) for a, b in spans if document[a:b] != "and"]
    else:
        raise ValueError(f"{kind!r} documents have no retrieval answers to locate; use niah, vt or recall logs")
    answers = []
    for a, b in spans:
        stated = re.search(rf"(?<![\w-]){re.escape(document[a:b])}(?![\w-])", document[:a])
        if stated is None:
            raise ValueError(f"answer {document[a:b]!r} of this {kind} document is never stated before it")
        answers.append(Answer(a, b, stated.start()))
    return answers


@dataclass(frozen=True)
class Located:
    """An answer in token space: its first token, its token count, and its evidence's first token."""

    first: int
    tokens: int
    evidence: int


def to_tokens(answers: list[Answer], offsets: list[tuple[int, int]]) -> list[Located]:
    """``answers`` (character spans) as the tokens that overlap them, given each token's character offsets."""
    ends = np.asarray([e for _, e in offsets])

    def token(char: int) -> int:  # the token holding character ``char``
        return int(np.searchsorted(ends, char, side="right"))

    return [Located(token(a.start), token(a.end - 1) - token(a.start) + 1, token(a.evidence)) for a in answers]


@dataclass(frozen=True)
class Document:
    """A generated training document: kind, token ids (without the EOS after it), answers in token space."""

    kind: str
    ids: list[int]
    answers: list[Located]

    @property
    def positions(self) -> int:
        """Its length under document masking: its tokens and the EOS."""
        return len(self.ids) + 1


def stage_documents(
    tokenizer: Path, stage: Stage, index: int, seed: int, docs: int, with_answers: bool
) -> list[list[Document]]:
    """Documents of training run ``index`` (``stage``) in the corpus' chunks of ``text_corpus._CHUNK`` seeds (as
    ``text_corpus._chunk`` makes and packs them), chunks added until every kind has ``docs`` documents."""
    from tokenizers import Tokenizer

    from mtraining.data import TextTokenizer

    tok, backend = TextTokenizer(tokenizer), Tokenizer.from_file(str(tokenizer))
    kinds = stage.kinds or text_corpus.KINDS
    render, most = text_corpus.packed_render(stage.seq_len, stage.repeat, kinds, stage.min_fill)
    texts: dict[int, str] = {}

    def recorded(s: int, m: int) -> str:  # render, keeping the text the fitting document was rendered from
        texts[s] = render(s, m)
        return texts[s]

    chunks: list[list[Document]] = []
    first = text_corpus.stage_seed(index, seed)
    while not chunks or min(sum(d.kind == k for c in chunks for d in c) for k in kinds) < docs:
        chunk = []
        for s in range(first, first + text_corpus._CHUNK):
            ids = text_corpus._fitting(tok, recorded, s, most, stage.seq_len - 1)
            kind = text_corpus.document_kind(s, kinds)
            answers = []
            if with_answers:
                enc = backend.encode(texts[s], add_special_tokens=False)
                if enc.ids != ids:
                    raise RuntimeError(f"{tokenizer} tokenises document {s} unlike the corpus' TextTokenizer")
                answers = to_tokens(locate(kind, texts[s]), enc.offsets)
            chunk.append(Document(kind, ids, answers))
        chunks.append(chunk)
        first += text_corpus._CHUNK
    return chunks


def packing(chunks: list[list[Document]], seq_len: int, eos: int) -> dict:
    """The chunks packed as the corpus packs them (``text_corpus._whole_samples``, one call per chunk), with the
    filler that ends each sample counted: samples, tokens, filler tokens and their share."""
    filled: list[int] = []

    def filler(n: int, _sample: int) -> list[int]:
        filled.append(n)
        return [eos] * n

    tokens = sum(text_corpus._whole_samples([d.ids for d in c], seq_len, eos, filler).size for c in chunks)
    documents = sum(len(c) for c in chunks)
    return {
        "documents": documents,
        "samples": tokens // seq_len,
        "tokens": tokens,
        "filler_tokens": sum(filled),
        "filler_share": sum(filled) / tokens,
        "documents_per_sample": documents / (tokens // seq_len),
    }


def _quantiles(values: list[int], weights: list[float]) -> dict[str, float]:
    if not values:
        return {}
    q = np.quantile(np.asarray(values, float), QUANTILES, weights=np.asarray(weights), method="inverted_cdf")
    return {f"p{round(100 * p)}": float(v) for p, v in zip(QUANTILES, q)}


def answer_figures(docs: list[Document], weight: dict[str, float], last_q: int) -> dict:
    """Figures of ``docs`` with each document weighted by ``weight[kind]`` (one kind: equal weights)."""
    w_doc, w_ans, lengths, to_end, to_evidence = [], [], [], [], []
    tokens = in_rows = answers_in_rows = 0.0
    for d in docs:
        w = weight[d.kind]
        w_doc.append(w)
        lengths.append(d.positions)
        for a in d.answers:
            last = d.positions - 1  # the EOS
            inside = sum(last - p < last_q for p in range(a.first, a.first + a.tokens))
            tokens += w * a.tokens
            in_rows += w * inside
            answers_in_rows += w * (last - a.first < last_q)
            w_ans.append(w)
            to_end.append(last - a.first)
            to_evidence.append(a.first - a.evidence)
    return {
        "documents": len(docs),
        "answers": sum(len(d.answers) for d in docs),
        "answer_tokens": sum(a.tokens for d in docs for a in d.answers),
        "answer_tokens_in_rows_share": in_rows / tokens if tokens else None,
        "answers_in_rows_share": answers_in_rows / sum(w_ans) if w_ans else None,
        "answer_to_end_tokens": _quantiles(to_end, w_ans),
        "answer_to_evidence_tokens": _quantiles(to_evidence, w_ans),
        "document_positions": _quantiles(lengths, w_doc),
    }


def stage_figures(chunks: list[list[Document]], kinds: tuple[str, ...], last_q: int) -> dict:
    """Per kind (equal weights) and for the mixture (a document's weight: its kind's share of ``kinds`` over the
    documents of that kind generated, so each kind counts as often as the mixture draws it)."""
    docs = [d for c in chunks for d in c]
    per_kind = {}
    for k in sorted(set(kinds)):
        of_kind = [d for d in docs if d.kind == k]
        per_kind[k] = answer_figures(of_kind, {k: 1.0}, last_q)
    weight = {k: kinds.count(k) / len(kinds) / per_kind[k]["documents"] for k in set(kinds)}
    return {"kinds": per_kind, "mixture": answer_figures(docs, weight, last_q)}


def packed_stages(scale: Scale) -> dict[str, tuple[int, Stage]]:
    """The training runs (name: (index, stage)) whose samples pack mixture documents whole (not the repeat,
    token or copy stages, whose documents are one per sample or repeated sentences)."""
    runs = {f"stage{i}": st for i, st in enumerate(scale.curriculum)} | {"extension": scale.extension}
    return {
        name: (i, st)
        for i, (name, st) in enumerate(runs.items())
        if not st.repeat and not set(st.kinds or text_corpus.KINDS) <= set(text_corpus.WHOLE_KINDS)
    }


def measure(scale: Scale, tokenizer: Path, docs: int, last_q: int, seed: int) -> dict:
    """Answer figures of the extension, packing figures of every packed stage."""
    from mtraining.data import TextTokenizer

    eos = TextTokenizer(tokenizer).separator_id(None)
    stages = {}
    for name, (index, st) in packed_stages(scale).items():
        started = time.time()
        extension = name == "extension"
        chunks = stage_documents(tokenizer, st, index, seed, docs, with_answers=extension)
        kinds = st.kinds or text_corpus.KINDS
        stages[name] = {"seq_len": st.seq_len, "kinds": list(kinds), "min_fill": st.min_fill}
        stages[name]["packing"] = packing(chunks, st.seq_len, eos)
        if extension:
            stages[name]["answers"] = stage_figures(chunks, kinds, last_q)
        print(f"{name}: {sum(map(len, chunks))} documents in {time.time() - started:.0f}s", flush=True)
    return stages


def tokenizer_for(scale: Scale, work: Path, seed: int) -> Path:
    """The scale's BPE tokenizer (text_corpus.write_tokenizer), trained once into ``work``."""
    path = work / f"tokenizer_{scale.text_vocab}_{seed}.json"
    return path if path.exists() else text_corpus.write_tokenizer(path, scale.text_vocab, seed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    text_scales = sorted(n for n, s in SCALES.items() if s.task == "text")
    p.add_argument("--scale", choices=text_scales, default="gpu")
    p.add_argument("--docs", type=int, default=200, help="documents of each kind at least, per stage (whole chunks)")
    p.add_argument("--kinds", default=None, help="the extension's document kinds, e.g. niah,vt (default: the scale's)")
    p.add_argument("--last-q", type=int, default=None, help="estimation rows per document (default: the scale's)")
    p.add_argument("--seed", type=int, default=0, help="the corpus seed (python -m experiments.extension --seed)")
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "answer_positions")
    p.add_argument("--out", type=Path, default=None, help="default: bench/results/extension_<scale>_answers.json")
    args = p.parse_args()
    scale = SCALES[args.scale]
    if args.docs < 1:
        p.error(f"--docs must be at least 1, got {args.docs}")
    if args.kinds:
        kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
        unknown = sorted(set(kinds) - {"niah", "vt", *_RECALL_KINDS})
        if not kinds or unknown:
            p.error(
                f"--kinds takes document kinds with answers (niah, vt, recall, facts, facts_word), got {args.kinds!r}"
            )
        scale = replace(scale, extension=replace(scale.extension, kinds=kinds))
    last_q = args.last_q or scale.last_q
    started, cpu = time.time(), cpu_seconds()
    tokenizer = tokenizer_for(scale, args.work, args.seed)
    stages = measure(scale, tokenizer, args.docs, last_q, args.seed)
    name = f"extension_{scale.name}_answers"
    result = {
        "name": name,
        **provenance(on_gpu=False),
        "settings": {
            "scale": scale.name,
            "docs_per_kind": args.docs,
            "last_q": last_q,
            "seed": args.seed,
            "text_vocab": scale.text_vocab,
            "quantiles": list(QUANTILES),
        },
        "stages": stages,
        "wall_s": round(time.time() - started, 1),
        "cpu_s": round(cpu_seconds() - cpu, 1),
    }
    out = args.out or RESULTS_DIR / f"{name}.json"
    write_json(out, result)
    ext = stages["extension"]["answers"]["mixture"]
    print(
        f"wrote {out}: extension answer tokens in the last {last_q} rows: {ext['answer_tokens_in_rows_share']:.3f} "
        f"(mixture); {result['wall_s']}s wall, {result['cpu_s']}s CPU"
    )


if __name__ == "__main__":
    main()

"""Forward passes for evaluation: per-token loss of a long sequence, and a prompt's greedy answer with its
reference answer scored teacher-forced.

Attention runs through the trainer's adapter (``mtraining.models``: ``attn_implementation=
"mtraining"`` with an ``Attention``), so a long prompt sees exactly the attention of training:
dense or dynamic sparse, on one device or as a ring over a context-parallel group in a layout.
``Engine._attention`` is the one place that decides it.

Context parallelism (``group`` with W > 1 ranks, e.g. under torchrun):

- loss: labels are shifted on the full sequence, then ids, labels and positions are sharded by the
  layout; each rank runs the model on its shard (RoPE gets global positions), computes the loss of
  its own tokens in chunks (no full logits), and the per-token losses are gathered back to global
  order on every rank. The sequence length must be a multiple of the layout's unit.
- answers (``respond``): every prompt token, the question included, is prefilled through the attention
  under test, as sparse-prefill inference serves (MInference). One pass holds the prompt, then the
  reference answer when one is given (scored teacher-forced), then on several ranks a padding document up
  to the layout's unit. ``Documents.estimate_end`` at the prompt's end keeps the answer and the padding out
  of the pattern's estimate, and document masking keeps the padding out of every other token's attention,
  so the prompt's rows see exactly the pattern and the keys of the prompt alone: the first answer token's
  logits (at the last prompt position) are the same on one process and on any group. The answer's rows
  read the prompt through that pattern too (the pattern is global), so the teacher-forced scores are
  those of the attention under test on every answer token; the answer cannot choose the lines it is read
  with. Only generated tokens after the first decode dense: group rank 0 gathers every rank's KV cache
  shard, keeps the prompt's positions, runs greedy steps with plain SDPA against it and broadcasts the
  answer. Decoding costs the answer length times one pass over the cache. Every step has a new key length, so
  decoding never runs SDPA's cuDNN backend (``DECODE_BACKENDS``): cuDNN builds an execution plan per shape,
  which recent torch prefers on Hopper, and a plan per generated token costs more than the step itself.

``Engine.phases`` adds up the seconds of each phase (``Phases``): prefills, decoding steps, and perplexity
passes; each phase ends by reading its result on the host, so the times hold on a GPU without extra syncs.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..models import ATTN_IMPLEMENTATION, Attention, bind
from ..models.attention import Record
from ..ops.documents import Documents
from ..ops.estimate.estimator import PatternConfig
from ..parallel.layout import Layout, make_layout
from ..train.loss import IGNORE_INDEX, token_scores

DECODE_ATTENTION = "sdpa"
DECODE_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)  # no cuDNN (above)
_LOGIT_ELEMENTS = 1 << 26  # lm-head chunk: at most this many logits at once (256 MB in float32)
_PAD_ID = 0  # the padding document's token (masked out of every other document and of the estimate)


@dataclass(frozen=True)
class Forced:
    """A reference answer scored teacher-forced after its prompt, one entry per answer token.

    Attributes:
        nll: -log p(answer[i] | prompt, answer[:i]), natural log.
        greedy: whether answer[i] is the greedy prediction there.
    """

    nll: list[float]
    greedy: list[bool]

    @property
    def all_greedy(self) -> bool:
        """Every answer token is the greedy prediction (greedy decoding through the same attention would
        produce the answer)."""
        return all(self.greedy)


@dataclass(frozen=True)
class Response:
    """A prompt's greedy answer and, when a reference answer was given, its teacher-forced scores."""

    tokens: list[int]
    forced: Forced | None = None


@dataclass
class Phases:
    """Seconds an engine spent per phase, with counts: ``prefill_s`` over ``prefills`` answer prefills (the prompt
    and its reference answer, their scores read back), ``decode_s`` over ``decode_steps`` greedy steps after the
    first token (with the prompt's cache gathered), ``loss_s`` over ``losses`` teacher-forced passes
    (``token_scores``: perplexity windows)."""

    prefill_s: float = 0.0
    prefills: int = 0
    decode_s: float = 0.0
    decode_steps: int = 0
    loss_s: float = 0.0
    losses: int = 0


@dataclass(frozen=True)
class AttentionSpec:
    """How evaluation runs attention.

    Attributes:
        sparse: dynamic vertical-slash sparse attention (else dense causal).
        layout: context-parallel layout name ("contiguous", "zigzag", "striped").
        block_size: kernel block G (also the layout's stripe).
        backend: "auto", "torch" or "triton".
        pattern: ``PatternConfig.from_settings`` fields given (v_size, s_size, last_q, threshold, budgets: a
            file's path, ...) for sparse runs.
        min_sparse_len: sequences shorter than this run dense even when ``sparse``.
        max_density: a layer whose estimated pattern keeps more than this fraction of the causal pairs runs
            dense (``attention.max_density`` in training); None: always sparse.
        dense_layers: layers that run dense even when ``sparse`` (as ``attention.dense_layers`` in training).
        ring: "flat" or "hierarchical" context-parallel ring (``parallel.ring`` in training).
        inner_size: ranks per inner ring of the hierarchical ring (default: LOCAL_WORLD_SIZE).
        context_mode: "ring" (K/V around ``ring``) or "allgather" (K/V all-gathered per layer;
            ``parallel.context_mode`` in training).
    """

    sparse: bool = False
    layout: str = "striped"
    block_size: int = 128
    backend: str = "auto"
    pattern: dict = field(default_factory=dict)
    min_sparse_len: int = 0
    max_density: float | None = None
    dense_layers: tuple[int, ...] = ()
    ring: str = "flat"
    inner_size: int | None = None
    context_mode: str = "ring"

    @property
    def name(self) -> str:
        return "sparse" if self.sparse else "dense"

    def pattern_config(self) -> PatternConfig | None:
        """The ``PatternConfig`` of sparse runs (None when dense); ValueError for options that cannot run."""
        return PatternConfig.from_settings(block_size=self.block_size, **self.pattern) if self.sparse else None


def layout_unit(layout: str, world_size: int, block_size: int) -> int:
    """Sequence lengths the layout can split are multiples of this (the block size on one process)."""
    if world_size == 1:
        return block_size
    return (2 if layout == "zigzag" else 1) * world_size * block_size


def _with_cache(forward, cache) -> dict:
    """The keyword that hands ``cache`` to a Hugging Face forward: ``cache`` (transformers names it so from 5.2x;
    ``past_key_values``, which it replaces, is removed in 5.40), ``past_key_values`` where the forward has no
    ``cache``."""
    name = "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
    return {name: cache}


@contextlib.contextmanager
def _attn_implementation(model: nn.Module, name: str) -> Iterator[None]:
    previous = model.config._attn_implementation
    if previous != name:
        model.set_attn_implementation(name)
    try:
        yield
    finally:
        if previous != name:
            model.set_attn_implementation(previous)


class Engine:
    """Runs one model for evaluation on one process or as one rank of a context-parallel group."""

    def __init__(
        self, model: nn.Module, spec: AttentionSpec, group: dist.ProcessGroup | None = None, record: Record = "density"
    ) -> None:
        """``record``: what each sparse prefill records, "density" or also "recall" (``models.recall.pattern_recall``
        on query rows drawn with the prefill's index as seed: about one more estimation pass per layer)."""
        if model.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise ValueError(
                f"the model runs attn_implementation={model.config._attn_implementation!r}; load it with "
                "mtraining.eval.loading.load_model (or mtraining.models.build_model)"
            )
        self.model = model
        self.spec = spec
        self.world_size = 1 if group is None else dist.get_world_size(group)
        self.group = group if self.world_size > 1 else None
        self.rank = 0 if self.group is None else dist.get_rank(self.group)
        self.root = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        self.device = next(model.parameters()).device
        self.unit = layout_unit(spec.layout, self.world_size, spec.block_size)
        self.pattern_config = spec.pattern_config()  # ValueError for sparse options that cannot run
        if record not in ("density", "recall"):
            raise ValueError(f"record must be 'density' or 'recall', got {record!r}")
        self.record = record
        self.densities: list[float] = []  # mean kept fraction of causal pairs, per sparse prefill
        self.recalls: list[float] = []  # with record="recall": mean pattern recall, per sparse prefill
        self.phases = Phases()

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def _attention(self, seq_len: int) -> Attention:
        """The attention a prefill of ``seq_len`` tokens runs (the one switch between paths)."""
        return Attention(
            group=self.group,
            layout=self._layout(seq_len) if self.group is not None else None,
            pattern_config=self.pattern_config,
            dense_layers=frozenset(self.spec.dense_layers),
            min_sparse_len=self.spec.min_sparse_len,
            max_density=self.spec.max_density,
            backend=self.spec.backend,
            ring=self.spec.ring,
            inner_size=self.spec.inner_size,
            context_mode=self.spec.context_mode,
        )

    # ------------------------------------------------------------------ sharding
    def _layout(self, seq_len: int) -> Layout:
        return make_layout(self.spec.layout, seq_len, self.world_size, self.spec.block_size)

    def _local(self, full: Tensor, seq_len: int) -> Tensor:
        """This rank's part of a [1, seq_len] tensor (all of it on one process)."""
        if self.group is None:
            return full
        return self._layout(seq_len).shard(full, self.rank)

    def _check_ids(self, largest: int) -> None:
        """ValueError when a token id has no embedding row: the tokenizer is another model's."""
        rows = self.model.get_input_embeddings().num_embeddings
        if largest >= rows:
            raise ValueError(
                f"token id {largest} is beyond the model's {rows} embeddings: the tokenizer is not the model's; "
                "pass --tokenizer with the tokenizer it was trained with"
            )

    def _prefill(self, ids: Tensor, cache=None, documents: Documents | None = None) -> Tensor:
        """Run the base model on ``ids`` [seq] through the configured attention; local hidden states.
        ``documents``: packed documents of ``ids`` (global boundaries), each attending only within itself."""
        seq_len = ids.shape[0]
        attention = bind(self.model, self._attention(seq_len))
        positions = torch.arange(seq_len, device=self.device)
        with attention.forward(record=self.record, documents=documents, seed=len(self.densities)):
            out = self.model.base_model(
                input_ids=self._local(ids[None].to(self.device), seq_len),
                position_ids=self._local(positions[None], seq_len),
                use_cache=cache is not None,
                **_with_cache(self.model.base_model.forward, cache),
            )
        stats = attention.end_step()
        if stats.density is not None:
            self.densities.append(stats.density)
        if stats.recall is not None:
            self.recalls.append(stats.recall)
        return out.last_hidden_state

    # ------------------------------------------------------------------ loss
    def _token_scores(self, hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """float32 [S] loss of each position (0 where the label is ignored: training's loss, per token) and
        int64 [S] the greedy next token."""
        weight = self.model.get_output_embeddings().weight
        return token_scores(hidden, weight, labels, chunk_tokens=max(1, _LOGIT_ELEMENTS // weight.shape[0]))

    @torch.no_grad()
    def token_scores(self, ids: Tensor, documents: Documents | None = None) -> tuple[Tensor, Tensor]:
        """On the CPU, every rank: float32 [L - 1] -log p(ids[i + 1] | ids[: i + 1]) and int64 [L - 1] the
        greedy prediction of ids[i + 1] (teacher-forced: one prefill of the whole sequence). ``documents``:
        packed documents of ``ids`` (global boundaries; positions stay global): each token sees only its own
        document's, and a sparse pattern is estimated from every document's last queries (document masking)."""
        ids = ids.long().flatten()
        seq_len = ids.shape[0]
        if seq_len < 2:
            raise ValueError("scoring needs sequences of at least 2 tokens")
        self._check_ids(int(ids.max()))
        if seq_len % self.unit and self.group is not None:
            raise ValueError(
                f"length {seq_len} cannot be split by the {self.spec.layout} layout over {self.world_size} ranks; "
                f"use lengths that are multiples of {self.unit}"
            )
        started = time.perf_counter()
        labels = torch.cat([ids[1:], ids.new_full((1,), IGNORE_INDEX)])  # shift on the full sequence, then shard
        hidden = self._prefill(ids, documents=documents)[0]
        scores = self._token_scores(hidden, self._local(labels[None].to(self.device), seq_len)[0])
        if self.group is not None:  # gathered on the device (NCCL needs device tensors)
            layout = self._layout(seq_len)
            scores = tuple(layout.all_gather(local, self.group, dim=0) for local in scores)
        nll, greedy = scores[0][:-1].cpu(), scores[1][:-1].cpu()
        self.phases.loss_s += time.perf_counter() - started
        self.phases.losses += 1
        return nll, greedy

    def token_nll(self, ids: Tensor) -> Tensor:
        """float32 [L - 1] on the CPU, every rank: -log p(ids[i + 1] | ids[: i + 1])."""
        return self.token_scores(ids)[0]

    # ------------------------------------------------------------------ answers
    def _answer_scores(self, hidden: Tensor, seq_len: int, first: int, labels: list[int]) -> tuple[Tensor, Tensor]:
        """On the CPU, every rank: float64 [R] loss and int64 [R] greedy next token at global positions
        first .. first + R - 1 (R = len(labels); loss 0 where the label is IGNORE_INDEX), from this rank's
        hidden states of a ``seq_len``-token prefill; each rank scores the rows it holds."""
        count = len(labels)
        # the rows of the R positions, found on the host: no pass over the sequence, no device sync
        answer = torch.arange(first, first + count)
        owner, local = (torch.zeros_like(answer), answer) if self.group is None else self._layout(seq_len).owner(answer)
        at = (owner == self.rank).nonzero().flatten()
        nll = torch.zeros(count, dtype=torch.float64, device=self.device)
        greedy = torch.zeros(count, dtype=torch.int64, device=self.device)
        if at.numel():
            rows, at = local[at].to(self.device), at.to(self.device)
            loss, predicted = self._token_scores(
                hidden.index_select(0, rows), torch.tensor(labels, device=self.device)[at]
            )
            nll[at], greedy[at] = loss.double(), predicted
        if self.group is not None:  # each position is held by one rank: the sums are its values
            dist.all_reduce(nll, group=self.group)
            dist.all_reduce(greedy, group=self.group)
        return nll.cpu(), greedy.cpu()

    def _prompt_cache(self, cache, seq_len: int, keep: int):
        """Group rank 0: a DynamicCache of the first ``keep`` positions of a ``seq_len``-token prefill (every
        rank's shard gathered in global order); other ranks: None."""
        from transformers import DynamicCache

        layout = self._layout(seq_len) if self.group is not None else None
        full = DynamicCache(config=self.model.config) if self.is_root else None
        for idx, layer in enumerate(cache.layers):
            tensors = []
            for local in (layer.keys.contiguous(), layer.values.contiguous()):
                if layout is None:
                    tensors.append(local[..., :keep, :])
                    continue
                shards = [torch.empty_like(local) for _ in range(self.world_size)] if self.is_root else None
                dist.gather(local, shards, dst=self.root, group=self.group)
                tensors.append(layout.gather(shards, dim=2)[..., :keep, :] if self.is_root else None)
            if self.is_root:
                full.update(tensors[0], tensors[1], idx)
        return full

    def _decode(self, cache, first: int, max_new_tokens: int, stop_ids: set[int]) -> list[int]:
        """Dense greedy steps on one process after ``first``, the prefill's greedy token (SDPA without cuDNN)."""
        answer = [first]
        with _attn_implementation(self.model, DECODE_ATTENTION), sdpa_kernel(list(DECODE_BACKENDS)):
            while answer[-1] not in stop_ids and len(answer) < max_new_tokens:
                step = torch.tensor([[answer[-1]]], device=self.device)
                out = self.model(
                    input_ids=step, use_cache=True, logits_to_keep=1, **_with_cache(self.model.forward, cache)
                )
                answer.append(int(out.logits[0, -1].argmax()))
        return answer

    def _sequence(self, prompt_len: int, answer_len: int) -> tuple[int, Documents | None]:
        """(tokens of the pass, its documents) for a prompt and a reference answer: their sum rounded up to the
        layout's unit on several ranks (a padding document fills it); documents leave every position after
        the prompt out of the estimate (None when there is none)."""
        real = prompt_len + answer_len
        total = real if self.group is None else -(-real // self.unit) * self.unit
        if total == prompt_len:
            return total, None
        lengths = [real] if total == real else [real, total - real]
        return total, Documents.from_lengths(lengths, estimate_end=prompt_len)

    @torch.no_grad()
    def respond(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        stop_ids: Sequence[int] = (),
        reference: Sequence[int] | None = None,
    ) -> Response:
        """Every rank: the greedy answer to ``prompt`` (at most ``max_new_tokens`` ids, stop id included) and,
        with ``reference`` (answer token ids), its teacher-forced scores, from one prefill (module docstring).
        ``max_new_tokens`` 1 decodes nothing and gathers no cache for it: the prefill alone, the same as with more
        (a teacher-forced reading)."""
        from transformers import DynamicCache

        ids = [int(i) for i in prompt]
        forced = [int(i) for i in reference or ()]
        if not ids:
            raise ValueError("cannot answer an empty prompt")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        self._check_ids(max(ids + forced))
        total, documents = self._sequence(len(ids), len(forced))
        sequence = ids + forced + [_PAD_ID] * (total - len(ids) - len(forced))
        started = time.perf_counter()
        cache = DynamicCache(config=self.model.config)
        hidden = self._prefill(torch.tensor(sequence), cache, documents)[0]
        labels = forced or [IGNORE_INDEX]  # the first answer token's row, scored or not
        nll, greedy = self._answer_scores(hidden, total, len(ids) - 1, labels)
        del hidden
        prefilled = time.perf_counter()
        cache = self._prompt_cache(cache, total, len(ids)) if max_new_tokens > 1 else None  # 1: no decoding step
        tokens = self._decode(cache, int(greedy[0]), max_new_tokens, set(stop_ids)) if self.is_root else None
        del cache
        self.phases.prefill_s += prefilled - started
        self.phases.prefills += 1
        self.phases.decode_s += time.perf_counter() - prefilled
        self.phases.decode_steps += len(tokens) - 1 if tokens is not None else 0
        if self.group is not None:
            box = [tokens]
            dist.broadcast_object_list(box, src=self.root, group=self.group)
            tokens = box[0]
        scored = Forced(nll.tolist(), [int(g) == t for g, t in zip(greedy, forced)]) if forced else None
        return Response(tokens, scored)

    def generate(self, ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()) -> list[int]:
        """Greedy answer (at most ``max_new_tokens`` ids, stop id included) after prefilling ``ids``."""
        return self.respond(ids, max_new_tokens, stop_ids).tokens

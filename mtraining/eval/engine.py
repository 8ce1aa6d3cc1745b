"""Forward passes for evaluation: per-token loss of a long sequence, and prefill + greedy answer.

Attention runs through the trainer's adapter (``mtraining.models``: ``attn_implementation=
"mtraining"`` with an ``Attention``), so a long prompt sees exactly the attention of training:
dense or dynamic sparse, on one device or as a ring over a context-parallel group in a layout.
``Engine._attention`` is the one place that decides it.

Context parallelism (``group`` with W > 1 ranks, e.g. under torchrun):

- loss: labels are shifted on the full sequence, then ids, labels and positions are sharded by the
  layout; each rank runs the model on its shard (RoPE gets global positions), computes the loss of
  its own tokens in chunks (no full logits), and the per-token losses are gathered back to global
  order on every rank. The sequence length must be a multiple of the layout's unit.
- generation: the prompt's longest prefix that is a multiple of the *prefill granule* (default
  2048 tokens, made a multiple of the layout's unit) and leaves at least one token is prefilled
  through the ring; every rank's KV cache shard is gathered on group rank 0, which runs the
  remaining prompt tokens (the dense tail, fewer than one granule: usually the question) and the
  greedy answer with plain dense SDPA against the full cache, and broadcasts the answer. Decoding
  is dense, as in sparse-prefill inference; its cost is the answer length times one pass over the
  cache. The split does not depend on the number of ranks (while the unit divides the granule),
  so sparse answers are the same on one process and on any such group.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..models import ATTN_IMPLEMENTATION, Attention, bind
from ..models.attention import Record
from ..ops.documents import Documents
from ..ops.pattern.estimate import PatternConfig
from ..parallel.layout import Layout, make_layout
from ..train.loss import IGNORE_INDEX, token_scores

DECODE_ATTENTION = "sdpa"
_LOGIT_ELEMENTS = 1 << 26  # lm-head chunk: at most this many logits at once (256 MB in float32)
_TAIL_CHUNK = 256  # prompt tokens per dense step after the prefill (bounds the SDPA mask)


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
        dense_layers: layers that run dense even when ``sparse`` (as ``attention.dense_layers`` in training).
        ring: "flat" or "hierarchical" context-parallel ring (``parallel.ring`` in training).
        inner_size: ranks per inner ring of the hierarchical ring (default: LOCAL_WORLD_SIZE).
        prefill_granule: generation prefills the longest prompt prefix that is a multiple of this
            (rounded up to a multiple of the layout's unit); the rest runs dense.
    """

    sparse: bool = False
    layout: str = "striped"
    block_size: int = 128
    backend: str = "auto"
    pattern: dict = field(default_factory=dict)
    min_sparse_len: int = 0
    prefill_granule: int = 2048
    dense_layers: tuple[int, ...] = ()
    ring: str = "flat"
    inner_size: int | None = None

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
        if spec.prefill_granule < 1:
            raise ValueError(f"prefill_granule must be a positive number of tokens, got {spec.prefill_granule}")
        self.granule = math.lcm(self.unit, spec.prefill_granule)
        self.pattern_config = spec.pattern_config()  # ValueError for sparse options that cannot run
        if record not in ("density", "recall"):
            raise ValueError(f"record must be 'density' or 'recall', got {record!r}")
        self.record = record
        self.densities: list[float] = []  # mean kept fraction of causal pairs, per sparse prefill
        self.recalls: list[float] = []  # with record="recall": mean pattern recall, per sparse prefill

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
            backend=self.spec.backend,
            ring=self.spec.ring,
            inner_size=self.spec.inner_size,
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
                past_key_values=cache,
                use_cache=cache is not None,
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
        labels = torch.cat([ids[1:], ids.new_full((1,), IGNORE_INDEX)])  # shift on the full sequence, then shard
        hidden = self._prefill(ids, documents=documents)[0]
        scores = self._token_scores(hidden, self._local(labels[None].to(self.device), seq_len)[0])
        if self.group is not None:  # gathered on the device (NCCL needs device tensors)
            layout = self._layout(seq_len)
            scores = tuple(layout.all_gather(local, self.group, dim=0) for local in scores)
        return scores[0][:-1].cpu(), scores[1][:-1].cpu()

    def token_nll(self, ids: Tensor) -> Tensor:
        """float32 [L - 1] on the CPU, every rank: -log p(ids[i + 1] | ids[: i + 1])."""
        return self.token_scores(ids)[0]

    # ------------------------------------------------------------------ generation
    def _gathered_cache(self, cache, prefix_len: int):
        """Group rank 0: a DynamicCache of the full prefix from every rank's shard; others: None."""
        from transformers import DynamicCache

        if self.group is None:
            return cache
        layout = self._layout(prefix_len)
        full = DynamicCache(config=self.model.config) if self.is_root else None
        for idx, layer in enumerate(cache.layers):
            tensors = []
            for local in (layer.keys.contiguous(), layer.values.contiguous()):
                shards = [torch.empty_like(local) for _ in range(self.world_size)] if self.is_root else None
                dist.gather(local, shards, dst=self.root, group=self.group)
                tensors.append(layout.gather(shards, dim=2) if self.is_root else None)
            if self.is_root:
                full.update(tensors[0], tensors[1], idx)
        return full

    def _decode(self, cache, tail: Sequence[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
        """Dense steps on one process: the rest of the prompt, then greedy tokens."""
        from transformers import DynamicCache

        cache = cache if cache is not None else DynamicCache(config=self.model.config)
        tail_ids = torch.tensor([list(tail)], device=self.device)
        answer: list[int] = []
        with _attn_implementation(self.model, DECODE_ATTENTION):
            for start in range(0, tail_ids.shape[1], _TAIL_CHUNK):
                out = self.model(
                    input_ids=tail_ids[:, start : start + _TAIL_CHUNK],
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
            for _ in range(max_new_tokens):
                token = int(out.logits[0, -1].argmax())
                answer.append(token)
                if token in stop_ids or len(answer) == max_new_tokens:
                    break
                step = torch.tensor([[token]], device=self.device)
                out = self.model(input_ids=step, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return answer

    @torch.no_grad()
    def generate(self, ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()) -> list[int]:
        """Greedy answer (at most ``max_new_tokens`` ids, stop id included) after prefilling ``ids``."""
        from transformers import DynamicCache

        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError("cannot generate from an empty prompt")
        if max_new_tokens < 1:
            raise ValueError(f"an answer needs at least 1 new token, got {max_new_tokens} (--max-new-tokens)")
        self._check_ids(max(ids))
        prefix_len = (len(ids) - 1) // self.granule * self.granule
        cache = None
        if prefix_len:
            cache = DynamicCache(config=self.model.config)
            self._prefill(torch.tensor(ids[:prefix_len]), cache)
            cache = self._gathered_cache(cache, prefix_len)
        answer = self._decode(cache, ids[prefix_len:], max_new_tokens, set(stop_ids)) if self.is_root else None
        del cache
        if self.group is not None:
            box = [answer]
            dist.broadcast_object_list(box, src=self.root, group=self.group)
            answer = box[0]
        return answer

"""The model's attention as the trainer and the evaluation drive it: one ``Attention`` object per model.

``bind(model, attention)`` (adapter.py) makes every attention layer of a Hugging Face model call
``attention.attend``; the caller runs the model inside the object's context managers, which say
what the layers do on that pass. A training step reads:

    for micro_batch in step:
        with attention.forward(record="density"):
            loss = model(micro_batch)
        with attention.recompute():
            loss.backward()  # activation checkpointing re-runs each layer's forward in here
    stats = attention.end_step()  # the pattern stats of the step's last recorded forward

- ``forward(record=..., save_outputs=...)``: each sparse layer estimates its pattern from the current
  q/k (runs dense where the pattern is denser than ``max_density``) and records its density, and
  its recall when asked (on query rows drawn with ``seed``), for ``end_step``. When the layers are
  activation-checkpointed (``checkpointed``) and gradients are on, each layer keeps the pattern it ran
  with, and with ``save_outputs`` its attention (out, lse), for the recompute.
- ``recompute()``: layers re-run inside it take back what the last forward kept instead of
  estimating again, so the recomputed forward is exactly the forward, at one estimation per layer
  (and with saved outputs no attention kernel runs). Leaving it drops what that forward kept, so
  each forward that keeps is paired with its own recompute (one pair per micro-batch).
- outside both, layers run as a forward that records and keeps nothing.

Memory: a sparse layer's pattern caches the kernels' walks of every chunk pair it meets (ops/sparse/launch.py),
megabytes per layer at long context (heads x query blocks x listed key blocks). The autograd graph holds each
layer's pattern from its forward to the end of the backward, so kept walks would pile up over all layers,
memory dense attention never spends. A checkpointed forward therefore drops its walks after each layer (the
recompute builds them again, a few launches per chunk pair), and inside ``recompute()`` a layer's walks are
dropped when the next layer is recomputed (its backward has run by then) or when the block ends: at most one
layer's walks are alive, as one layer's activations are.

Per-call inputs of a forward belong in ``forward``'s arguments and in what it keeps, so that its
recompute sees the same ones: the packed documents of the micro-batch (``documents``, global
boundaries; each query attends only within its document). Outside a forward carrying documents, the
model's ``position_ids`` mark them: a document starts wherever an id does not continue the previous one
(``ops.documents.document_starts``, flash-attention's varlen convention), read on the global sequence. On
one device that is the layer's own ids; under context parallelism each rank holds its shard, so the ranks
gather the ids once per position-id tensor (every layer of a model call gets the same one: one small
agreement check, one all-gather of the ids, one host read per forward) and read the documents of the
whole sequence. Ids that count 0..L-1 on every rank (a model called under context parallelism without
global position ids) are refused. The state is plain attributes, not thread- or context-local: on CUDA the
autograd engine runs the backward, and so the recompute, on its own thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops.documents import Documents, resolve_documents
from ..ops.estimate.estimator import PatternConfig, estimate_pattern
from ..ops.pattern import VerticalSlashPattern
from ..ops.sparse import fa4
from ..ops.sparse.attention import sparse_attention
from ..parallel.agreement import check_ranks_agree
from ..parallel.estimate import estimate_pattern_cp
from ..parallel.layout import Layout
from ..parallel.ring import ring_attention
from .recall import pattern_recall

Record = Literal["off", "density", "recall"]


@dataclass
class PatternStats:
    """One layer's sparse pattern on a recorded forward: kept fraction of causal pairs, estimated recall
    (None when not measured), and whether the layer ran dense instead (density above ``max_density``)."""

    density: float
    recall: float | None
    ran_dense: bool = False


@dataclass(frozen=True)
class StepStats:
    """The pattern stats of a step (its last recorded forward), per sparse layer."""

    layers: dict[int, PatternStats]

    @property
    def density(self) -> float | None:
        """Mean kept fraction of causal pairs over the sparse layers (None without any)."""
        stats = self.layers.values()
        return sum(s.density for s in stats) / len(stats) if stats else None

    @property
    def recall(self) -> float | None:
        """Mean recall over the layers that measured it (None when none did)."""
        recalls = [s.recall for s in self.layers.values() if s.recall is not None]
        return sum(recalls) / len(recalls) if recalls else None

    @property
    def dense_fallback(self) -> int:
        """Sparse layers that ran dense (their pattern was denser than ``max_density``)."""
        return sum(s.ran_dense for s in self.layers.values())


@dataclass(frozen=True)
class _Recorded:
    """One layer's ``PatternStats`` as recorded: its density a 0-d device tensor, read at ``end_step`` with every
    other layer's in one device sync (a read per layer would wait for the GPU in every layer)."""

    density: Tensor
    recall: float | None
    ran_dense: bool


@dataclass
class _Kept:
    """What one forward kept for its recompute, per layer: the pattern of each sparse layer (None: it
    ran dense) and, when saved, every layer's (out, lse)."""

    patterns: dict[int, VerticalSlashPattern | None] = field(default_factory=dict)
    outputs: dict[int, tuple[Tensor, Tensor]] | None = None
    documents: Documents | None = None

    def put(self, layer: int, sparse: bool, pattern: VerticalSlashPattern | None, out: Tensor, lse: Tensor) -> None:
        if sparse:
            self.patterns[layer] = pattern
        if self.outputs is not None:
            self.outputs[layer] = (out.detach(), lse)

    def take(self, layer: int, sparse: bool) -> tuple[VerticalSlashPattern | None, tuple[Tensor, Tensor] | None]:
        """(pattern, saved outputs) of ``layer``, each taken back once; RuntimeError where the forward kept none."""
        if (sparse and layer not in self.patterns) or (self.outputs is not None and layer not in self.outputs):
            raise RuntimeError(
                f"layer {layer} is recomputed but the last forward kept nothing for it (already recomputed, or it "
                "did not run in that forward): run each backward inside attention.recompute() right after its forward"
            )
        pattern = self.patterns.pop(layer) if sparse else None
        return pattern, (self.outputs.pop(layer) if self.outputs is not None else None)


@dataclass(frozen=True)
class _Pass:
    """What the layers do inside one ``forward()`` or ``recompute()`` block."""

    record: Record = "off"
    keep: _Kept | None = None  # a forward: where each layer keeps what its recompute needs
    replay: _Kept | None = None  # a recompute: what the forward kept
    documents: Documents | None = None  # packed documents of the pass (a recompute: its forward's)
    seed: int = 0  # a forward recording recall: its row draw (pattern_recall)


@dataclass(eq=False)
class Attention:
    """How a model's attention runs (the settings below, fixed), and the passes it runs in (module docstring).

    Attributes:
        group: context-parallel process group (None: single device).
        layout: how the global sequence is split over ``group`` (required when it has > 1 rank).
        pattern_config: a ``PatternConfig`` (mtraining.ops.estimate) for dynamic sparse attention;
            None: dense everywhere.
        dense_layers: layers that always run dense.
        min_sparse_len: global sequence lengths below this run dense (sparse does not pay).
        max_density: a layer whose estimated pattern keeps more than this fraction of the causal
            pairs runs dense for that call (sparse kernels are slower than dense there); None: never.
        backend: "auto", "torch", "triton" or "fa4". "fa4" (ops/sparse/fa4.py, one CUDA device, flash-attn-4)
            runs each sparse single-device call inside its scope (``fa4.out_of_scope``: default positions with
            as many queries as keys, no packed documents, no per-block columns, a pattern block that is a multiple
            of 128) and every other call on "triton": dense layers and short sequences (the dense path, as
            always), packed documents, fewer queries than keys (cached decoding), per-block columns. Refused
            with context parallelism (the ring steps' positions are strided): use "triton" there.
        ring: "flat" or "hierarchical" (``ring_attention``'s ring); ``inner_size``: ranks per inner ring
            of the hierarchical ring (default there: LOCAL_WORLD_SIZE).
        context_mode: "ring" (K/V around ``ring``) or "allgather" (K/V all-gathered once per layer, no ring:
            ``ring_attention(..., ring="allgather")``).
        checkpointed: the model's layers are activation-checkpointed, so a forward keeps what the
            backward's recompute replays.
    """

    group: dist.ProcessGroup | None = None
    layout: Layout | None = None
    pattern_config: PatternConfig | None = None
    dense_layers: frozenset[int] = frozenset()
    min_sparse_len: int = 0
    max_density: float | None = None
    backend: str = "auto"
    ring: Literal["flat", "hierarchical"] = "flat"
    inner_size: int | None = None
    context_mode: Literal["ring", "allgather"] = "ring"
    checkpointed: bool = False
    _pass: _Pass | None = field(default=None, init=False, repr=False)
    _kept: _Kept | None = field(default=None, init=False, repr=False)  # the last forward's, until its recompute
    _stats: dict[int, _Recorded] = field(default_factory=dict, init=False, repr=False)
    _replayed: VerticalSlashPattern | None = field(default=None, init=False, repr=False)  # the last recomputed layer's
    _position_documents: tuple[Tensor, int, Documents] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.cp_size > 1 and self.layout is None:
            raise ValueError("a context-parallel group needs a layout: pass layout=make_layout(...)")
        if self.context_mode not in ("ring", "allgather"):
            raise ValueError(f"context_mode must be 'ring' or 'allgather', got {self.context_mode!r}")
        if self.backend == "fa4" and self.cp_size > 1:
            raise ValueError(
                "backend='fa4' runs single-device calls only (the ring steps' positions are strided by the layout); "
                "use backend='triton' with context parallelism"
            )
        if self.layout is not None and self.layout.world_size != self.cp_size:
            raise ValueError(
                f"layout is for {self.layout.world_size} ranks but the context-parallel group has {self.cp_size}; "
                "build the layout with the group's size"
            )

    @property
    def cp_size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def sparse_for(self, layer_idx: int, seq_len: int) -> PatternConfig | None:
        """The pattern config for this layer and global length, or None where attention runs dense."""
        if self.pattern_config is None or layer_idx in self.dense_layers or seq_len < self.min_sparse_len:
            return None
        return self.pattern_config

    # ------------------------------------------------------------------ the protocol
    # Note [recompute replays the pattern]
    # With activation checkpointing the backward re-runs each layer's forward. That recompute must be the
    # forward, pair for pair, or the gradients belong to another function:
    # - forward() keeps the pattern (or the dense decision) of each checkpointed sparse layer, and with
    #   save_outputs its (out, lse); recompute() takes them back instead of estimating again;
    # - so a step pays one estimation per layer, not two, and the recompute cannot draw another pattern;
    # - each forward pairs with its own recompute: leaving recompute() drops what was kept, and a second
    #   forward() before the recompute is a RuntimeError (several micro-batches per step alternate them).
    @contextlib.contextmanager
    def forward(
        self,
        record: Record = "density",
        save_outputs: bool = False,
        documents: Documents | None = None,
        seed: int = 0,
    ) -> Iterator[None]:
        """Run the model's forward inside: layers estimate, record ``record`` ("off", "density" or
        "recall": about one more estimation pass per layer) and, when checkpointed, keep their
        patterns (and with ``save_outputs`` their (out, lse)) for the next ``recompute()``.
        ``documents``: the packed documents of this forward (global boundaries), kept for its recompute.
        ``seed``: which query rows recall measures (``pattern_recall``); the same on every rank."""
        if save_outputs and not self.checkpointed:
            raise ValueError("save_outputs needs checkpointed layers: only a recomputed forward reuses saved outputs")
        if self._kept is not None:
            raise RuntimeError(
                "attention.forward() entered again before the last forward's backward ran inside attention.recompute()"
            )
        grad = self.checkpointed and torch.is_grad_enabled()
        keep = _Kept(outputs={} if save_outputs else None, documents=documents) if grad else None
        with self._running(_Pass(record=record, keep=keep, documents=documents, seed=seed)):
            yield
        self._kept = keep

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        """Run the backward inside: checkpointed layers re-run their forward with what the last forward kept
        (without anything kept they estimate again, recording nothing); leaving drops what is left of it."""
        kept, self._kept = self._kept, None
        try:
            with self._running(_Pass(replay=kept, documents=None if kept is None else kept.documents)):
                yield
        finally:
            self._hold_walks(None)

    def end_step(self) -> StepStats:
        """The pattern stats recorded since the last ``end_step`` (each layer's latest), and forget them."""
        if self._pass is not None:
            raise RuntimeError("attention.end_step() inside a forward() or recompute() block; call it after the step")
        recorded, self._stats = self._stats, {}
        densities = torch.stack([r.density for r in recorded.values()]).tolist() if recorded else []  # one sync
        return StepStats(
            {layer: PatternStats(d, r.recall, r.ran_dense) for (layer, r), d in zip(recorded.items(), densities)}
        )

    @contextlib.contextmanager
    def _running(self, now: _Pass) -> Iterator[None]:
        if self._pass is not None:
            raise RuntimeError("attention.forward() and attention.recompute() blocks do not nest; close one first")
        self._pass = now
        try:
            yield
        finally:
            self._pass = None

    # ------------------------------------------------------------------ one layer
    def attend(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float, position_ids: Tensor | None = None
    ) -> Tensor:
        """Layer ``layer``'s causal attention [B, S, Hq, D] of q [B, S, Hq, D], k/v [B, S, Hkv, D] (this
        rank's shard in the layout), as the current pass says (``position_ids``: the model's, read for
        packed documents on one device, module docstring)."""
        now = self._pass or _Pass()
        cp = self.cp_size > 1
        documents = now.documents
        if documents is None and position_ids is not None and q.shape[1] == k.shape[1] > 0:
            documents = self._position_documents_of(position_ids, q)
        config = self.sparse_for(layer, self.layout.seq_len if cp else k.shape[1])
        if now.replay is not None:
            pattern, reuse = now.replay.take(layer, config is not None)
        else:
            pattern = None if config is None else self._decide(config, layer, q, k, scale, now, documents)
            reuse = None
        if cp:
            out, lse = ring_attention(
                q,
                k,
                v,
                self.group,
                self.layout,
                pattern=pattern,
                softmax_scale=scale,
                return_lse=True,
                backend=self.backend,
                layer_idx=layer,
                ring="allgather" if self.context_mode == "allgather" else self.ring,
                inner_size=self.inner_size if self.ring == "hierarchical" and self.context_mode == "ring" else None,
                reuse=reuse,
                documents=documents,
            )
        else:
            out, lse = sparse_attention(
                q,
                k,
                v,
                pattern,
                softmax_scale=scale,
                return_lse=True,
                backend=self._single_device_backend(q, k, pattern, documents),
                reuse=reuse,
                documents=documents,
            )
        if pattern is not None and now.keep is not None:  # the recompute builds this forward's walks again
            pattern.index_cache.clear()
        elif now.replay is not None:
            self._hold_walks(pattern)
        if now.keep is not None:
            now.keep.put(layer, config is not None, pattern, out, lse)
        return out

    def _single_device_backend(
        self, q: Tensor, k: Tensor, pattern: VerticalSlashPattern | None, documents: Documents | None
    ) -> str:
        """The backend of a single-device call: ``backend``, but where it is "fa4" only the calls inside fa4's scope
        run on it and every other call runs on "triton" (the rule of ``backend``, class docstring)."""
        if self.backend != "fa4":
            return self.backend
        resolved = resolve_documents(documents, q.shape[0], span=(0, k.shape[1] - 1))
        return "triton" if fa4.out_of_scope(q, k, pattern, False, resolved) else "fa4"

    def _hold_walks(self, pattern: VerticalSlashPattern | None) -> None:
        """Inside ``recompute()``: drop the kernels' walks of the layer recomputed before (the backward reaches a
        checkpointed layer only after the later layers' backward) and keep ``pattern``'s until the next."""
        if self._replayed is not None and self._replayed is not pattern:
            self._replayed.index_cache.clear()
        self._replayed = pattern

    def _position_documents_of(self, position_ids: Tensor, q: Tensor) -> Documents | None:
        """The documents that ``position_ids`` [B or 1, S] (this rank's shard) mark on the global sequence (None:
        one document per row), read once per position-id tensor: one host read, and under context parallelism
        a gather of every rank's ids (module docstring)."""
        held = self._position_documents
        if held is None or held[0] is not position_ids or held[1] != position_ids._version:
            documents = self._read_position_documents(position_ids, q)
            held = (position_ids, position_ids._version, documents)
            self._position_documents = held
        return held[2]

    def _read_position_documents(self, ids: Tensor, q: Tensor) -> Documents | None:
        """``_position_documents_of`` without the cache."""
        ids = ids[None] if ids.dim() == 1 else ids
        if self.cp_size > 1:  # every rank checks the same shapes before the gather (a mismatch would hang it)
            fields = {
                "position_ids": (tuple(ids.shape), str(ids.dtype)),
                "q shape": tuple(q.shape),
                "layout": self.layout,
            }
            check_ranks_agree(self.group, q.device, "position ids", fields)  # see Note [ring agreement]
        if ids.dim() != 2 or ids.shape[1] != q.shape[1] or ids.shape[0] not in (1, q.shape[0]):
            raise ValueError(
                f"position_ids {tuple(ids.shape)} do not fit the layer's queries {tuple(q.shape[:2])} [batch, tokens]: "
                "pass one id per token of this rank's shard, one row for the batch or one per batch row"
            )
        if self.cp_size == 1:
            return resolve_documents(Documents.from_position_ids(ids), q.shape[0], q.shape[1])
        layout = self.layout
        if ids.shape[1] != layout.local_len:
            raise ValueError(
                f"this rank holds {ids.shape[1]} tokens but the {layout.name} layout of seq_len {layout.seq_len} over "
                f"{self.cp_size} ranks gives {layout.local_len}; shard the full sequence with layout.shard(x, rank)"
            )
        global_ids = layout.all_gather(ids.to(q.device), self.group, dim=1).cpu()
        documents = Documents.from_position_ids(global_ids)  # refuses what it cannot read, on every rank alike
        local_index = layout.owner(torch.arange(layout.seq_len))[1]
        if torch.equal(global_ids.long(), local_index.expand_as(global_ids)):
            raise ValueError(
                f"the position ids count 0..{layout.local_len - 1} on each of the {self.cp_size} context-parallel "
                "ranks: each rank passed the positions of its own shard (what a Hugging Face model makes without "
                "position_ids), not its part of the global sequence's; pass position_ids=layout.shard(global ids, "
                "rank) (layout.positions(rank)[None] for one document), or the packed documents with "
                "attention.forward(documents=Documents.from_cu_seqlens(...))"
            )
        return resolve_documents(documents, q.shape[0], layout.seq_len)

    def _decide(
        self,
        config: PatternConfig,
        layer: int,
        q: Tensor,
        k: Tensor,
        scale: float,
        now: _Pass,
        documents: Documents | None,
    ) -> VerticalSlashPattern | None:
        """This layer's pattern for this call (None: run dense), with its stats recorded as ``now`` asks
        (density: of the pairs within ``documents``, what dense attention computes)."""
        q, k = q.detach(), k.detach()
        cp = self.cp_size > 1
        if cp:
            pattern = estimate_pattern_cp(
                q, k, config, self.group, self.layout, layer_idx=layer, softmax_scale=scale, documents=documents
            )
        else:
            pattern = estimate_pattern(q, k, config, layer_idx=layer, softmax_scale=scale, documents=documents)
        record = now.record
        measured = record != "off" or self.max_density is not None
        density = pattern.density(documents).mean() if measured else None
        # the same decision on every rank: the pattern, so its density, is global; read here only to decide
        ran_dense = self.max_density is not None and float(density) > self.max_density
        if record != "off":
            recall = None
            if record == "recall":
                group, layout = (self.group, self.layout) if cp else (None, None)
                recall = pattern_recall(q, k, pattern, config.last_q, scale, group, layout, documents, seed=now.seed)
            self._stats[layer] = _Recorded(density, recall, ran_dense)
        return None if ran_dense else pattern

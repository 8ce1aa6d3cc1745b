"""The training config: a validated YAML file plus ``key=value`` overrides from the command line.

Every section rejects unknown keys; combinations that cannot run (a sequence the layout cannot
split, a world size that is not data x context, ...) fail at load or at start with a message that
names the fix.
"""

from __future__ import annotations

import difflib
import os
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    PrivateAttr,
    ValidationError,
    model_validator,
)

from ..models.loader import Init, check_hf_fields, refuse_gguf
from ..ops.estimate.estimator import PatternConfig
from ..ops.sparse.block_lists import FA4_TILE
from ..parallel.layout import make_layout


class _Section(BaseModel):
    # every number must be finite: a NaN or infinite learning rate, scale or size never runs
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ModelSection(_Section):
    """Which model: a local Hugging Face directory, or an architecture config with random weights."""

    path: str | None = None
    """Local HF directory with config.json and *.safetensors (no network)."""
    config: dict[str, Any] | None = None
    """HF config fields including ``model_type`` (qwen2, qwen3, llama, mistral): random init."""
    init: Init = "hf"
    """Random weights (model.config) only: ``hf`` as transformers draws them; ``depth_scaled`` also draws the
    attention and MLP output projections with std initializer_range / sqrt(2 x layers) (GPT-2, torchtitan),
    which lets deep or wide models from scratch learn to copy from context much sooner."""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Compute dtype; master weights, gradients reduction and optimizer state stay float32."""
    rope_theta: PositiveFloat | None = None
    """New RoPE base (context extension), e.g. 1e6 when training 8x longer than pre-training."""
    rope_parameters: dict[str, Any] | None = None
    """Extra RoPE fields merged into the HF config's ``rope_parameters`` (rope_type, factor, ...)."""
    overrides: dict[str, Any] = {}
    """HF config fields set when the config is built, over config.json or model.config: rope_theta,
    rope_scaling (a dict, as in older config.json files), sliding_window, use_sliding_window,
    attention_dropout, max_position_embeddings, ... Unknown field names are refused."""

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if (self.path is None) == (self.config is None):
            raise ValueError("set exactly one of model.path (a local HF directory) or model.config (random init)")
        if self.path is not None:
            refuse_gguf(self.path, "model.path")
        if self.path is not None and self.init != "hf":
            raise ValueError(
                f"model.init={self.init} draws random weights; model.path loads trained ones: remove model.init"
            )
        if self.config is not None and "model_type" not in self.config:
            raise ValueError("model.config needs a model_type, e.g. model_type: qwen2")
        if self.rope_theta is not None and "rope_theta" in self.overrides:
            raise ValueError("model.rope_theta and model.overrides.rope_theta both set the RoPE base; keep one")
        if self.config is not None:
            check_hf_fields(self.config, "model.config.")
        check_hf_fields(self.overrides, "model.overrides.")
        return self

    def hf_kwargs(self) -> dict[str, Any]:
        """Arguments of mtraining.models.build_model / build_config for this model (the trainer adds ``init``)."""
        return dict(
            path=self.path,
            config=self.config,
            rope_theta=self.rope_theta,
            rope_parameters=self.rope_parameters,
            overrides=self.overrides,
        )

    @property
    def changes_rope(self) -> bool:
        """Whether the config changes the model's RoPE (base, scaling or type)."""
        rope_keys = {"rope_theta", "rope_scaling", "rope_parameters"}
        return self.rope_theta is not None or bool(self.rope_parameters) or bool(rope_keys & set(self.overrides))


class AttentionSection(_Section):
    """How attention runs: dense or dynamic sparse, context-parallel layout, pattern budgets."""

    sparse: bool = True
    layout: Literal["contiguous", "zigzag", "striped"] = "striped"
    block_size: PositiveInt = 128
    """Kernel/pattern block G; the layout deals stripes of G tokens."""
    backend: Literal["auto", "torch", "triton", "fa4"] = "auto"
    """auto: triton on CUDA, torch (plain PyTorch) on the CPU. fa4: each sparse single-device call that
    FlashAttention-4's block-sparse kernels cover (default positions with as many queries as keys, no packed
    documents, no per-block columns, block_size a multiple of 128) runs its selected blocks on them and its
    verticals on triton; every other call runs on triton (dense layers and short sequences: the dense path;
    data.document_masking's packed documents). One CUDA device per sequence (parallel.context 1), bfloat16,
    block_columns 0, block_size a multiple of 128, ``pip install flash-attn-4`` (models/attention.py,
    ``Attention.backend``)."""
    v_size: PositiveInt = 1024
    """Vertical lines kept per head."""
    s_size: PositiveInt = 6144
    """Slash lines kept per head."""
    last_q: PositiveInt = 64
    """Queries that estimate the pattern (the last of the sequence)."""
    sink_tokens: int = Field(4, ge=0)
    local_window: int = Field(128, ge=0)
    threshold: float | None = Field(None, gt=0, le=1)
    """Keep the fewest lines reaching this estimated attention mass instead of fixed budgets."""
    budgets: str | None = None
    """Pattern file with per-layer/per-head budgets (mtraining.ops.estimate.budgets)."""
    block_columns: int = Field(0, ge=0)
    """Key columns chosen per query block of block_size rows on top of the lines (questions asked
    mid-document keep their evidence). 0: none."""
    column_scorer: Literal["sorted", "dense"] = "sorted"
    """How block columns' candidates are scored: sorted (each hash table's keys sorted by code, only the
    candidate pairs scored: work grows with them) or dense (every pair scored, then masked: quadratic)."""
    column_cap: int = Field(0, ge=0)
    """sorted only: a row meets at most this many keys per hash table, those of its bucket nearest its block
    (bounds the work where most keys share a bucket, but drops candidates: 0, no cap, keeps the dense scorer's
    columns)."""
    dense_layers: list[int] = []
    """Layers that always run dense attention."""
    min_sparse_len: int = Field(0, ge=0)
    """Sequences shorter than this run dense (sparse does not pay there)."""
    max_density: float | None = Field(0.6, gt=0, le=1)
    """A layer whose estimated pattern keeps more than this fraction of the causal pairs runs dense
    for that step: the sparse kernels are slower than dense attention (cuDNN on GPUs) there. The
    metrics count such layers (dense_fallback). null: always sparse."""

    def pattern_config(self) -> PatternConfig | None:
        """The estimation config of this section (None when attention is dense), for the trainer and the checks."""
        if not self.sparse:
            return None
        sizes = {"v_size": self.v_size, "s_size": self.s_size} if self.budgets is None else {}
        return PatternConfig.from_settings(
            budgets=self.budgets,
            **sizes,
            last_q=self.last_q,
            block_size=self.block_size,
            sink_tokens=self.sink_tokens,
            local_window=self.local_window,
            threshold=self.threshold,
            block_columns=self.block_columns,
            column_scorer=self.column_scorer,
            column_cap=self.column_cap,
        )


class ParallelSection(_Section):
    data: PositiveInt = 1
    """Data-parallel (FSDP2) degree."""
    context: PositiveInt = 1
    """Context-parallel degree: ranks that share one sequence."""
    timeout_minutes: PositiveFloat = 10.0
    """How long a rank waits in a collective for the others before the run stops with exit code 4
    (a rank stopped responding). Covers the slowest step and the longest wait on rank 0 (saving the
    export); a watchdog reports a step running 10x longer than usual before that (train/watchdog.py)."""
    context_mode: Literal["ring", "allgather"] = "ring"
    """ring: K/V travel around a ring of the context ranks (``parallel.ring``), each transfer hidden behind a
    step of compute; allgather: each layer all-gathers the whole sequence's K/V once (and again in the
    backward), attends this rank's queries to them and reduce-scatters dK/dV: no overlap, the full K/V of
    one layer in memory (DESIGN.md, "All-gather context parallelism")."""
    ring: Literal["auto", "flat", "hierarchical"] = "auto"
    """auto: hierarchical where the ring cost model predicts it pays (context ranks on several nodes and a
    link between them slow enough, ``inter_node_gbps``), flat otherwise (train/ring_choice.py; the start-up
    summary says which and why); flat: one ring of all context ranks; hierarchical: an inner ring of
    ``inner_size`` ranks per node inside an outer ring across nodes (the slow link hidden behind a whole
    inner cycle)."""
    inner_size: PositiveInt | None = None
    """Ranks per inner ring (hierarchical, and the node size that auto judges); default: the ranks per node
    (torchrun's LOCAL_WORLD_SIZE)."""
    inter_node_gbps: PositiveFloat = 25.0
    """Bandwidth between nodes per GPU and direction in GB/s that ``ring: auto`` predicts with (25: HDR
    InfiniBand, one NIC per GPU)."""

    @model_validator(mode="after")
    def _check_ring(self) -> ParallelSection:
        if self.context_mode == "allgather" and self.ring == "hierarchical":
            raise ValueError(
                "parallel.ring=hierarchical is a ring schedule, but parallel.context_mode=allgather runs no ring: "
                "set parallel.context_mode=ring, or drop parallel.ring"
            )
        if self.inner_size is None:
            return self
        if self.ring == "flat":
            raise ValueError(
                "parallel.inner_size sizes the inner rings of parallel.ring=hierarchical (or auto); set both"
            )
        if self.context % self.inner_size:
            raise ValueError(
                f"parallel.inner_size ({self.inner_size}) must divide parallel.context ({self.context}): "
                f"use one of {_divisors(self.context)}"
            )
        return self


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class SourceSpec(_Section):
    """One data.sources entry with options (a plain string is ``{path: STRING}``)."""

    path: str
    """A file, glob, folder or saved ``datasets`` folder."""
    weight: PositiveFloat | None = None
    """Share of the drawn samples (normalised over the sources); give every source a weight or none."""
    text_field: str | None = None
    """JSONL / parquet / Arrow field holding the text; default data.text_field."""


class DataSection(_Section):
    sources: list[str | SourceSpec] = Field(min_length=1)
    """Each entry one source: a path, glob or folder of text (.txt/.md, .jsonl(.gz), .parquet, .arrow,
    saved ``datasets`` folders) or token files (.npy/.bin), or ``{path, weight, text_field}``. Without
    weights sources are drawn in proportion to their size."""
    seq_len: PositiveInt
    tokenizer: str | None = None
    """tokenizer.json or a HF directory; default: model.path."""
    text_field: str = "text"
    token_dtype: Literal["uint16", "uint32", "int32", "int64"] = "uint32"
    """Element type of raw .bin token files."""
    separator: str | None = None
    """Token string placed between documents; default: the tokenizer's EOS."""
    batch_size: PositiveInt = 1
    """Sequences per data-parallel rank per micro-batch."""
    global_batch_tokens: PositiveInt | None = None
    """Tokens per optimizer step over all ranks; sets the micro-batches per step (train.grad_accum) to
    global_batch_tokens / (parallel.data x batch_size x seq_len), which must be a whole number."""
    shuffle: bool = True
    cache_dir: str | None = None
    """Token cache (text tokenised once, keyed by content and tokenizer); default $MTRAINING_CACHE or
    ~/.cache/mtraining."""
    document_masking: bool = False
    """Attend only within each packed document: a document ends after every separator token (data.separator,
    default the tokenizer's EOS; token files need data.tokenizer to name it). A document cut by a sample
    boundary continues as its own document in the next sample."""
    reset_position_ids: bool = False
    """With document_masking: position ids (RoPE) restart at 0 in every document."""

    @model_validator(mode="after")
    def _check_weights(self) -> DataSection:
        weighted = [s.weight is not None for s in self.source_specs]
        if any(weighted) and not all(weighted):
            missing = [s.path for s in self.source_specs if s.weight is None]
            raise ValueError(f"data.sources: give every source a weight or none (no weight: {missing})")
        if self.reset_position_ids and not self.document_masking:
            raise ValueError(
                "data.reset_position_ids restarts positions at document boundaries, which only exist with "
                "data.document_masking: true; set both or neither"
            )
        return self

    @property
    def source_specs(self) -> list[SourceSpec]:
        return [SourceSpec(path=s) if isinstance(s, str) else s for s in self.sources]


class OptimSection(_Section):
    lr: PositiveFloat = 3e-4
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Cosine decay ends at lr * min_lr_ratio."""
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.95)
    eps: PositiveFloat = 1e-8
    grad_clip: float | None = Field(1.0, gt=0)


class TrainSection(_Section):
    steps: PositiveInt
    grad_accum: PositiveInt = 1
    """Micro-batches per optimizer step (or set data.global_batch_tokens); the loss is normalised by the
    tokens of all of them, so the gradients equal those of one large batch."""
    defer_grad_sync: bool = False
    """With grad_accum > 1: reduce gradients once per step instead of after every micro-batch (FSDP2
    set_requires_gradient_sync). Saves grad_accum - 1 reduce-scatters per step but holds an unsharded
    float32 copy of all gradients on every rank (12 GB for a 3B model): worth it for short sequences
    with many micro-batches, not at long context where memory is short and compute hides the reduction."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """cuda: one GPU per rank (NCCL); cpu: gloo; auto: CUDA when available."""
    seed: int = Field(0, ge=0, lt=2**63)
    activation_checkpointing: bool = True
    loss_chunk_tokens: PositiveInt = 4096
    """Rows of logits materialised at once by the chunked cross-entropy."""
    loss_impl: Literal["chunked", "liger"] = "chunked"
    """Cross-entropy: our chunked one (any device) or liger-kernel's fused kernel (CUDA, if installed)."""
    save_attention_outputs: bool | Literal["auto"] = "auto"
    """With activation checkpointing: keep each layer's attention output and LSE from the forward so
    the recomputed forward skips the attention kernels (faster backward; costs seq_len x heads x
    (head_dim x 2 + 4) bytes per layer per rank, 545 MB at 128K tokens for Qwen2.5-3B). auto: on a
    GPU, from the second step on when the first step's peak plus all saved outputs fits in 90% of
    its memory (saved_outputs.py); off on the CPU and without activation checkpointing."""
    fused_kernels: Literal["none", "liger"] = "none"
    """liger: liger-kernel's fused RMSNorm, SwiGLU and RoPE in the decoder layers (CUDA; pip install
    liger-kernel); none: the model's own modules."""
    compile: bool = False
    """torch.compile each decoder layer (as torchtitan does: one compiled block per layer, inside activation
    checkpointing and FSDP): norms, projections, RoPE and the MLP fuse; the attention call stays eager (a
    graph break: its kernels, rings and host-side plans run as without compile). The first step compiles."""
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """torch.compile's backend for ``compile``: inductor (fused kernels), or aot_eager / eager (trace only: what
    compile changes without code generation, for debugging and fast checks)."""

    @model_validator(mode="after")
    def _check_options(self) -> TrainSection:
        if self.save_attention_outputs is True and not self.activation_checkpointing:
            raise ValueError(
                "train.save_attention_outputs skips the recomputation of activation checkpointing: "
                "set train.activation_checkpointing=true, or train.save_attention_outputs=false"
            )
        if self.fused_kernels == "liger" and self.device == "cpu":
            raise ValueError(
                "train.fused_kernels=liger runs Triton kernels on CUDA only: "
                "set train.fused_kernels=none for train.device=cpu"
            )
        return self


class CheckpointSection(_Section):
    dir: str | None = None
    """Where distributed checkpoints go (step_N subfolders); None: never saved."""
    every: PositiveInt | None = None
    """Save every N steps (and always after the last step when dir is set)."""
    resume: bool = True
    """Continue from the newest checkpoint in dir if there is one."""
    keep: PositiveInt | None = None
    """Keep only the newest N checkpoints that verify: older ones are deleted after each save (train/retention.py);
    one that does not verify is never deleted. None: keep every checkpoint."""
    export_dir: str | None = None
    """Write the final weights as a HF directory here."""
    allow_changed_schedule: bool = False
    """Resume although train.steps or an optim setting differs from the checkpoint's run (the learning
    rate of the next step then jumps); refused otherwise (train/resume.py)."""
    allow_changed_model: bool = False
    """Resume although the model config (same parameter shapes, e.g. another rope_theta) or the
    tokenizer differs from the checkpoint's; refused otherwise. Another model is always refused."""
    export_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """dtype of the exported weights; auto: the training dtype (model.dtype)."""


class WandbSection(_Section):
    """Weights & Biases logging beside metrics.jsonl and TensorBoard (pip install -e ".[wandb]")."""

    project: str
    entity: str | None = None
    name: str | None = None
    """Run name; default: the run id."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """offline: write to log.dir/wandb and sync later (wandb sync); disabled: no-op."""
    tags: list[str] = []


class LogSection(_Section):
    dir: str | None = None
    """metrics.jsonl and TensorBoard files; None: console only."""
    every: PositiveInt = 1
    recall: bool = True
    """On logged steps, also measure each sparse layer's pattern recall: the mean over all query rows of
    the attention probability its pattern keeps, estimated on ``last_q`` rows drawn at random with the step
    as seed (held out from the estimation's last rows, except by chance). One more pass of ``last_q`` rows
    over the keys per layer, timed as part of the step."""
    tensorboard: bool = True
    wandb: WandbSection | None = None
    progress: bool = True
    """A progress bar, when the output is a terminal (never in log files)."""
    peak_tflops: PositiveFloat | None = None
    """Peak dense TFLOP/s of one device for MFU; default: known GPUs, none on CPU."""
    profile_step: PositiveInt | None = None
    """Run this step (1-based) under torch.profiler; each rank writes a Chrome trace and a table of
    the costliest ops into ``log.dir`` (mtraining/train/profile.py)."""

    @model_validator(mode="after")
    def _profile_needs_dir(self) -> LogSection:
        if self.profile_step is not None and self.dir is None:
            raise ValueError(
                "log.profile_step writes its trace into log.dir: set log.dir (for example log.dir=runs/profile)"
            )
        return self


class Config(_Section):
    model: ModelSection
    data: DataSection
    train: TrainSection
    attention: AttentionSection = AttentionSection()
    parallel: ParallelSection = ParallelSection()
    optim: OptimSection = OptimSection()
    checkpoint: CheckpointSection = CheckpointSection()
    log: LogSection = LogSection()
    _relative_to: dict[str, str] = PrivateAttr(default_factory=dict)
    """Path keys whose value was written relative, and what it is relative to (``path_note``)."""

    def path_note(self, key: str) -> str:
        """Where a relative path of ``key`` (e.g. ``checkpoint.dir``, ``data.sources[0]``) came from, for
        messages about a path that is wrong: '' when it was written absolute."""
        origin = self._relative_to.get(key)
        return f" ({origin})" if origin else ""

    @model_validator(mode="after")
    def _combinations(self) -> Config:
        att, seq = self.attention, self.data.seq_len
        try:
            make_layout(att.layout, seq, self.parallel.context, att.block_size)
        except ValueError as err:
            raise ValueError(f"data.seq_len: {err} (or change attention.layout / attention.block_size)") from None
        if att.sparse:
            self._check_pattern()
        if self.optim.warmup_steps > self.train.steps:
            raise ValueError(
                f"optim.warmup_steps ({self.optim.warmup_steps}) exceeds train.steps ({self.train.steps}); lower it"
            )
        self._check_backend()
        if self.checkpoint.dir is None and (unused := [k for k in ("every", "keep") if getattr(self.checkpoint, k)]):
            raise ValueError(f"checkpoint.{unused[0]} is set but checkpoint.dir is not; set checkpoint.dir")
        if any(layer < 0 for layer in att.dense_layers):
            raise ValueError(f"attention.dense_layers must be layer indices >= 0, got {att.dense_layers}")
        layers = self.model.overrides.get("num_hidden_layers", (self.model.config or {}).get("num_hidden_layers"))
        if layers is not None:
            self.check_layers(layers)
        self._check_global_batch()
        return self

    def _check_backend(self) -> None:
        """attention.backend=fa4 only where it can run: one device per sequence, CUDA, bfloat16, blocks FA4 computes
        whole (flash-attn-4 itself is checked with the other packages, train/check.py)."""
        if self.attention.backend != "fa4":
            return
        fix = "or set attention.backend=triton"
        if self.parallel.context > 1:
            raise ValueError(
                f"attention.backend=fa4 runs single-device calls only, but parallel.context is {self.parallel.context} "
                f"(the ring steps' positions are strided by the layout); set attention.backend=triton"
            )
        if self.train.device == "cpu":
            raise ValueError(f"attention.backend=fa4 runs FlashAttention-4 on CUDA: set train.device=cuda, {fix}")
        if self.model.dtype != "bfloat16":
            raise ValueError(
                f"attention.backend=fa4 runs FlashAttention-4 in bfloat16, not {self.model.dtype}: set "
                f"model.dtype=bfloat16, {fix}"
            )
        att = self.attention
        if att.block_columns > 0 or att.block_size % FA4_TILE:
            raise ValueError(
                "attention.backend=fa4 runs whole blocks of 128 on FlashAttention-4, which computes no per-block "
                f"columns: set attention.block_columns=0 and a block_size that is a multiple of {FA4_TILE} (got "
                f"block_columns {att.block_columns}, block_size {att.block_size}), {fix}"
            )

    def check_layers(self, num_layers: int) -> None:
        """Fail unless every layer named in attention.dense_layers exists in a model of ``num_layers``."""
        missing = [layer for layer in self.attention.dense_layers if layer >= num_layers]
        if missing:
            raise ValueError(
                f"attention.dense_layers names layers {missing} but the model has {num_layers} "
                f"(0 to {num_layers - 1}); drop them from attention.dense_layers"
            )

    def _check_global_batch(self) -> None:
        d, accum = self.data, self.train.grad_accum
        if d.global_batch_tokens is None:
            return
        micro = self.parallel.data * d.batch_size * d.seq_len
        if d.global_batch_tokens % micro:
            fit = max(1, round(d.global_batch_tokens / micro)) * micro
            raise ValueError(
                f"data.global_batch_tokens ({d.global_batch_tokens}) must be a multiple of the tokens of one "
                f"micro-batch, parallel.data x data.batch_size x data.seq_len = {micro}; e.g. {fit}"
            )
        if accum != 1 and accum != d.global_batch_tokens // micro:
            raise ValueError(
                f"train.grad_accum ({accum}) contradicts data.global_batch_tokens ({d.global_batch_tokens} = "
                f"{d.global_batch_tokens // micro} micro-batches of {micro} tokens); set only one of them"
            )

    @property
    def micro_batches(self) -> int:
        """Micro-batches per optimizer step (train.grad_accum, or from data.global_batch_tokens)."""
        d = self.data
        if d.global_batch_tokens is not None:
            return d.global_batch_tokens // (self.parallel.data * d.batch_size * d.seq_len)
        return self.train.grad_accum

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step over all ranks."""
        return self.parallel.data * self.data.batch_size * self.data.seq_len * self.micro_batches

    def inner_size(self, local_world_size: int | None, ring: str | None = None) -> int:
        """Ranks per inner ring of ``ring`` (default parallel.ring; "auto" must be resolved first,
        train/ring_choice.py): parallel.inner_size, else the ranks per node capped at the ring; the flat
        ring is one inner ring of all context ranks. Raises naming the values that work."""
        p = self.parallel
        ring = ring or p.ring
        if ring == "auto":
            raise ValueError("parallel.ring=auto is resolved by train/ring_choice.py before the ring is shaped")
        if ring == "flat":
            return p.context
        if p.inner_size is not None:
            return p.inner_size
        if local_world_size is None:
            raise ValueError(
                "parallel.ring=hierarchical needs the ranks per node: launch with torchrun (it sets "
                f"LOCAL_WORLD_SIZE) or set parallel.inner_size to one of {_divisors(p.context)}"
            )
        inner = min(local_world_size, p.context)
        if p.context % inner:
            raise ValueError(
                f"parallel.ring=hierarchical: {local_world_size} ranks per node do not tile parallel.context "
                f"({p.context}); set parallel.inner_size to one of {_divisors(p.context)}, or launch a number of "
                "ranks per node that divides it"
            )
        return inner

    def _check_pattern(self) -> None:
        att, seq = self.attention, self.data.seq_len
        given = [name for name in ("v_size", "s_size") if name in att.model_fields_set]
        if att.budgets is not None and given:
            raise ValueError(
                f"attention: set either budgets or {' and '.join(given)}, not both: the budgets file replaces "
                f"v_size and s_size; remove attention.{given[0]}"
            )
        sizes = {"v_size": att.v_size, "s_size": att.s_size} if att.budgets is None else {}
        # a budgets file's sizes are checked against the sequence per layer when the pattern is estimated
        sizes["last_q"] = att.last_q
        for name, value in sizes.items():
            if value > seq:
                raise ValueError(f"attention.{name} ({value}) exceeds data.seq_len ({seq}); lower it to at most {seq}")
        try:
            att.pattern_config()
        except ValueError as err:
            raise ValueError(f"attention: {err}") from None

    @property
    def world_size(self) -> int:
        return self.parallel.data * self.parallel.context

    def check_world_size(self, world_size: int) -> None:
        """Fail unless the launched ranks form the data x context mesh."""
        if world_size != self.world_size:
            p = self.parallel
            launch = f"launch {self.world_size} ranks (mtraining train --nproc {self.world_size}, or torchrun --nproc_per_node {self.world_size})"
            if world_size % p.context == 0:
                hint = f"set parallel.data={world_size // p.context} or {launch}"
            else:
                fit = f"a divisor of {world_size}" if world_size > 1 else "1"
                hint = f"{launch}, or set parallel.context to {fit}"
            raise ValueError(
                f"the launch has {world_size} ranks but parallel.data x parallel.context = {p.data} x {p.context} "
                f"= {self.world_size}; {hint}"
            )


class ConfigError(ValueError):
    """A config that cannot run; the message names the fix."""


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader refusing a key given twice in one mapping (YAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in lines:
                raise ConfigError(
                    f"the key {key!r} is given twice (lines {lines[key]} and {line}); YAML would keep the last "
                    "alone: merge them into one"
                )
            lines[key] = line
        return super().construct_mapping(node, deep)


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeys)  # noqa: S506 - a SafeLoader


_OVERRIDE = re.compile(r"^[A-Za-z_]\w*(\.\w+)+=")
"""``section.key=value``: how every command's overrides look (a path that looks so can be written ./a.b=c)."""


def split_overrides(args: list[str] | None) -> tuple[list[str], list[str]]:
    """(the other arguments, the ``section.key=value`` overrides) of a command's positional arguments."""
    args = args or []
    return [a for a in args if not _OVERRIDE.match(a)], [a for a in args if _OVERRIDE.match(a)]


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set ``section.key=value`` entries (values parsed as YAML) on a nested dict, returning a copy."""
    out = yaml.safe_load(yaml.safe_dump(raw)) or {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value, e.g. train.steps=10")
        node = out
        *parents, leaf = key.strip().split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
            node = child
        try:
            node[leaf] = _load_yaml(value)
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or err
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({problem}); fix or quote it") from None
        except ConfigError as err:
            raise ConfigError(f"override {item!r}: {err}") from None
    return out


def _yaml_problem(err: yaml.YAMLError) -> str:
    """What a YAML parser error says, with its line and column (1-based)."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else problem


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The section model inside an annotation (``X``, ``X | None``, ``list[str | X]``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for arg in typing.get_args(annotation) if (m := _model_in(arg)) is not None), None)


def _union_tag(part: Any) -> bool:
    """Whether a location part is the name pydantic gives a member of a union (``str``, ``SourceSpec``)."""
    return part == "str" or (isinstance(part, str) and part[:1].isupper())


def _section_of(loc: tuple) -> type[BaseModel] | None:
    """The section model that holds the key at ``loc`` (a pydantic error location), if one does."""
    model: type[BaseModel] | None = Config
    for part in loc[:-1]:
        if isinstance(part, str) and not _union_tag(part):
            field = model.model_fields.get(part) if model is not None else None
            model = _model_in(field.annotation) if field is not None else None
    return model


def _did_you_mean(loc: tuple) -> str:
    """'; did you mean train.steps?' for an unknown key close to one of its section's keys (difflib)."""
    model = _section_of(loc)
    if model is None:
        return ""
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.6)
    return f"; did you mean {_dotted((*loc[:-1], close[0]))}?" if close else ""


def _dotted(loc: tuple) -> str:
    """A location as a config spells it: data.sources[0].weight."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _union_tag(part):
            out += f".{part}" if out else str(part)
    return out


def _meant(err: ValidationError) -> list[dict[str, Any]]:
    """The errors of a failed validation; of a union (``str | SourceSpec``) only the member that was meant: the
    mapping's errors when a mapping was given, not the string member's complaint about it."""
    errors = err.errors()
    mapped = {e["loc"][:-1] for e in errors if "str" not in e["loc"]}
    return [
        e
        for e in errors
        if not (e["loc"][-1:] == ("str",) and any(m[: len(e["loc"]) - 1] == e["loc"][:-1] for m in mapped))
    ]


def _problems(err: ValidationError) -> list[str]:
    """One line per problem of a failed validation, naming the key and the fix."""
    lines = []
    for e in _meant(err):
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key; remove it or fix its spelling" + _did_you_mean(e["loc"])
        lines.append(f"{_dotted(e['loc']) or 'config'}: {msg}")
    return list(dict.fromkeys(lines))


def _format(problems: list[str]) -> str:
    return "invalid config:\n" + "\n".join(f"  {line}" for line in problems)


def parse_config(raw: dict[str, Any], overrides: list[str] = ()) -> Config:
    """Validate a config dict (after overrides); raise ConfigError listing every problem."""
    try:
        return Config.model_validate(apply_overrides(raw, list(overrides)))
    except ValidationError as err:
        raise ConfigError(_format(_problems(err))) from None


def parse_config_partly(data: dict[str, Any]) -> tuple[Config | None, list[str]]:
    """(the config, every problem) of a config dict whose overrides are applied. Invalid keys are dropped,
    one round at a time, so that ``mtraining check`` can go on checking the rest; None when a problem
    cannot be dropped (a required key, a combination of keys). The problems of every round are returned."""
    data = yaml.safe_load(yaml.safe_dump(data)) or {}
    problems: list[str] = []
    for _ in range(4):
        try:
            return Config.model_validate(data), problems
        except ValidationError as err:
            problems += [p for p in _problems(err) if p not in problems]
            drop = [_droppable(e) for e in _meant(err)]
            if None in drop or not any([_drop(data, loc) for loc in sorted(drop, key=len, reverse=True)]):
                return None, problems
    return None, problems


def _droppable(error: dict[str, Any]) -> tuple | None:
    """What to remove so that an error goes away: the unknown or invalid key, the optional sub-section
    that misses a key (log.wandb without its project); None for a required key or a section's combination."""
    loc, kind = error["loc"], error["type"]
    model = _section_of(loc)
    field = model.model_fields.get(loc[-1]) if model is not None and isinstance(loc[-1], str) else None
    if kind == "extra_forbidden" or (field is not None and not field.is_required()):
        return loc
    return loc[:-1] if kind == "missing" and len(loc) > 2 else None


def _drop(data: dict[str, Any], loc: tuple) -> bool:
    """Remove the entry at ``loc`` from the nested config dict; False where there is none to remove."""
    node: Any = data
    for part in loc[:-1]:
        if isinstance(node, dict) and part in node or isinstance(node, list) and isinstance(part, int):
            node = node[part]
        elif not _union_tag(part):
            return False
    if isinstance(node, dict) and loc[-1] in node:
        del node[loc[-1]]
        return True
    return False


_PATH_KEYS = (
    ("model", "path"),
    ("data", "tokenizer"),
    ("data", "cache_dir"),
    ("attention", "budgets"),
    ("checkpoint", "dir"),
    ("checkpoint", "export_dir"),
    ("log", "dir"),
)


def _path_values(raw: dict[str, Any]) -> dict[str, Any]:
    """Every path of a config dict by key: ``checkpoint.dir``, ``data.sources[0]``, ..."""
    out = {}
    for section, key in _PATH_KEYS:
        if isinstance(raw.get(section), dict) and key in raw[section]:
            out[f"{section}.{key}"] = raw[section][key]
    sources = raw.get("data", {}).get("sources") if isinstance(raw.get("data"), dict) else None
    for i, s in enumerate(sources if isinstance(sources, list) else []):
        out[f"data.sources[{i}]"] = s.get("path") if isinstance(s, dict) else s
    return out


def _relative(value: Any) -> bool:
    return isinstance(value, str) and not os.path.isabs(os.path.expanduser(value))


def shared_values(cfg: Config) -> dict[str, Any]:
    """Every setting that must be the same on every rank, as "section.key" -> value: all but the paths (and
    data.sources' paths), which nodes may spell differently for the same files. What those paths hold is
    compared on its own: the model and tokenizer by the run's identity, the data by each source's size."""
    values = {
        f"{section}.{key}": value
        for section, fields in cfg.model_dump(mode="json").items()
        for key, value in fields.items()
        if (section, key) not in _PATH_KEYS
    }
    values["data.sources"] = [s.model_dump(mode="json", exclude={"path"}) for s in cfg.data.source_specs]
    return values


def resolve_paths(raw: dict[str, Any], base: Path) -> dict[str, Any]:
    """The config with its relative paths (and data.sources) joined to ``base``, the config file's folder.

    Overrides given on the command line are applied afterwards and stay relative to the working directory.
    """

    def fix(value: Any) -> Any:
        if not isinstance(value, str):
            return value
        value = os.path.expanduser(value)
        return value if os.path.isabs(value) else os.path.normpath(base / value)

    out = yaml.safe_load(yaml.safe_dump(raw))
    for section, key in _PATH_KEYS:
        if isinstance(out.get(section), dict) and key in out[section]:
            out[section][key] = fix(out[section][key])
    sources = out.get("data", {}).get("sources") if isinstance(out.get("data"), dict) else None
    if isinstance(sources, list):
        out["data"]["sources"] = [
            {**s, "path": fix(s["path"])} if isinstance(s, dict) and "path" in s else fix(s) for s in sources
        ]
    return out


def read_config(path: str | Path, overrides: list[str] = ()) -> tuple[dict[str, Any], dict[str, str]]:
    """A YAML config file as a dict, its relative paths joined to its folder and ``key=value`` overrides
    applied, and where each path written relative is relative to (``Config.path_note``)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path} is a folder, not a YAML config file; give the config's path (see configs/)")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = _load_yaml(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(err)}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text ({err}); save it as UTF-8") from None
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of sections (model, data, train, ...)")
    folder = path.parent.resolve()
    relative_to = {
        key: f"written relative in {path.name}: relative paths in a config are relative to its folder, {folder}"
        for key, value in _path_values(raw).items()
        if _relative(value)
    }
    data = apply_overrides(resolve_paths(raw, path.parent), list(overrides))
    given = [item.partition("=")[0].strip() for item in overrides]
    for key, value in _path_values(data).items():
        if any(key == g or key.startswith(f"{g}[") or key.startswith(f"{g}.") for g in given):
            relative_to.pop(key, None)
            if _relative(value):
                relative_to[key] = f"given on the command line: relative to the working directory, {Path.cwd()}"
    return data, relative_to


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """Read a YAML config file (relative paths in it are relative to its folder) and apply ``key=value`` overrides."""
    data, relative_to = read_config(path, overrides)
    cfg = parse_config(data)
    cfg._relative_to = relative_to
    return cfg

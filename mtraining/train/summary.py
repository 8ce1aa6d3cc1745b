"""The start-up summary a run prints once: model, world and its context schedule (which ring, and why), layout,
attention per layer, batch, data."""

from __future__ import annotations

from torch import nn

from .config import Config
from .data import Source
from .packing import PackedSamples
from .ring_choice import RingChoice


def _ranges(layers: list[int]) -> str:
    """'0, 2-5, 7' for [0, 2, 3, 4, 5, 7]."""
    parts, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            parts.append(str(start) if start == layer else f"{start}-{layer}")
            start = None
    return ", ".join(parts)


def _layers(layers: list[int]) -> str:
    return f"layer{'s' if len(layers) > 1 else ''} {_ranges(layers)}"


def attention_plan(cfg: Config, num_layers: int) -> str:
    """Which layers run dense and which sparse, with what budgets."""
    att, seq = cfg.attention, cfg.data.seq_len
    if not att.sparse:
        return f"dense causal in all {num_layers} layers"
    if seq < att.min_sparse_len:
        return f"dense in all {num_layers} layers (data.seq_len {seq} < attention.min_sparse_len {att.min_sparse_len})"
    dense = sorted(layer for layer in set(att.dense_layers) if layer < num_layers)
    sparse = [layer for layer in range(num_layers) if layer not in dense]
    budgets = f"budgets from {att.budgets}" if att.budgets else f"v_size {att.v_size}, s_size {att.s_size}"
    lines = f"{budgets}, last_q {att.last_q}, sinks {att.sink_tokens}, window {att.local_window}"
    if att.threshold is not None:
        lines += f", mass threshold {att.threshold}"
    if att.block_columns:
        lines += f", {att.block_columns} columns per {att.block_size}-row block"
    fallback = f"; a step runs a layer dense above density {att.max_density}" if att.max_density else ""
    plan = f"{_layers(sparse)} sparse ({lines}, re-estimated every step{fallback})" if sparse else ""
    if sparse:  # what the lines are estimated from when a sample packs several documents
        plan += (
            "; packed documents masked, each estimating its own lines"
            if cfg.data.document_masking
            else "; packed documents not masked: one pattern per sample, from its last queries "
            "(data.document_masking: true estimates each document's own)"
        )
    if sparse and att.backend == "fa4":
        plan += f"; {fa4_routing(cfg)}"
    if dense:
        plan = f"{_layers(dense)} dense" + (f"; {plan}" if plan else "")
    return plan


def fa4_routing(cfg: Config) -> str:
    """Where attention.backend=fa4 runs the sparse layers' calls (``Attention.backend``'s rule; the dense calls run
    the dense path as always)."""
    documents = ", those of samples packing several documents on triton" if cfg.data.document_masking else ""
    return f"sparse calls on fa4 (FlashAttention-4's block-sparse kernels, the verticals on triton){documents}"


def startup_summary(
    cfg: Config,
    model: nn.Module,
    world_size: int,
    ring: RingChoice,
    device: str,
    sources: list[Source],
    samples: PackedSamples,
    start_step: int,
) -> list[str]:
    """The lines of the summary (see the module docstring)."""
    c, p, d = model.config, cfg.parallel, cfg.data
    params = sum(t.numel() for t in model.parameters())
    rope = dict(getattr(c, "rope_parameters", None) or {})
    origin = cfg.model.path or "random init"
    compiled = f" (decoder layers compiled, {cfg.train.compile_backend})" if cfg.train.compile else ""
    lines = [
        f"model: {c.model_type} ({origin}), {params / 1e6:.2f}M parameters, {c.num_hidden_layers} layers, "
        f"{cfg.model.dtype} compute{compiled}; RoPE {rope.get('rope_type', 'default')} theta {rope.get('rope_theta')}, "
        f"max_position_embeddings {c.max_position_embeddings}, training at {d.seq_len}",
    ]
    if p.context == 1:
        schedule = "no ring"
    elif p.context_mode == "allgather":
        schedule = "K/V all-gathered per layer, parallel.context_mode=allgather"
    elif ring.ring == "hierarchical":
        schedule = (
            f"hierarchical ring: {p.context // ring.inner_size} nodes x inner rings of {ring.inner_size}; {ring.reason}"
        )
    else:
        schedule = f"flat ring; {ring.reason}"
    lines.append(
        f"world: {world_size} ranks = data {p.data} x context {p.context} ({schedule}), {device}; "
        f"layout {cfg.attention.layout}, block {cfg.attention.block_size}, {d.seq_len // p.context} tokens per rank"
    )
    lines.append(f"attention: {attention_plan(cfg, c.num_hidden_layers)}")
    per_step, steps = cfg.tokens_per_step, cfg.train.steps
    lines.append(
        f"batch: {d.batch_size} x {d.seq_len} tokens x {p.data} data ranks x {cfg.micro_batches} micro-batches = "
        f"{per_step:,} tokens per step; {steps} steps = {per_step * steps:,} tokens"
        + (f" (resuming at step {start_step})" if start_step else "")
    )
    draws = steps * per_step // d.seq_len
    for source, packed, share in zip(sources, samples.sources, samples.order.shares):
        epochs = draws * share / packed.num_samples
        lines.append(
            f"data: {source.name} ({source.files} file{'s' if source.files > 1 else ''}): {len(source.stream):,} tokens, {packed.num_samples:,} "
            f"samples, {share:.1%} of the draws, {epochs:.2f} epochs over the run"
        )
    return lines

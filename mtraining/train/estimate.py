"""Estimates of a run before it starts: memory per GPU and time per step (``mtraining check``).

Both are formulas, not measurements; each line they print says which formula. They need the model's shape
(``ModelShape``: counted on a model built on the meta device, no weights) and the GPU (``GPUS``).

**Memory per GPU** (bytes), W = data x context ranks (FSDP2 shards parameters, gradients and AdamW state over
all of them), P parameters, T tokens per rank per micro-batch (batch_size x seq_len / context), L layers,
h hidden size, q = heads x head_dim, kv = kv_heads x head_dim, i the MLP width, b bytes of the compute dtype:

- weights and AdamW moments, float32 shards: 12 P / W; gradients, float32 shards: 4 P / W (all of them exist at
  the optimizer step; in the backward, the peak of the activations, the layers' gradients are still being made);
- the compute copy: on several ranks one layer's gathered parameters and the next one's (2 x b x P_layer) plus
  the embeddings and head (b x P_outer); on one rank in bfloat16 the whole model (b x P);
- activations with checkpointing: each layer's input (L x T x h x b) plus one layer's saved tensors during its
  recompute and backward, T x b x (5 h + 3 q + 4 kv + 4 i) (RMSNorm, the q/k/v/o projections, RoPE, attention,
  the SwiGLU MLP's four products; with liger's fused kernels 3 h + 3 q + 4 kv + 2 i); without checkpointing
  every layer's saved tensors, L x T x b x (...);
- the loss: one chunk of float32 logits and its half-precision gradient, loss_chunk_tokens x vocab x 6;
- attention buffers: the ring's K/V in flight and dK/dV accumulators (float32), T x kv x 24 when context > 1;
- saved attention outputs (train.save_attention_outputs): L x T x heads x (head_dim x b + 4);
- sparse attention beyond dense (``sparse_attention_bytes``): each sparse layer's pattern from its forward to its
  backward, batch x heads x (D + V + 2) int32 (D block diagonals, at most min(ceil(seq_len / G), 2 s_size); V
  verticals, v_size; plus ceil(seq_len / G) x block_columns with per-block columns), and one layer's kernel walks
  (models/attention.py, "Memory"): per ring step (context of them) a query and a key walk, batch x heads x
  ceil(T / G) x (min(D, ceil(T / G)) + 3) int32 each, and what they share, batch x heads x (ceil(seq_len / G) int8 +
  3 V int32) + 3 ceil(T / G) int32. D is the budget's bound: patterns that keep fewer diagonals need less.

The peak is the larger of the backward's (everything but the gradients) and the optimizer step's (weights,
gradients, moments, compute copy). Not counted: the CUDA context, the allocator's fragmentation and the sparse
pattern's estimation buffers (chunks of 256 MB).

**Time per step**: the training FLOPs of a step (``flops_per_token``: 6 x matmul parameters + attention at the
pattern's density, forward and backward) divided over the GPUs at the efficiency (MFU) measured for a whole
training step of the Qwen2.5-3B shape on H200s (``MEASURED``: sparse or dense, its density), plus what the
ring cost model (mtraining/parallel/ring_cost.py) predicts its transfers add over that compute, per attention layer
and micro-batch, on NVLink inside a node (assumed) and ``parallel.inter_node_gbps`` between nodes. FSDP's parameter gathers and gradient reductions
are assumed hidden behind compute (their time is printed). A run at another size, length, density or on other
GPUs can differ: this is an estimate, to be replaced by the measured ``step_s`` of the first steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..models.loader import head_dim
from ..parallel.ring_cost import (
    AttentionShape,
    Cluster,
    Link,
    allgather_time,
    flat_ring_time,
    hierarchical_ring_time,
    step_work,
)
from .config import Config
from .monitor import _PEAK_TFLOPS, flops_per_token
from .ring_choice import INTER_NODE_LATENCY_S, NVLINK, RingChoice
from .saved_outputs import DEFAULT_FRACTION, saved_outputs_bytes

GB = 1e9


def size_text(nbytes: float) -> str:
    """Bytes as decimal GB (as peak_mem_gb), or MB below 0.1 GB."""
    return f"{nbytes / GB:.2f} GB" if nbytes >= 0.1 * GB else f"{nbytes / 1e6:.1f} MB"


@dataclass(frozen=True)
class Gpu:
    """A GPU kind: nominal memory, its name in the table of dense bf16 peaks, and the ASSUMED link between the
    GPUs of a node (per GPU and direction; the link between nodes is ``parallel.inter_node_gbps``)."""

    name: str
    memory: float
    """Bytes (nominal)."""
    peak_key: str
    intra: Link

    @property
    def peak_flops(self) -> float:
        return _PEAK_TFLOPS[self.peak_key] * 1e12


_IDEAL = Link(1e30)  # transfers that take no time: the ring of compute alone
GPUS = {
    "h100": Gpu("H100 80GB", 80 * GB, "H100", NVLINK),
    "h200": Gpu("H200 141GB", 141 * GB, "H200", NVLINK),
    "a100": Gpu("A100 80GB", 80 * GB, "A100", Link(300e9, 2e-6)),  # NVLink3
    "a100-40gb": Gpu("A100 40GB", 40 * GB, "A100", Link(300e9, 2e-6)),
}


@dataclass(frozen=True)
class Measured:
    """A whole training step measured on GPUs, which the time estimate scales from."""

    source: str
    mfu: float
    density: float | None


# bench/results/train_throughput.json (tests/train/test_estimate.py keeps these equal to its records)
MEASURED = {
    "sparse": Measured(
        "2 x H200, Qwen2.5-3B shape, 512K tokens, sparse striped ring, liger kernels, commit c7f705e", 0.32501, 0.10531
    ),
    "dense": Measured(
        "2 x H200, Qwen2.5-3B shape, 512K tokens, dense zigzag ring, liger kernels, commit c7f705e", 0.37010, None
    ),
}


@dataclass(frozen=True)
class ModelShape:
    """What the estimates need of a model: its parameter counts and attention and MLP sizes."""

    params: int
    matmul_params: int
    """Parameters in per-token matmuls: all but the input embedding (monitor.matmul_params)."""
    outer_params: int
    """Parameters outside the decoder layers (embeddings, final norm, an untied head)."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, model) -> ModelShape:
        """The shape of a Hugging Face causal LM (on any device, the meta device included)."""
        from .monitor import matmul_params

        c = model.config
        params = sum(p.numel() for p in model.parameters())
        in_layers = sum(p.numel() for p in model.model.layers.parameters())
        return cls(
            params=params,
            matmul_params=matmul_params(model),
            outer_params=params - in_layers,
            layers=c.num_hidden_layers,
            hidden=c.hidden_size,
            heads=c.num_attention_heads,
            kv_heads=c.num_key_value_heads,
            head_dim=head_dim(c),
            intermediate=c.intermediate_size,
            vocab=c.vocab_size,
        )


@dataclass(frozen=True)
class Estimate:
    """Terms (name, bytes or seconds, how) and their combination, printed one per line."""

    terms: list[tuple[str, float, str]]
    total: float
    lines: list[str]


def _activation_elements(m: ModelShape, liger: bool) -> int:
    """Elements per token one decoder layer keeps for its backward (module docstring)."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    if liger:
        return 3 * m.hidden + 3 * q + 4 * kv + 2 * m.intermediate
    return 5 * m.hidden + 3 * q + 4 * kv + 4 * m.intermediate


def sparse_attention_bytes(cfg: Config, m: ModelShape) -> int:
    """Bytes sparse attention holds on one rank beyond what dense attention holds (module docstring): every
    sparse layer's pattern and one layer's kernel walks, at the budgets' bound on the pattern's lines."""
    att, n = cfg.attention, cfg.data.seq_len
    config = att.pattern_config()
    dense_layers = set(att.dense_layers)
    sparse = [i for i in range(m.layers) if i not in dense_layers]
    if config is None or n < att.min_sparse_len or not sparse:
        return 0
    g, batch, context = att.block_size, cfg.data.batch_size, cfg.parallel.context
    blocks, local_blocks = -(-n // g), -(-(n // context) // g)
    patterns, walks = 0, 0
    for layer in sparse:
        v, s = (int(t.max()) for t in config.head_budgets(layer, m.heads, n))
        diags = min(blocks, 2 * s)  # a slash crosses at most two block diagonals
        patterns += batch * m.heads * (diags + v + 2 + blocks * att.block_columns) * 4
        lists = 2 * batch * m.heads * local_blocks * (min(diags, local_blocks) + 3) * 4
        walks = max(walks, context * (lists + batch * m.heads * (blocks + 12 * v) + 12 * local_blocks))
    return patterns + walks


def local_tokens(cfg: Config) -> int:
    """Tokens one rank holds per micro-batch."""
    return cfg.data.batch_size * cfg.data.seq_len // cfg.parallel.context


def memory_per_gpu(cfg: Config, m: ModelShape, gpu: Gpu) -> Estimate:
    """Peak memory of one GPU (module docstring), with and without checkpointing and saved outputs."""
    w, t, b = cfg.world_size, local_tokens(cfg), 2 if cfg.model.dtype == "bfloat16" else 4
    liger = cfg.train.fused_kernels == "liger"
    states, grads = 12 * m.params / w, 4 * m.params / w
    layer_params = (m.params - m.outer_params) / m.layers
    if w > 1:
        copy = b * (2 * layer_params + m.outer_params)
    else:
        copy = b * m.params if b == 2 else 0
    per_layer = t * b * _activation_elements(m, liger)
    inputs = m.layers * t * m.hidden * b
    checkpointed, full = inputs + per_layer, m.layers * per_layer
    loss = cfg.train.loss_chunk_tokens * m.vocab * 6
    ring = t * m.kv_heads * m.head_dim * 24 if cfg.parallel.context > 1 else 0
    saved = saved_outputs_bytes(m.layers, t, m.heads, m.head_dim, b)
    sparse = sparse_attention_bytes(cfg, m)
    ckpt = cfg.train.activation_checkpointing
    activations = checkpointed if ckpt else full

    def peak(acts: float, extra: float = 0.0) -> float:
        return max(states + copy + acts + loss + ring + sparse + extra, states + grads + copy)

    total = peak(activations)
    fits_saved = ckpt and peak(activations, saved) <= DEFAULT_FRACTION * gpu.memory
    keep_saved = cfg.train.save_attention_outputs is True or (cfg.train.save_attention_outputs == "auto" and fits_saved)
    if keep_saved and ckpt:
        total = peak(activations, saved)
    fused = "liger's fused kernels" if liger else "the model's own modules"
    terms = [
        ("weights and AdamW moments (float32 shards)", states, f"12 x {m.params:,} parameters / {w} ranks"),
        ("gradients (float32 shards, at the optimizer step)", grads, f"4 x parameters / {w}"),
        ("compute copy", copy, "one layer and the next gathered, plus embeddings and head" if w > 1 else "whole model"),
        (
            "activations, checkpointed" + (" (this run)" if ckpt else ""),
            checkpointed,
            f"{m.layers} layer inputs x {t:,} tokens x {m.hidden} x {b} B + one layer's {_activation_elements(m, liger)} "
            f"values per token ({fused})",
        ),
        ("activations, not checkpointed" + ("" if ckpt else " (this run)"), full, f"{m.layers} layers' values"),
        ("loss chunk", loss, f"{cfg.train.loss_chunk_tokens} tokens x {m.vocab} vocab x 6 B"),
        ("ring buffers", ring, f"{t:,} tokens x {m.kv_heads * m.head_dim} x 24 B"),
        (
            "saved attention outputs" + (" (kept)" if keep_saved and ckpt else " (not kept)"),
            saved,
            f"{m.layers} x {t:,} x {m.heads} x ({m.head_dim} x {b} + 4) B",
        ),
    ]
    if sparse:
        terms.append(
            (
                "sparse patterns and one layer's kernel walks",
                sparse,
                f"every sparse layer's pattern + {cfg.parallel.context} ring steps' query and key walks, at the "
                "budgets' bound",
            )
        )
    lines = [f"memory per GPU, estimated: {size_text(total)} of the {gpu.name}'s {gpu.memory / GB:.0f} GB"]
    lines += [f"  {name}: {size_text(value)} ({how})" for name, value, how in terms]
    lines.append(
        "  peak = max(weights and moments + compute copy + activations + loss + ring [+ sparse] [+ saved outputs], "
        "weights, moments and gradients + compute copy); not counted: CUDA context, fragmentation, estimation buffers"
    )
    if cfg.train.save_attention_outputs == "auto" and ckpt:
        verdict = "fit" if fits_saved else "do not fit"
        lines.append(
            f"  train.save_attention_outputs=auto: by this estimate the saved outputs {verdict} in "
            f"{DEFAULT_FRACTION:.0%} of the GPU; the run decides from its first step's measured peak"
        )
    return Estimate(terms, total, lines)


def _density(cfg: Config, layers: int) -> tuple[float, str]:
    """The mean attention density over layers that the time estimate assumes, and where it comes from."""
    att = cfg.attention
    if not att.sparse or cfg.data.seq_len < att.min_sparse_len:
        return 1.0, "dense attention"
    dense = len({x for x in att.dense_layers if x < layers})
    measured = MEASURED["sparse"].density
    mean = (dense + (layers - dense) * measured) / layers
    return mean, f"{measured:.3f} in sparse layers as measured there (v_size 1024, s_size 6144 at 512K)"


def time_per_step(cfg: Config, m: ModelShape, gpu: Gpu, gpus_per_node: int, ring: RingChoice) -> Estimate:
    """Seconds per optimizer step (module docstring): compute at the measured efficiency plus the ring's
    transfers that the cost model finds not hidden by it (``ring``: the schedule train/ring_choice.py chose)."""
    world, context, n = cfg.world_size, cfg.parallel.context, cfg.data.seq_len
    density, density_source = _density(cfg, m.layers)
    measured = MEASURED["sparse" if density < 1 else "dense"]
    rate = measured.mfu * gpu.peak_flops  # FLOP/s of one GPU
    flops = flops_per_token(m.matmul_params, m.layers, m.heads, m.head_dim, n, density) * cfg.tokens_per_step
    compute = flops / (world * rate)
    inter = Link(cfg.parallel.inter_node_gbps * 1e9, INTER_NODE_LATENCY_S)
    exposed = 0.0
    if context > 1:  # per pair and query head: 4 x head_dim FLOPs forward, 8 x head_dim backward
        shape = AttentionShape(m.heads, m.kv_heads, m.head_dim)
        work = step_work(shape, n, context, density, rate / (4 * m.head_dim), rate / (8 * m.head_dim))
        node = ring.inner_size if ring.ring == "hierarchical" else min(gpus_per_node, context)
        if cfg.parallel.context_mode == "allgather":
            predict = allgather_time
        else:
            predict = hierarchical_ring_time if ring.ring == "hierarchical" else flat_ring_time
        cluster = Cluster(max(1, context // node), node, gpu.intra, inter if context > gpus_per_node else gpu.intra)
        ideal = Cluster(cluster.nodes, cluster.gpus_per_node, _IDEAL, _IDEAL)
        per_layer = predict(cluster, work).total - predict(ideal, work).total
        exposed = per_layer * m.layers * cfg.micro_batches * cfg.data.batch_size
    b = 2 if cfg.model.dtype == "bfloat16" else 4
    link = inter if world > gpus_per_node else gpu.intra
    gathers = 3 if cfg.train.activation_checkpointing else 2  # forward, recompute, backward
    fsdp_bytes = (gathers * b + 4) * m.params * (world - 1) / world
    fsdp = fsdp_bytes / link.bandwidth * (1 if cfg.train.defer_grad_sync else cfg.micro_batches)
    total = compute + exposed
    hours = total * cfg.train.steps / 3600
    lines = [
        f"time, estimated: {total:.1f} s per step, {hours:.1f} hours for {cfg.train.steps} steps, "
        f"{hours * world:,.0f} GPU-hours on {world} {gpu.name}",
        f"  compute: {flops:.3g} FLOPs per step ({cfg.tokens_per_step:,} tokens; attention density {density:.3f}: "
        f"{density_source}) / ({world} GPUs x MFU {measured.mfu:.3f} x {gpu.peak_flops / 1e12:g} TFLOP/s) "
        f"= {compute:.1f} s; the MFU measured on {measured.source}",
        f"  {ring.ring} ring's transfers not hidden by compute: {exposed:.2f} s per step (ring cost model, "
        f"mtraining/parallel/ring_cost.py; links per GPU: {gpu.intra.bandwidth / GB:g} GB/s in a node ASSUMED, "
        f"{inter.bandwidth / GB:g} GB/s between nodes from parallel.inter_node_gbps)",
        f"  FSDP gathers and reductions: {fsdp:.1f} s of transfers per step at {link.bandwidth / GB:g} GB/s, assumed "
        "hidden behind compute" + (": more than the compute, so they are not" if fsdp > compute else ""),
    ]
    return Estimate(
        [("compute", compute, ""), ("exposed ring transfers", exposed, ""), ("fsdp transfers", fsdp, "")], total, lines
    )


def cost_line(seconds_per_step: float, steps: int, gpus: int, usd_per_gpu_hour: float) -> str:
    """The run's cost at a price per GPU-hour."""
    gpu_hours = seconds_per_step * steps / 3600 * gpus
    return f"  cost at ${usd_per_gpu_hour:g} per GPU-hour: ${math.ceil(gpu_hours * usd_per_gpu_hour):,}"

"""Cost model of context-parallel attention: predicted forward + backward time of one layer.

Used by ``mtraining check`` (train/estimate.py: the time of a training step), bench/ring_prediction.py (beside
measured ring times) and ``experiments/studies/cost_model.py``.

Inputs are per-step compute times (one ring step's attention, forward and backward, on one GPU)
and links (``Link``: bandwidth per direction per GPU, latency per transfer). Ranks advance in lock step, and
a step whose transfer is overlapped with compute costs max(compute, transfer). The schedules are
the ones the engines run (ring/flat.py, ring/hierarchical.py, ring/allgather.py); the trainer's
``parallel.ring: auto`` asks ``choose_ring`` (train/ring_choice.py), experiments/studies/cost_model.py checks it against
measured times:

Flat ring of W = O x I ranks. Consecutive ranks share a node, so with O > 1 some hop of every step
crosses nodes and every step waits for the slow link:
  forward  = (W-1) max(c_f, x(kv)) + c_f
  backward = max(c_b, x(kv)) + (W-2) max(c_b, x(kv + g)) + max(c_b, x(g)) + x(g)
(the K/V of the next step and the dK/dV accumulator of the previous one share the link; the last
accumulator hop home is exposed). x(b) = latency + b / bandwidth; kv and g are the bytes of one
shard's K/V and of its dK/dV accumulator (float32 in our engines).

Hierarchical ring: an inner cycle is a flat ring of I ranks on the intra-node link (forward F,
backward B, including its exposed last accumulator hop); the outer hop of the next node group's
K/V runs behind the whole cycle, and the outer accumulator hop behind the next cycle:
  forward  = (O-1) max(F, X(kv)) + F
  backward = max(B, X(kv)) + (O-2) max(B, X(kv + g)) + max(B, X(g)) + X(g)      (O > 1)
with X on the inter-node link. Compute of one step is the same in both rings (same shard sizes);
with the striped layout all steps cost the same, c = (work of one GPU on the full sequence) / W^2.

All-gather (no ring): K/V of every rank are gathered before any compute and the dK/dV reduce-scattered
after it, nothing overlapped; the backward gathers K/V again (they are not kept):
  forward  = A(kv) + W c_f,    backward = A(kv) + W c_b + A(g)
where A(b) = (W-1) x(b) is a ring all-gather (or reduce-scatter) of W shards of b bytes on the slowest link.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A link of ``bandwidth`` bytes/s per direction (per GPU) and ``latency`` seconds per transfer."""

    bandwidth: float
    latency: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"a link needs bandwidth > 0 bytes/s (e.g. 25e9 for 25 GB/s), got {self.bandwidth!r}")
        if not self.latency >= 0:
            raise ValueError(f"a link needs latency >= 0 seconds (e.g. 5e-6), got {self.latency!r}")

    def seconds(self, nbytes: float) -> float:
        """Modelled time of one transfer of ``nbytes`` (none: 0)."""
        return self.latency + nbytes / self.bandwidth if nbytes > 0 else 0.0

    @property
    def label(self) -> str:
        return f"emulated {self.bandwidth / 1e9:g} GB/s, {self.latency * 1e6:g} us"


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` GPUs; ``intra`` links GPUs of a node, ``inter`` links nodes."""

    nodes: int
    gpus_per_node: int
    intra: Link
    inter: Link

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(
                f"a cluster needs >= 1 node and >= 1 GPU per node, got {self.nodes} x {self.gpus_per_node}"
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class StepWork:
    """One ring step: compute seconds (forward, backward) and bytes moved per rank (K/V, dK/dV)."""

    fwd: float
    bwd: float
    kv_bytes: float
    grad_bytes: float


@dataclass(frozen=True)
class Prediction:
    fwd: float
    bwd: float

    @property
    def total(self) -> float:
        return self.fwd + self.bwd


def _ring(steps: int, link: Link, work: StepWork) -> Prediction:
    """A flat ring of ``steps`` ranks whose every hop costs ``link``."""
    c_f, c_b, kv, g = work.fwd, work.bwd, work.kv_bytes, work.grad_bytes
    if steps == 1:
        return Prediction(c_f, c_b)
    fwd = (steps - 1) * max(c_f, link.seconds(kv)) + c_f
    bwd = max(c_b, link.seconds(kv)) + (steps - 2) * max(c_b, link.seconds(kv + g))
    bwd += max(c_b, link.seconds(g)) + link.seconds(g)
    return Prediction(fwd, bwd)


def flat_ring_time(cluster: Cluster, work: StepWork) -> Prediction:
    """Predicted flat-ring time (seconds) of one attention layer, forward and backward."""
    link = cluster.inter if cluster.nodes > 1 else cluster.intra
    return _ring(cluster.world_size, link, work)


def hierarchical_ring_time(cluster: Cluster, work: StepWork) -> Prediction:
    """Predicted hierarchical-ring time (seconds) of one attention layer, forward and backward."""
    inner = _ring(cluster.gpus_per_node, cluster.intra, work)
    o, x = cluster.nodes, cluster.inter.seconds
    kv, g = work.kv_bytes, work.grad_bytes
    if o == 1:
        return inner
    fwd = (o - 1) * max(inner.fwd, x(kv)) + inner.fwd
    bwd = max(inner.bwd, x(kv)) + (o - 2) * max(inner.bwd, x(kv + g)) + max(inner.bwd, x(g)) + x(g)
    return Prediction(fwd, bwd)


def allgather_time(cluster: Cluster, work: StepWork) -> Prediction:
    """Predicted all-gather time (seconds) of one attention layer, forward and backward (module docstring)."""
    w = cluster.world_size
    link = cluster.inter if cluster.nodes > 1 else cluster.intra

    def collective(nbytes: float) -> float:
        return (w - 1) * link.seconds(nbytes)

    return Prediction(
        collective(work.kv_bytes) + w * work.fwd,
        collective(work.kv_bytes) + w * work.bwd + collective(work.grad_bytes),
    )


@dataclass(frozen=True)
class AttentionShape:
    """Per-layer attention shape: query heads, K/V heads, head dim, bytes per element (bf16: 2)."""

    heads_q: int
    heads_kv: int
    head_dim: int
    elem_bytes: int = 2
    grad_elem_bytes: int = 4  # the engines accumulate dK/dV in float32

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.heads_kv * self.head_dim * self.elem_bytes

    @property
    def grad_bytes_per_token(self) -> int:
        return 2 * self.heads_kv * self.head_dim * self.grad_elem_bytes

    def pairs(self, seq_len: int, density: float) -> float:
        """Computed (query, key) pairs of causal attention at ``density``, summed over query heads."""
        return density * seq_len * (seq_len + 1) / 2 * self.heads_q


def step_work(
    shape: AttentionShape, seq_len: int, world_size: int, density: float, fwd_pairs_per_s: float, bwd_pairs_per_s: float
) -> StepWork:
    """One balanced ring step: a 1/W^2 share of the sequence's pairs; one shard's K/V and accumulator."""
    if seq_len % world_size != 0:
        raise ValueError(f"seq_len {seq_len} must be a multiple of the {world_size} GPUs")
    pairs = shape.pairs(seq_len, density) / world_size**2
    tokens = seq_len // world_size
    return StepWork(
        fwd=pairs / fwd_pairs_per_s,
        bwd=pairs / bwd_pairs_per_s,
        kv_bytes=tokens * shape.kv_bytes_per_token,
        grad_bytes=tokens * shape.grad_bytes_per_token,
    )

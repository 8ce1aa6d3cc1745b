"""Which context-parallel schedule a run uses: ``parallel.ring: auto`` asks the ring cost model.

The flat ring waits for the slowest hop on every step; the hierarchical ring hides the hop between nodes
behind a whole inner cycle, at the price of one more exposed accumulator hop per outer step
(mtraining/parallel/ring_cost.py). So ``auto`` takes the hierarchical ring only where the context ranks
span several nodes and the model predicts it at least ``MARGIN`` faster, with the run's attention shape,
sequence and a per-step compute time from measured throughput, NVLink inside a node and
``parallel.inter_node_gbps`` between nodes; everywhere else (one node, one rank, all-gather mode) the flat
ring. ``parallel.ring: flat | hierarchical`` overrides it. The start-up summary prints the verdict.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..models.loader import head_dim
from ..parallel.ring_cost import (
    AttentionShape,
    Cluster,
    Link,
    flat_ring_time,
    hierarchical_ring_time,
    step_work,
)
from .config import Config
from .export import DTYPES

MARGIN = 0.05  # the hierarchical ring must be predicted this much faster than the flat one
NVLINK = Link(450e9, 2e-6)  # inside a node: NVLink4 per GPU and direction (assumed)
INTER_NODE_LATENCY_S = 5e-6  # per transfer between nodes (assumed)
# Per-GPU computed pairs per second (forward, backward), measured on 2 x H200 at 512K on the striped ring
# (sparse, density 0.077) and the zigzag ring through cuDNN (dense): bench/results/ring_attention.json, eef1a99.
SPARSE_RATE = (7.68e11, 2.72e11)
SPARSE_DENSITY = 0.0767
DENSE_RATE = (1.08e12, 4.21e11)


@dataclass(frozen=True)
class RingChoice:
    """The resolved schedule: ``ring`` ("flat" or "hierarchical"), ranks per inner ring, and why (a summary phrase)."""

    ring: str
    inner_size: int
    reason: str


def choose_ring(cfg: Config, local_world_size: int | None, hf_config) -> RingChoice:
    """The ring of this run of the model of ``hf_config`` with ``local_world_size`` ranks per node (None: not
    launched by torchrun) (module docstring); ValueError (naming the fix) for a ring shape that cannot run."""
    p = cfg.parallel
    if p.ring != "auto":
        return RingChoice(p.ring, cfg.inner_size(local_world_size), f"parallel.ring={p.ring}")
    if p.context == 1 or p.context_mode == "allgather":
        return RingChoice("flat", p.context, "parallel.ring=auto")
    node = p.inner_size or min(local_world_size or p.context, p.context)
    nodes = p.context // node
    if nodes == 1 or p.context % node:
        where = "one node" if nodes == 1 else f"{node} ranks per node do not tile {p.context}"
        return RingChoice("flat", p.context, f"parallel.ring=auto: {where}")
    sparse = cfg.attention.sparse
    rate, density = (SPARSE_RATE, SPARSE_DENSITY) if sparse else (DENSE_RATE, 1.0)
    act_bytes = DTYPES[cfg.model.dtype].itemsize
    heads = (hf_config.num_attention_heads, hf_config.num_key_value_heads, head_dim(hf_config))
    shape = AttentionShape(*heads, act_bytes, max(act_bytes, 4))
    one = step_work(shape, cfg.data.seq_len, p.context, density, *rate)
    b = cfg.data.batch_size  # every sample adds its own pairs and K/V
    work = dataclasses.replace(
        one, fwd=b * one.fwd, bwd=b * one.bwd, kv_bytes=b * one.kv_bytes, grad_bytes=b * one.grad_bytes
    )
    cluster = Cluster(nodes, node, NVLINK, Link(p.inter_node_gbps * 1e9, INTER_NODE_LATENCY_S))
    flat, hierarchical = flat_ring_time(cluster, work).total, hierarchical_ring_time(cluster, work).total
    verdict = (
        f"parallel.ring=auto: {nodes} nodes at {p.inter_node_gbps:g} GB/s, predicted {flat * 1e3:.1f} ms flat vs "
        f"{hierarchical * 1e3:.1f} ms hierarchical per layer"
    )
    if hierarchical < (1 - MARGIN) * flat:
        return RingChoice("hierarchical", node, verdict)
    return RingChoice("flat", p.context, verdict)

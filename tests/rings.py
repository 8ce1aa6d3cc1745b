"""Ring attention on the gloo pool against the float64 oracle: the workers and checks the ring tests share."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import Tensor

from bench.synthetic import rope_structured_qkv
from mtraining.ops import PatternConfig, attention_oracle, estimate_pattern
from mtraining.ops.dense import DenseBlocks, decompose, dense_backend
from mtraining.ops.numerics import merge_partial
from mtraining.parallel import make_layout, ring_attention
from tests.factories import make_pattern, make_qkv
from tests.numerics import assert_close

LAYOUTS = ["contiguous", "zigzag", "striped"]
G, D = 16, 16
SEQ = {1: 256, 2: 256, 3: 192, 4: 256}  # multiples of 2 * W * G (zigzag)
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
ROPE_FLOAT32_TOL = 5e-5  # logits of ~10 on the structured inputs: single-device float32 already errs ~1e-5
OUTPUTS = ["out", "lse", "dq", "dk", "dv"]

CONFIGS = {
    "topk": PatternConfig(v_size=16, s_size=12, last_q=32, block_size=G, sink_tokens=4, local_window=8),
    "threshold": PatternConfig(
        v_size=64, s_size=24, last_q=40, block_size=G, sink_tokens=2, local_window=8, threshold=0.8
    ),
}


def make_inputs(seed: int, b: int, n: int, hq: int, hkv: int, dtype: torch.dtype, rope: bool = False):
    """q, k, v, dout on the full sequence (identical in every process for one seed).

    ``rope``: q/k/v from the RoPE-structured model (slash band plus anchor verticals) instead of noise.
    """
    tensors = make_qkv(b, n, n, hq, hkv, D, dtype, seed)
    if rope:
        tensors[:3] = (t.to(dtype) for t in rope_structured_qkv(b, n, hq, hkv, D, dtype=torch.float64, seed=seed))
    return tensors


def _heads_major(x: torch.Tensor) -> torch.Tensor:
    """Same values with [B, H, S, D] memory order, as Hugging Face's q/k/v.transpose(1, 2) gives."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def ring_case(
    group,
    layout_name,
    inputs,
    pattern,
    config=None,
    ring=None,
    backend="torch",
    strided=False,
    dense=None,
    documents=None,
):
    """Worker: shard the full inputs (q, k, v, dout), run the ring forward and backward, return this rank's
    (out, lse, dq, dk, dv). ``ring``: more ring_attention arguments (ring=, inner_size=, outer_comm=);
    ``dense``: the dense backend setting to run under; ``documents``: packed documents."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    q, k, v, dout = inputs
    layout = make_layout(layout_name, q.shape[1], world, G)
    shards = [layout.shard(t, rank) for t in (q, k, v)]
    ql, kl, vl = ((_heads_major(t) if strided else t).requires_grad_() for t in shards)
    setting = dense_backend(dense) if dense is not None else contextlib.nullcontext()
    with setting:
        out, lse = ring_attention(
            ql,
            kl,
            vl,
            group,
            layout,
            pattern=pattern,
            pattern_config=config,
            return_lse=True,
            backend=backend,
            documents=documents,
            **(ring or {}),
        )
    out.backward(layout.shard(dout, rank))
    return out.detach(), lse, ql.grad, kl.grad, vl.grad


def reference(inputs, pattern, config=None, documents=None):
    """Oracle (out, lse, dq, dk, dv) in float64 on the full sequence (pattern estimated there with a config)."""
    if config is not None:
        pattern = estimate_pattern(inputs[0], inputs[1], config, documents=documents)
    q, k, v, dout = (t.detach().double().clone().requires_grad_() for t in inputs)
    out, lse = attention_oracle(q, k, v, pattern, documents=documents)
    out.backward(dout)
    return out.detach(), lse, q.grad, k.grad, v.grad


def assert_gathered_close(results, layout_name: str, ref, tol: float, where: str = "") -> None:
    """Every rank's (out, lse, dq, dk, dv), gathered into the full sequence, equal the oracle's."""
    layout = make_layout(layout_name, ref[0].shape[1], len(results), G)
    for i, name in enumerate(OUTPUTS):
        got = layout.gather([r[i] for r in results], dim=2 if name == "lse" else 1)
        assert_close(f"{name}{where}", got, ref[i], tol)


def check_ring(
    pool,
    world,
    layout_name,
    kind,
    dtype=torch.float64,
    b=1,
    hq=4,
    hkv=2,
    seed=0,
    tol=None,
    n=None,
    **case,
):
    """Ring results gathered over ranks equal the oracle; ``kind`` is a make_pattern kind or a CONFIGS key;
    ``case``: more ``ring_case`` arguments (ring=, backend=, strided=, dense=). Returns the reference."""
    n = n or SEQ[world]
    config = CONFIGS.get(kind)
    pattern = None if config else make_pattern(kind, b, hq, n, G, seed + 1)
    inputs = make_inputs(seed, b, n, hq, hkv, dtype, rope=config is not None)
    results = pool.run(ring_case, world, layout_name, inputs, pattern, config, *_case_args(case))
    ref = reference(inputs, pattern, config, case.get("documents"))
    for r in results:
        assert r[1].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert r[0].dtype == dtype
    default = ROPE_FLOAT32_TOL if config is not None and dtype == torch.float32 else TOL[dtype]
    assert_gathered_close(results, layout_name, ref, tol or default, f" ({world} ranks, {case})")
    return ref


def _case_args(case: dict) -> tuple:
    """``ring_case``'s positional arguments after (inputs, pattern, config), from keywords."""
    unknown = set(case) - {"ring", "backend", "strided", "dense", "documents"}
    assert not unknown, unknown
    keys = ("ring", "backend", "strided", "dense", "documents")
    return tuple(case.get(key, "torch" if key == "backend" else False if key == "strided" else None) for key in keys)


def dense_ring_in_one_process(ops, layout, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, scale: float, acc) -> list:
    """One process plays every rank of a dense ring through ``DenseBlocks(ops)``: each step's blocks, merged by
    LSE, then each step's backward with the merged out (in q's dtype) and lse. [out, lse, dq, dk, dv] of the
    full sequence, accumulated in ``acc``."""
    world = layout.world_size
    outs, lses, dqs = [], [], []
    dks = [torch.zeros(layout.shard(k, 0).shape, dtype=acc, device=k.device) for _ in range(world)]
    dvs = [torch.zeros_like(x) for x in dks]
    for rank in range(world):
        ql, dol = layout.shard(q, rank), layout.shard(dout, rank)
        steps = [
            DenseBlocks(ops, decompose(layout.positions(rank), layout.positions(src), max_blocks=None))
            for src in range(world)
        ]
        out = lse = None
        for src, blocks in enumerate(steps):
            o, part_lse = blocks.forward(ql, layout.shard(k, src), layout.shard(v, src), scale, acc)
            if out is None:
                out, lse = o, part_lse
            else:
                merge_partial(out, lse, o, part_lse)
        dq = torch.zeros(ql.shape, dtype=acc, device=q.device)
        for src, blocks in enumerate(steps):
            gq, gk, gv = blocks.backward(
                dol, ql, layout.shard(k, src), layout.shard(v, src), out.to(q.dtype), lse, scale
            )
            dq += gq
            dks[src] += gk
            dvs[src] += gv
        outs.append(out), lses.append(lse), dqs.append(dq)
    return [layout.gather(got, dim=2 if i == 1 else 1) for i, got in enumerate([outs, lses, dqs, dks, dvs])]

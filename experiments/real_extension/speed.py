"""Attention speed of every arm on the extended model's own queries and keys, against dense attention.

``dump_qkv`` runs one model (the adaptive arm's export) on held-out text at each length, dense, up to the last
layer asked for, and keeps the RoPE'd Q, K and V of those layers (as MInference's ``qkv_dump``). ``time_arms``
then times, on those tensors and in the same process, each sparse arm's training step of one layer's attention
(estimate the pattern, forward, backward: what a training step pays) against dense attention's forward and
backward: cuDNN through SDPA on a GPU, SDPA's math path on the CPU (where the timings only show that the code
runs). Each figure is the median of ``repeats`` timed calls after one warm-up (CUDA events on a GPU).
``attention_speedup`` of an arm at a length is the dense time over the arm's, summed over the dumped layers and,
with several documents dumped one after another (``combine``), over the documents: a pattern's density differs
from document to document as from layer to layer, so one document's layers need not be the model's.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor

from .settings import Arm, Settings

DUMP_ATTENTION = "mtraining_qkv_dump"


class _Enough(Exception):
    """The last layer to dump has been reached: the forward stops there."""


def dump_qkv(model, ids: Tensor, layers: tuple[int, ...]) -> dict[int, tuple[Tensor, Tensor, Tensor]]:
    """Per layer of ``layers``: (q [1, S, Hq, D], k, v [1, S, Hkv, D]) after RoPE, from one dense forward of
    ``model`` (loaded for mtraining's attention) over ``ids`` [S], stopped after the last of them."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from mtraining.models import mtraining_attention, no_mask

    found: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
    last = max(layers)

    def dump(module, query, key, value, attention_mask, **kwargs):
        layer = int(module.layer_idx)
        if layer in layers:
            found[layer] = tuple(t.transpose(1, 2).contiguous() for t in (query, key, value))
        if layer == last:
            raise _Enough
        return mtraining_attention(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(DUMP_ATTENTION, dump)
    AttentionMaskInterface.register(DUMP_ATTENTION, no_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(DUMP_ATTENTION)
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            model.base_model(input_ids=ids[None].to(device), position_ids=torch.arange(len(ids), device=device)[None])
    except _Enough:
        pass
    finally:
        model.set_attn_implementation(previous)
    missing = sorted(set(layers) - set(found))
    if missing:
        raise ValueError(
            f"the model has no layers {missing}; pick --speed-layers below {model.config.num_hidden_layers}"
        )
    return found


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` calls after one warm-up: CUDA events on a GPU, the wall
    clock on the CPU."""
    fn()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - began))
    return statistics.median(times)


def dense_step(q: Tensor, k: Tensor, v: Tensor, do: Tensor) -> Callable[[], None]:
    """Dense causal attention forward + backward through SDPA: cuDNN on CUDA, the math path on the CPU. K/V heads
    are expanded here, outside the timed call (cuDNN's GQA path is not relied on, as in ops/dense)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2).detach().requires_grad_()
    kh = k.transpose(1, 2).repeat_interleave(group, 1).detach().requires_grad_()
    vh = v.transpose(1, 2).repeat_interleave(group, 1).detach().requires_grad_()
    doh = do.transpose(1, 2)
    backend = SDPBackend.CUDNN_ATTENTION if q.is_cuda else SDPBackend.MATH

    def step() -> None:
        with sdpa_kernel(backend):
            torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True).backward(doh)

    return step


def sparse_step(q: Tensor, k: Tensor, v: Tensor, do: Tensor, config, layer: int, backend: str) -> Callable[[], None]:
    """A training step's attention of one layer: a new pattern estimated from q/k (its kernel indices built
    inside the call too), the sparse forward and its backward."""
    from mtraining.ops import estimate_pattern, sparse_attention

    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def step() -> None:
        pattern = estimate_pattern(q, k, config, layer_idx=layer)
        sparse_attention(qg, kg, vg, pattern, backend=backend).backward(do)

    return step


def time_arms(
    qkv: dict[int, tuple[Tensor, Tensor, Tensor]], arms: tuple[Arm, ...], settings: Settings, length: int
) -> list[dict]:
    """At one length, one record per backend of ``settings.timed_backends`` (the first: the run's): per layer the
    dense step's time and per arm its step's time on that backend, estimate's time and pattern density (those two
    shared by the backends); per arm the speedup (dense over sparse, summed over layers) and the mean density
    (``summary``)."""
    backends = settings.timed_backends
    layers: dict[str, dict[str, dict]] = {b: {} for b in backends}
    for layer, (q, k, v) in sorted(qkv.items()):
        do = torch.randn_like(q)
        dense_ms = median_ms(dense_step(q, k, v, do), settings.speed_repeats)
        rows = {b: {"dense_ms": dense_ms, "arms": {}} for b in backends}
        for a in arms:
            for b, figures in _time_arm(q, k, v, do, a, layer, settings, length).items():
                rows[b]["arms"][a.name] = figures
        for b in backends:
            layers[b][str(layer)] = rows[b]
        del do
    return [{"length": length, "backend": b, **summary(layers[b]), "layers": layers[b]} for b in backends]


def _time_arm(q: Tensor, k: Tensor, v: Tensor, do: Tensor, arm: Arm, layer: int, settings: Settings, length: int):
    """Per backend of ``settings.timed_backends``: the arm's step's milliseconds on it, its estimate's milliseconds and
    its pattern's density (``time_arms``)."""
    from mtraining.ops import PatternConfig, estimate_pattern

    config = PatternConfig.from_settings(block_size=settings.block_size, **arm.pattern(length, settings))
    steps = {
        b: median_ms(sparse_step(q, k, v, do, config, layer, b), settings.speed_repeats)
        for b in settings.timed_backends
    }
    estimate = functools.partial(estimate_pattern, q, k, config, layer_idx=layer)
    shared = {
        "estimate_ms": median_ms(estimate, settings.speed_repeats),
        "density": float(estimate().density().float().mean()),
    }
    return {b: {"ms": ms, **shared} for b, ms in steps.items()}


def summary(layers: dict[str, dict]) -> dict:
    """From per-layer rows (``time_arms``'s): the dense milliseconds summed over the layers and, per arm, its
    speedup (dense over sparse, each summed over the layers), its summed milliseconds and its mean density."""
    dense = sum(row["dense_ms"] for row in layers.values())
    names = list(next(iter(layers.values()))["arms"])
    arms = {}
    for name in names:
        sparse_ms = sum(row["arms"][name]["ms"] for row in layers.values())
        arms[name] = {
            "attention_speedup": dense / sparse_ms if sparse_ms else math.nan,
            "sparse_ms": sparse_ms,
            "density": statistics.fmean(row["arms"][name]["density"] for row in layers.values()),
        }
    return {"dense_ms": dense, "arms": arms}


def text_ids(tokenizer, docs: list[str], length: int) -> Tensor:
    """The first ``length`` ids of ``docs`` tokenised one after another (cycled when they hold fewer), each
    document followed by the tokenizer's EOS."""
    ids: list[int] = []
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    while len(ids) < length:
        before = len(ids)
        for doc in docs:
            ids += tokenizer.encode(doc[: 8 * (length - len(ids))]) + eos
            if len(ids) >= length:
                break
        if len(ids) == before:
            raise ValueError("the held-out documents hold no tokens to dump Q/K/V from")
    return torch.tensor(ids[:length])


def combine_backends(found: list[list[dict]]) -> list[dict]:
    """``combine`` of several documents' ``time_arms`` results, backend by backend (in ``time_arms``'s order)."""
    return [combine(list(docs)) for docs in zip(*found)]


def combine(found: list[dict]) -> dict:
    """``time_arms``'s results on several documents at one length as one: each layer's times summed over the
    documents and its densities averaged, then ``summary`` of those layers (so the speedup is of every document);
    each document's own speedup and density kept in ``documents``."""
    first = found[0]
    names = list(first["arms"])
    layers = {}
    for layer in first["layers"]:
        rows = [f["layers"][layer] for f in found]
        arms = {
            a: {
                "ms": sum(r["arms"][a]["ms"] for r in rows),
                "estimate_ms": sum(r["arms"][a]["estimate_ms"] for r in rows),
                "density": statistics.fmean(r["arms"][a]["density"] for r in rows),
            }
            for a in names
        }
        layers[layer] = {"dense_ms": sum(r["dense_ms"] for r in rows), "arms": arms}
    documents = [
        {
            "dense_ms": f["dense_ms"],
            "arms": {a: {k: f["arms"][a][k] for k in ("attention_speedup", "density")} for a in names},
        }
        for f in found
    ]
    backend = {"backend": first["backend"]} if "backend" in first else {}
    return {"length": first["length"], **backend, **summary(layers), "layers": layers, "documents": documents}

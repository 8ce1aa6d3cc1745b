"""Route Hugging Face attention through mtraining: ``attn_implementation="mtraining"``.

``register()`` adds our function to transformers' attention registry; any Qwen2/Qwen2.5/Qwen3/
Llama/Mistral model built with ``attn_implementation="mtraining"`` then calls it in every layer.
What it does is set by an ``AttentionContext`` that ``bind(model, ctx)`` attaches to the model's
attention modules (the trainer owns it): dense or dynamic sparse, single device or a ring over a
context-parallel group in a layout. Unbound modules run dense causal attention on one device.

HF hands over query [B, Hq, S, D] and key/value [B, Hkv, S, D]; we pass transposed *views* in our
[B, S, H, D] convention, so K/V heads are never repeated for GQA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch.distributed as dist
from torch import Tensor, nn

from ..ops.pattern import VerticalSlashPattern
from ..ops.pattern.estimate import PatternConfig, estimate_pattern
from ..ops.sparse.attention import sparse_attention
from ..parallel.estimate import estimate_pattern_cp
from ..parallel.layout import Layout
from ..parallel.ring import ring_attention
from .recall import pattern_recall

ATTN_IMPLEMENTATION = "mtraining"
CONTEXT_ATTR = "mtraining_context"


@dataclass
class PatternStats:
    """One layer's sparse pattern on the last forward: kept fraction of causal pairs, estimated recall,
    and whether the layer ran dense instead (density above ``AttentionContext.max_density``)."""

    density: float
    recall: float | None
    ran_dense: bool = False


@dataclass
class AttentionContext:
    """Everything the attention function needs besides tensors (set by the trainer, read per call).

    Attributes:
        group: context-parallel process group (None: single device).
        layout: how the global sequence is split over ``group`` (required when it has > 1 rank).
        pattern_config: a ``PatternConfig`` (mtraining.ops.pattern) for dynamic sparse attention;
            None: dense everywhere.
        dense_layers: layers that always run dense.
        min_sparse_len: global sequence lengths below this run dense (sparse does not pay).
        max_density: a layer whose estimated pattern keeps more than this fraction of the causal
            pairs runs dense for that call (sparse kernels are slower than dense there); None: never.
        backend: "auto", "torch" or "triton".
        ring: "flat" or "hierarchical" (``ring_attention``'s ring); ``inner_size``: ranks per inner ring
            of the hierarchical ring (default there: LOCAL_WORLD_SIZE).
        record: what each sparse layer records in ``stats``: nothing, density, or density and recall
            (recall costs about one more estimation pass). The trainer turns it off for the backward
            pass, where activation checkpointing recomputes the forward.
        stats: per-layer ``PatternStats`` of the last recorded forward (for logging).
        replay_patterns: None, or a dict in which each sparse layer's forward keeps the pattern it
            ran with (None: it ran dense) while ``replay`` is False, and from which it takes that
            pattern back while ``replay`` is True instead of estimating again. The trainer uses it
            under activation checkpointing: the forward recomputed in the backward is then exactly
            the forward, without a second estimation.
        replay: see ``replay_patterns``.
        replay_outputs: None, or a dict in which each layer's forward keeps its attention (out, lse)
            while ``replay`` is False, and from which the recomputed forward (``replay`` True) takes
            them back instead of running attention again: one [B, S, Hq, D] output per layer held
            from the forward to the backward, for a backward without the attention forward kernels.
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
    record: Literal["off", "density", "recall"] = "density"
    stats: dict[int, PatternStats] = field(default_factory=dict)
    replay_patterns: dict[int, VerticalSlashPattern | None] | None = None
    replay: bool = False
    replay_outputs: dict[int, tuple[Tensor, Tensor]] | None = None

    def __post_init__(self) -> None:
        if self.cp_size > 1 and self.layout is None:
            raise ValueError("a context-parallel group needs a layout: pass layout=make_layout(...)")
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


def mtraining_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """The registered attention function: HF layout in, [B, S, Hq, D] out (as HF expects)."""
    if attention_mask is not None:
        raise ValueError(
            "mtraining attention takes no attention mask (causal by position): pack documents into full "
            "sequences instead of padding, and call the model without attention_mask"
        )
    if dropout:
        raise ValueError(f"attention dropout {dropout} is not supported; set the model config's attention_dropout: 0")
    if sliding_window is not None:
        raise ValueError(
            f"sliding-window attention (window {sliding_window}) is not supported; set the model config's "
            "sliding_window: null (and use_sliding_window: false)"
        )
    ctx: AttentionContext = getattr(module, CONTEXT_ATTR, None) or AttentionContext()
    layer = int(getattr(module, "layer_idx", 0) or 0)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    cp = ctx.cp_size > 1
    config = ctx.sparse_for(layer, ctx.layout.seq_len if cp else k.shape[1])
    pattern = None
    saved = ctx.replay_patterns
    if config is not None and ctx.replay and saved is not None and layer in saved:
        pattern = saved.pop(layer)
    elif config is not None:
        pattern = _decide(ctx, config, layer, q, k, scale, cp)
        if saved is not None:
            saved[layer] = pattern
    outputs = ctx.replay_outputs
    reuse = outputs.pop(layer, None) if outputs is not None and ctx.replay else None
    if cp:
        out, lse = ring_attention(
            q,
            k,
            v,
            ctx.group,
            ctx.layout,
            pattern=pattern,
            softmax_scale=scale,
            return_lse=True,
            backend=ctx.backend,
            layer_idx=layer,
            ring=ctx.ring,
            inner_size=ctx.inner_size if ctx.ring == "hierarchical" else None,
            reuse=reuse,
        )
    else:
        out, lse = sparse_attention(
            q, k, v, pattern, softmax_scale=scale, return_lse=True, backend=ctx.backend, reuse=reuse
        )
    if outputs is not None and not ctx.replay:
        outputs[layer] = (out.detach(), lse)
    return out, None


def _decide(ctx: AttentionContext, config: PatternConfig, layer: int, q: Tensor, k: Tensor, scale: float, cp: bool):
    """This layer's pattern for this call (None: run dense), with its stats recorded as asked."""
    pattern = _estimate(ctx, config, layer, q.detach(), k.detach(), scale)
    measured = ctx.record != "off" or ctx.max_density is not None
    density = float(pattern.density().mean()) if measured else None
    # the same decision on every rank: the pattern, so its density, is global
    ran_dense = ctx.max_density is not None and density > ctx.max_density
    if ctx.record != "off":
        recall = None
        if ctx.record == "recall":
            group, layout = (ctx.group, ctx.layout) if cp else (None, None)
            recall = pattern_recall(q.detach(), k.detach(), pattern, config.last_q, scale, group, layout)
        ctx.stats[layer] = PatternStats(density=density, recall=recall, ran_dense=ran_dense)
    return None if ran_dense else pattern


def _estimate(ctx: AttentionContext, config: PatternConfig, layer: int, q: Tensor, k: Tensor, scale: float):
    """The global pattern of this layer from the current q/k (identical on every rank of the ring)."""
    if ctx.cp_size > 1:
        return estimate_pattern_cp(q, k, config, ctx.group, ctx.layout, layer_idx=layer, softmax_scale=scale)
    return estimate_pattern(q, k, config, layer_idx=layer, softmax_scale=scale)


def no_mask(attention_mask: Tensor | None = None, **kwargs) -> None:
    """Mask builder for "mtraining": none is needed (causal by global position); padding is refused.

    Without a registered builder transformers would drop a 2-D padding mask silently.
    """
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise ValueError(
            "mtraining attention does not support padding masks (causal by position): pack documents into "
            "full sequences instead of padding, and call the model without attention_mask"
        )
    return None


def register() -> None:
    """Add ``"mtraining"`` to transformers' attention and mask registries (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, mtraining_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, no_mask)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The model's self-attention modules (those HF calls the attention function from)."""
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]


def bind(model: nn.Module, ctx: AttentionContext) -> AttentionContext:
    """Make every attention module of ``model`` use ``ctx``; returns it."""
    modules = attention_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no attention modules with layer_idx and o_proj to bind")
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"the model runs attn_implementation={model.config._attn_implementation!r}; build or load it with "
            f'attn_implementation="{ATTN_IMPLEMENTATION}" (mtraining.models.build_model does)'
        )
    for m in modules:
        setattr(m, CONTEXT_ATTR, ctx)
    return ctx

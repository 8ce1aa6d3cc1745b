"""Route Hugging Face attention through mtraining: ``attn_implementation="mtraining"``.

``register()`` adds our function to transformers' attention registry; any Qwen2/Qwen2.5/Qwen3/
Llama/Mistral model built with ``attn_implementation="mtraining"`` then calls it in every layer.
What it does is set by the ``Attention`` object (attention.py) that ``bind(model, attention)``
attaches to the model's attention modules (the trainer or the evaluation owns it): dense or dynamic
sparse, single device or a ring over a context-parallel group in a layout, and which pass the model
runs in. Unbound modules run dense causal attention on one device.

HF hands over query [B, Hq, S, D] and key/value [B, Hkv, S, D]; we pass transposed *views* in our
[B, S, H, D] convention, so K/V heads are never repeated for GQA. The model's ``position_ids`` go
along: packed ones (restarting at 0) mark documents on one device (attention.py).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .attention import Attention

ATTN_IMPLEMENTATION = "mtraining"
ATTENTION_ATTR = "mtraining_binding"


@torch.compiler.disable  # a graph break in compiled layers (compiled.py): rings and kernels run eagerly
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
    attention: Attention = getattr(module, ATTENTION_ATTR, None) or Attention()
    layer = int(getattr(module, "layer_idx", 0) or 0)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    return attention.attend(layer, q, k, v, scale, kwargs.get("position_ids")), None


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


def bind(model: nn.Module, attention: Attention) -> Attention:
    """Make every attention module of ``model`` run ``attention`` (models/attention.py); returns it."""
    modules = attention_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no attention modules with layer_idx and o_proj to bind")
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"the model runs attn_implementation={model.config._attn_implementation!r}; build or load it with "
            f'attn_implementation="{ATTN_IMPLEMENTATION}" (mtraining.models.build_model does)'
        )
    for m in modules:
        setattr(m, ATTENTION_ATTR, attention)
    return attention

"""``train.compile``: torch.compile of each decoder layer, the attention call left eager.

As torchtitan does, each decoder layer is compiled on its own (``nn.Module.compile``: in place, so
activation checkpointing and FSDP2 wrap it as before and every layer reuses one compiled code):
its norms, projections, RoPE and MLP become a few fused kernels. Our attention call is a graph break
(``mtraining_attention`` runs under ``torch.compiler.disable``, adapter.py): the rings, the pattern
estimate, the host-side plans and caches and the Triton kernels run as they do without compile, and each
layer compiles to two graphs, before and after attention. The first step pays the compilation.
"""

from __future__ import annotations

from torch import nn

from .adapter import attention_modules


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a Hugging Face causal LM (the modules holding its attention modules)."""
    inner = {id(m) for m in attention_modules(model)}
    layers = [m for m in model.modules() if any(id(c) in inner for c in m.children())]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layers holding attention modules to compile")
    return layers


def compile_layers(model: nn.Module, backend: str = "inductor") -> int:
    """Compile every decoder layer of ``model`` in place with torch.compile's ``backend``; returns how many."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(backend=backend)
    return len(layers)

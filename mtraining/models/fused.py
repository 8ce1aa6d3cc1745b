"""Optional fused kernels for the decoder layers' elementwise work, from liger-kernel.

At 128K tokens the RMSNorms, the SwiGLU activation and RoPE of Qwen2.5-3B run as many separate
elementwise kernels over [tokens, hidden] tensors. liger-kernel fuses each into one Triton kernel
(forward and backward). The cross-entropy stays ours (``train.loss_impl`` chooses it).
"""

from __future__ import annotations

from torch import nn

_PATCHES = {  # model_type -> liger-kernel's patch function
    "qwen2": "apply_liger_kernel_to_qwen2",
    "qwen3": "apply_liger_kernel_to_qwen3",
    "llama": "apply_liger_kernel_to_llama",
    "mistral": "apply_liger_kernel_to_mistral",
}


def use_liger_kernels(model: nn.Module) -> None:
    """Swap ``model``'s RMSNorm, SwiGLU MLP and rotary embedding for liger-kernel's fused kernels (CUDA).

    liger-kernel also replaces the rotary function of the model's transformers module, so every model
    of that type in this process uses it afterwards.
    """
    model_type = model.config.model_type
    if model_type not in _PATCHES:
        raise ValueError(
            f"train.fused_kernels=liger supports model types {sorted(_PATCHES)}, not {model_type!r}; "
            "set train.fused_kernels=none"
        )
    try:
        import liger_kernel.transformers as liger
    except ImportError:
        raise ValueError("train.fused_kernels=liger needs liger-kernel: pip install liger-kernel (CUDA only)") from None
    patch = getattr(liger, _PATCHES[model_type])
    patch(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False, model=model)

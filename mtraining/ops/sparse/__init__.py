"""Sparse attention: the autograd op ``sparse_attention``, its per-chunk primitives and backends.

attention.py (dispatch, the dense-or-sparse decision, the autograd op), launch.py (Triton launches),
kernels.py (the attention kernels), index.py / index_kernels.py (kernel indices: torch and Triton builders),
fa4.py / block_lists.py (backend="fa4": a pattern's blocks by FlashAttention-4, the verticals by the Triton kernels).
"""

from .attention import attention_backward, attention_delta, attention_forward, sparse_attention
from .fa4 import installed as fa4_installed

__all__ = ["attention_backward", "attention_delta", "attention_forward", "fa4_installed", "sparse_attention"]

"""Sparse attention: the autograd op ``sparse_attention``, its per-chunk primitives and backends.

attention.py (dispatch, the dense-or-sparse decision, the autograd op), launch.py (Triton launches),
kernels.py (the attention kernels), index.py / index_kernels.py (kernel indices: torch and Triton builders).
"""

from .attention import attention_backward, attention_delta, attention_forward, sparse_attention

__all__ = ["attention_backward", "attention_delta", "attention_forward", "sparse_attention"]

"""Single-device attention math, one folder per family.

- ``ops.pattern``: the vertical-slash pattern and its online estimation (``estimate_pattern``);
- ``ops.sparse``: the sparse attention op (``sparse_attention``): dispatch, autograd, Triton kernels;
- ``ops.dense``: a dense causal chunk pair as a few dense blocks (cuDNN on CUDA);
- ``ops.reference``: the plain-PyTorch backend; ``ops.oracle``: the float64 oracle every path is tested against;
- ``ops.documents``: packed documents (``Documents``): per-document causal masking;
- ``ops.numerics``: accumulation dtype, LSE merge, the backward's row term; ``ops.checks``: input validation.
"""

from .documents import Documents
from .oracle import attention_oracle
from .pattern import Budgets, PatternConfig, VerticalSlashPattern, estimate_pattern, load_budgets
from .sparse import sparse_attention

__all__ = ["Budgets", "Documents", "PatternConfig", "VerticalSlashPattern", "attention_oracle", "estimate_pattern"]
__all__ += ["load_budgets", "sparse_attention"]

"""Single-device attention math, one folder per family.

- ``ops.pattern``: the vertical-slash pattern (which pairs every path computes);
- ``ops.estimate``: its online estimation from q/k (``estimate_pattern``), above the sparse op it runs;
- ``ops.sparse``: the sparse attention op (``sparse_attention``): dispatch, autograd, Triton kernels;
- ``ops.dense``: a dense causal chunk pair as a few dense blocks (cuDNN on CUDA);
- ``ops.reference``: the plain-PyTorch backend; ``ops.oracle``: the float64 oracle every path is tested against;
- ``ops.documents``: packed documents (``Documents``): per-document causal masking;
- ``ops.numerics``: accumulation dtype, LSE merge, the backward's row term; ``ops.checks``: input validation.
"""

from .documents import Documents
from .estimate import Budgets, PatternConfig, estimate_pattern, load_budgets
from .oracle import attention_oracle
from .pattern import VerticalSlashPattern
from .sparse import fa4_installed, sparse_attention

__all__ = ["Budgets", "Documents", "PatternConfig", "VerticalSlashPattern", "attention_oracle", "estimate_pattern"]
__all__ += ["fa4_installed", "load_budgets", "sparse_attention"]

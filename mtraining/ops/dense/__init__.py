"""Dense causal attention of a chunk pair as a few dense blocks (cuDNN on CUDA), merged by LSE.

blocks.py (the decomposition and the block runner), cudnn.py (per-block attention through cuDNN),
select.py (which path dense calls take: ``dense_blocks``, ``MTRAINING_DENSE_BACKEND``).
"""

from .blocks import MAX_BLOCKS, Block, BlockOps, DenseBlocks, decompose, decompose_default, default_blocks
from .cudnn import CUDNN
from .select import ENV_VAR, REFERENCE, dense_backend, dense_blocks, dense_setting, select_ops

__all__ = [
    "MAX_BLOCKS",
    "Block",
    "BlockOps",
    "DenseBlocks",
    "decompose",
    "decompose_default",
    "default_blocks",
    "CUDNN",
    "ENV_VAR",
]
__all__ += ["REFERENCE", "dense_backend", "dense_blocks", "dense_setting", "select_ops"]

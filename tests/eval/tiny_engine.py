"""A tiny float64 Qwen2 with large random weights (greedy answers depend on the whole context), its inputs and
attention settings: what the engine tests run in one process and on context-parallel ranks."""

from __future__ import annotations

import torch

from mtraining.eval.engine import AttentionSpec
from mtraining.models import build_model
from tests.configs import TINY as TINY_BASE

TINY = TINY_BASE | dict(max_position_embeddings=4096, initializer_range=0.2)
G = 16
SEQ = 256  # a multiple of every layout's unit for 2 and 4 ranks (zigzag on 4: 2 * 4 * 16 = 128)
PROMPTS = (40, 200, 301)  # padded to the layout's unit on several ranks (unit 32 to 128), and unpadded
SPARSE = dict(v_size=8, s_size=24, last_q=16, local_window=16, sink_tokens=4)


def tiny_model():
    """The model, seeded: the same weights in every process."""
    torch.manual_seed(0)
    return build_model(config=TINY).double().eval()


def inputs():
    """(ids of SEQ tokens, prompts of PROMPTS lengths), seeded."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TINY["vocab_size"], (SEQ,), generator=gen)
    prompts = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for n in PROMPTS]
    return ids, prompts


def spec(layout: str, sparse: bool, context_mode: str = "ring", ring: str = "flat") -> AttentionSpec:
    """Torch-backend attention in ``layout``, dense or sparse with the SPARSE budgets, over ``context_mode`` (on the
    ``ring``; "hierarchical": inner rings of 2)."""
    return AttentionSpec(
        sparse=sparse,
        layout=layout,
        ring=ring,
        inner_size=2 if ring == "hierarchical" else None,
        block_size=G,
        backend="torch",
        pattern=SPARSE if sparse else {},
        context_mode=context_mode,
    )

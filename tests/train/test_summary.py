"""The start-up summary's attention line says what the sparse lines are estimated from."""

from __future__ import annotations

from pathlib import Path

from mtraining.train.config import load_config
from mtraining.train.summary import attention_plan

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"


def test_attention_plan_says_whether_packed_documents_estimate_their_own_lines():
    unmasked = attention_plan(load_config(TINY), 4)
    masked = attention_plan(load_config(TINY, ["data.document_masking=true"]), 4)
    assert unmasked.startswith("layer 0 dense; layers 1-3 sparse")
    assert "not masked: one pattern per sample" in unmasked and "data.document_masking: true" in unmasked
    assert masked.endswith("packed documents masked, each estimating its own lines")
    dense = attention_plan(load_config(TINY, ["attention.sparse=false"]), 4)
    assert dense == "dense causal in all 4 layers"  # no lines, nothing to say about documents


def test_attention_plan_names_the_block_columns():
    assert "columns" not in attention_plan(load_config(TINY), 4)
    plan = attention_plan(load_config(TINY, ["attention.block_columns=8"]), 4)
    assert "8 columns per 32-row block" in plan


def test_attention_plan_says_where_fa4_runs_the_sparse_calls():
    on = ["attention.backend=fa4", "parallel.context=1", "train.device=auto", "model.dtype=bfloat16"]
    assert "fa4" not in attention_plan(load_config(TINY), 4)
    plan = attention_plan(load_config(TINY, [*on, "attention.block_size=128"]), 4)
    assert plan.endswith("sparse calls on fa4 (FlashAttention-4's block-sparse kernels, the verticals on triton)")
    masked = attention_plan(load_config(TINY, [*on, "attention.block_size=128", "data.document_masking=true"]), 4)
    assert masked.endswith("those of samples packing several documents on triton")

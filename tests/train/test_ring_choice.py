"""parallel.ring: auto asks the ring cost model; flat and hierarchical are taken as given."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from mtraining.train.config import load_config
from mtraining.train.ring_choice import choose_ring

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
QWEN_3B = SimpleNamespace(num_attention_heads=16, num_key_value_heads=2, hidden_size=2048)  # head_dim 128


def _choose(*overrides: str, local: int | None = 8):
    long = ["data.seq_len=524288", "attention.v_size=1024", "attention.s_size=6144", "model.dtype=bfloat16"]
    return choose_ring(load_config(TINY, [*long, *overrides]), local, QWEN_3B)


def test_one_node_or_no_torchrun_is_the_flat_ring():
    assert _choose("parallel.context=8").ring == "flat"
    assert _choose("parallel.context=8", local=None).reason == "parallel.ring=auto: one node"
    assert _choose("parallel.context=1").ring == "flat"
    assert _choose("parallel.context=16", "parallel.context_mode=allgather").ring == "flat"


def test_several_nodes_over_a_slow_link_take_the_hierarchical_ring():
    sparse = _choose("parallel.context=32")  # 4 nodes of 8 at 25 GB/s: sparse steps do not hide the hop
    assert (sparse.ring, sparse.inner_size) == ("hierarchical", 8)
    assert "4 nodes at 25 GB/s, predicted" in sparse.reason and "ms hierarchical per layer" in sparse.reason
    fast = _choose("parallel.context=32", "parallel.inter_node_gbps=4000")  # the link hides behind compute
    assert fast.ring == "flat" and "predicted" in fast.reason


def test_dense_long_steps_hide_a_fast_link():
    """Dense steps at 512K take tens of ms: a 100 GB/s link's hop hides behind them, the hierarchy gains nothing."""
    assert _choose("parallel.context=16", "attention.sparse=false", "parallel.inter_node_gbps=100").ring == "flat"
    assert _choose("parallel.context=16", "attention.sparse=false", "parallel.inter_node_gbps=1").ring == "hierarchical"


def test_explicit_rings_are_kept_and_validated():
    assert _choose("parallel.context=32", "parallel.ring=flat").ring == "flat"
    chosen = _choose("parallel.context=8", "parallel.ring=hierarchical", local=4)
    assert (chosen.ring, chosen.inner_size, chosen.reason) == ("hierarchical", 4, "parallel.ring=hierarchical")
    with pytest.raises(ValueError, match="launch with torchrun"):
        _choose("parallel.context=8", "parallel.ring=hierarchical", local=None)

"""torch.compile of the decoder layers (``train.compile``): our attention is one graph break, the rest compiles."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from mtraining.models import Attention, bind, build_model
from mtraining.models.compiled import compile_layers, decoder_layers
from mtraining.ops.estimate.estimator import PatternConfig
from tests.configs import SMALL

SPARSE = PatternConfig(v_size=8, s_size=16, last_q=16, block_size=16, sink_tokens=2, local_window=16)


def test_attention_is_the_only_graph_break():
    """Two sparse steps of a compiled two-layer model: each layer compiles to two graphs (before and after the
    attention call), whose only break is the disabled attention function; outputs and gradients equal eager's."""
    torch._dynamo.reset()
    counters.clear()
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = build_model(config={**SMALL, "model_type": "qwen2"})
        if compiled:
            assert compile_layers(model, "eager") == 2
        attention = bind(model, Attention(pattern_config=SPARSE, max_density=None))
        for seed in (0, 1):
            ids = torch.randint(0, SMALL["vocab_size"], (1, 64), generator=torch.Generator().manual_seed(seed))
            with attention.forward():
                logits = model(input_ids=ids, use_cache=False).logits
            logits.pow(2).mean().backward()
            results.append((logits.detach(), model.model.layers[0].mlp.up_proj.weight.grad.clone()))
    for eager, compiled in zip(results[:2], results[2:]):
        for a, b in zip(eager, compiled):
            torch.testing.assert_close(a, b)
    breaks = list(counters["graph_break"])
    assert breaks and all("mtraining_attention" in reason for reason in breaks), breaks
    assert counters["stats"]["unique_graphs"] <= 4


def test_decoder_layers_are_found_or_named():
    model = build_model(config={**SMALL, "model_type": "qwen2"})
    assert decoder_layers(model) == list(model.model.layers)
    with pytest.raises(ValueError, match="no decoder layers holding attention modules"):
        decoder_layers(torch.nn.Linear(2, 2))

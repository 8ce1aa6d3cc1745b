"""``Engine``'s decoding backends and the seconds it records per phase (``Engine.phases``)."""

from __future__ import annotations

import torch

from mtraining.eval.engine import Engine
from tests.eval.tiny_engine import inputs, spec, tiny_model


def test_decoding_never_runs_cudnn(monkeypatch):
    """Every decoding step has a new key length; SDPA's cuDNN backend (which recent torch prefers on Hopper)
    builds an execution plan per shape, so decoding turns it off for its steps (and only for them)."""
    enabled = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        enabled.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    _, prompts = inputs()
    engine = Engine(tiny_model(), spec("striped", sparse=False), None)
    tokens = engine.generate(prompts[0], 4)
    assert len(tokens) == 4 and enabled and not any(enabled)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after decoding


def test_phases_add_up_prefills_steps_and_losses():
    ids, prompts = inputs()
    engine = Engine(tiny_model(), spec("striped", sparse=True), None)
    first = engine.respond(prompts[0], 5, reference=[3, 4])
    second = engine.respond(prompts[1], 3)
    engine.token_scores(ids)
    p = engine.phases
    assert (p.prefills, p.decode_steps, p.losses) == (2, len(first.tokens) + len(second.tokens) - 2, 1)
    assert p.decode_steps == 6 and p.prefill_s > 0 and p.decode_s > 0 and p.loss_s > 0

"""A hand-built one-layer Llama that retrieves a needle by attention, for tests of what the prompt's attention sees.

Vocabulary (64 ids, one-hot embeddings): 0 the sink (first token), 1..10 values, 11 the question, 12..63 filler.
The question's query meets only the values' keys (on a rotary dimension that barely turns over a few hundred
positions), scored 18 above every other key, so its attention lands on the needle; the needle's value is copied
to the residual and read out by the head: the greedy token after the question is the needle's value. A pattern
that does not keep the needle's key for the question's row leaves the question with filler values (zero), every
logit 0, and the prediction is token 0.
"""

from __future__ import annotations

import random

import torch

from mtraining.models import build_model

VOCAB, SINK, QUESTION, FILLER = 64, 0, 11, range(12, 64)
VALUES = range(1, 11)
CONFIG = dict(
    model_type="llama",
    vocab_size=VOCAB,
    hidden_size=VOCAB,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=1,
    num_key_value_heads=1,
    head_dim=VOCAB,
    max_position_embeddings=4096,
    rope_theta=1e6,
    tie_word_embeddings=False,
)
_SLOW = 31  # a rotary dimension that turns by 1.5e-6 rad per position (rope_theta 1e6)
_GAIN = 1.5  # query and key scale: score 8 * 1.5**2 = 18 between the question and a value


def needle_model() -> torch.nn.Module:
    """The model in float64 (eval mode)."""
    model = build_model(config=CONFIG).double().eval()
    eye = torch.eye(VOCAB, dtype=torch.float64)
    layer = model.model.layers[0]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.embed_tokens.weight.copy_(eye)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, model.model.norm):
            norm.weight.fill_(1.0)
        attn = layer.self_attn
        attn.q_proj.weight[_SLOW, QUESTION] = _GAIN
        for t in VALUES:
            attn.k_proj.weight[_SLOW, t] = _GAIN
            attn.v_proj.weight[t, t] = 1.0
            attn.o_proj.weight[t, t] = 1.0
            model.lm_head.weight[t, t] = 1.0
    return model


def needle_prompt(length: int, needle_at: int, value: int, seed: int = 0) -> list[int]:
    """The sink, filler with ``value`` at position ``needle_at``, and the question last: ``length`` ids."""
    rng = random.Random(seed)
    ids = [SINK] + [rng.choice(FILLER) for _ in range(length - 2)] + [QUESTION]
    ids[needle_at] = value
    return ids

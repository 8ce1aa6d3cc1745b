"""attn_implementation="mtraining" on Qwen2/Qwen3/Llama/Mistral equals HF's eager attention; loading and errors."""

from __future__ import annotations

import pytest
import torch

from mtraining.models import Attention, attention, bind, build_config, build_model
from mtraining.ops.estimate.estimator import PatternConfig
from tests.configs import SMALL

ARCHS = {
    "qwen2": {},
    "qwen3": {"head_dim": 8},
    "llama": {},
    "mistral": {"sliding_window": None},
}


def _pair(model_type: str):
    torch.manual_seed(0)
    config = dict(model_type=model_type, **SMALL, **ARCHS[model_type])
    ours = build_model(config=config).double()
    eager = build_model(config=config, attn_implementation="eager").double()
    eager.load_state_dict(ours.state_dict())
    return ours, eager


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_matches_eager_attention(model_type):
    ours, eager = _pair(model_type)
    ids = torch.randint(0, 96, (2, 40))
    out = ours(input_ids=ids, labels=ids, use_cache=False)
    ref = eager(input_ids=ids, labels=ids, use_cache=False)
    # eager takes its softmax in float32 even for float64 models
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-6, atol=1e-6)
    out.loss.backward()
    ref.loss.backward()
    for (name, p), q in zip(ours.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_gqa_heads_are_passed_as_views_without_copies(monkeypatch):
    seen = []
    real = attention.sparse_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.shape[2], k.shape[2], k._base is not None))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(attention, "sparse_attention", spy)
    model, _ = _pair("qwen2")
    model(input_ids=torch.randint(0, 96, (1, 16)), use_cache=False)
    assert seen == [(4, 2, True)] * 2


def test_unsupported_features_fail_clearly():
    model, _ = _pair("qwen2")
    ids = torch.randint(0, 96, (1, 8))
    full = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(model(input_ids=ids, attention_mask=torch.ones(1, 8), use_cache=False).logits, full)
    with pytest.raises(ValueError, match="pack documents"):
        model(input_ids=ids, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]]), use_cache=False)
    mistral = build_model(config=dict(model_type="mistral", **SMALL, sliding_window=4))
    with pytest.raises(ValueError, match="sliding_window: null"):
        mistral(input_ids=ids, use_cache=False)
    sdpa = build_model(config=dict(model_type="llama", **SMALL), attn_implementation="sdpa")
    with pytest.raises(ValueError, match='attn_implementation="mtraining"'):
        bind(sdpa, Attention())
    with pytest.raises(ValueError, match="not supported"):
        build_config(config=dict(model_type="gpt2"))


def test_sparse_needs_the_right_pattern_block_and_budget():
    model, _ = _pair("llama")
    bind(
        model,
        Attention(pattern_config=PatternConfig(v_size=64, s_size=64, last_q=8, block_size=16, local_window=16)),
    )
    with pytest.raises(ValueError, match="lower v_size"):
        model(input_ids=torch.randint(0, 96, (1, 32)), use_cache=False)


def test_local_directory_round_trip_and_rope_base(tmp_path):
    model, _ = _pair("qwen2")
    model.save_pretrained(tmp_path / "m")
    loaded = build_model(path=tmp_path / "m", rope_theta=5e5)
    assert loaded.config._attn_implementation == "mtraining"
    assert loaded.config.rope_parameters["rope_theta"] == 5e5
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a.float(), b), name
    with pytest.raises(ValueError, match="no config.json"):
        build_model(path=tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((tmp_path / "m" / "config.json").read_text())
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        build_model(path=tmp_path / "empty")


def test_generation_with_a_kv_cache_matches_eager():
    ours, eager = _pair("qwen2")
    prompt = torch.randint(0, 96, (1, 10))
    greedy = dict(max_new_tokens=6, do_sample=False)
    assert torch.equal(ours.generate(prompt, **greedy), eager.generate(prompt, **greedy))


def test_dense_fallback_above_max_density():
    """A layer whose estimated pattern is denser than max_density runs dense (and says so); below it, sparse."""
    ours, eager = _pair("qwen2")
    ids = torch.randint(0, 96, (1, 64))
    sparse = PatternConfig(v_size=8, s_size=16, last_q=8, block_size=16, sink_tokens=2, local_window=16)
    ref = eager(input_ids=ids, use_cache=False).logits
    fallback = bind(ours, Attention(pattern_config=sparse, max_density=0.01))
    with fallback.forward():
        torch.testing.assert_close(ours(input_ids=ids, use_cache=False).logits, ref, rtol=1e-6, atol=1e-6)
    stats = fallback.end_step()
    assert all(s.ran_dense and s.density > 0.01 for s in stats.layers.values()) and stats.dense_fallback == 2
    never = bind(ours, Attention(pattern_config=sparse, max_density=None))
    with never.forward():
        out = ours(input_ids=ids, use_cache=False).logits
    assert never.end_step().dense_fallback == 0
    assert (out - ref).abs().max() > 1e-4  # the sparse pattern drops pairs: a different result


@pytest.mark.slow
@pytest.mark.parametrize("firsts", [(0, 0, 0), (0, 5, 3), (4, 0, 9)], ids=["restart at 0", "elsewhere", "cut first"])
@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_packed_position_ids_mask_documents(model_type, firsts, monkeypatch):
    """Packed position ids mark documents wherever an id does not continue the previous one (restarting at 0,
    Hugging Face's packing, or at any other value: issue 34.2), and each document's logits and gradients equal
    those of the document run alone with its ids (eager attention)."""
    ours, eager = _pair(model_type)
    lengths = [13, 20, 7]
    ids = torch.randint(0, 96, (1, sum(lengths)))
    position_ids = torch.cat([torch.arange(n) + first for n, first in zip(lengths, firsts)])[None]
    out = ours(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    out.square().sum().backward()
    start = 0
    for n in lengths:
        piece = ids[:, start : start + n]
        ref = eager(input_ids=piece, position_ids=position_ids[:, start : start + n], use_cache=False).logits
        torch.testing.assert_close(out[:, start : start + n], ref, rtol=1e-6, atol=1e-6)
        ref.square().sum().backward()
        start += n
    for (name, p), q in zip(ours.named_parameters(), eager.parameters()):
        atol = 2e-6 * float(q.grad.abs().max())  # HF's RMSNorm runs in float32: errors scale with the gradient
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=atol, msg=name)
    # the check can fail: without the boundaries the later documents see the earlier ones
    monkeypatch.setattr(Attention, "_position_documents_of", lambda self, *args: None)
    crossed = ours(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    assert not torch.allclose(crossed[:, 13:], out[:, 13:], atol=1e-3)

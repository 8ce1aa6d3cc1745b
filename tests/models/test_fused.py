"""train.fused_kernels=liger: clear errors without CUDA or liger-kernel; on a GPU, the same numbers."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from mtraining.models import build_model
from mtraining.models.fused import use_liger_kernels
from mtraining.train.config import parse_config
from tests.configs import TINY


def test_liger_needs_cuda_and_names_the_fix():
    raw = {
        "model": {"config": TINY},
        "data": {"sources": ["x.jsonl"], "seq_len": 128},
        "train": {"steps": 1, "device": "cpu", "fused_kernels": "liger"},
    }
    with pytest.raises(ValueError, match="set train.fused_kernels=none"):
        parse_config(raw, [])


def test_liger_missing_package_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)  # import fails as if not installed
    with pytest.raises(ValueError, match="pip install liger-kernel"):
        use_liger_kernels(build_model(config=TINY))


def test_liger_unknown_model_type():
    model = torch.nn.Linear(2, 2)
    model.config = SimpleNamespace(model_type="gpt2")
    with pytest.raises(ValueError, match="supports model types"):
        use_liger_kernels(model)


@pytest.mark.cuda
def test_liger_kernels_match_the_model_on_gpu(monkeypatch):
    """bf16 logits and gradients of a tiny Qwen2 with and without the fused kernels."""
    pytest.importorskip("liger_kernel")
    from transformers.models.qwen2 import modeling_qwen2

    # liger swaps the module's rotary function for the whole process: restore it after this test
    monkeypatch.setattr(modeling_qwen2, "apply_rotary_pos_emb", modeling_qwen2.apply_rotary_pos_emb)
    torch.manual_seed(0)
    ref = build_model(config=TINY).cuda().bfloat16()
    fused = build_model(config=TINY).cuda().bfloat16()
    fused.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 512, (1, 256), device="cuda")

    def run(model):
        logits = model(ids).logits.float()
        logits.square().mean().backward()
        return logits, model.model.layers[0].mlp.up_proj.weight.grad.float()

    a, ga = run(ref)  # before patching: liger also swaps the transformers module's rotary function
    use_liger_kernels(fused)
    b, gb = run(fused)
    assert (a - b).norm() / a.norm() < 2e-2
    assert (ga - gb).norm() / ga.norm() < 5e-2

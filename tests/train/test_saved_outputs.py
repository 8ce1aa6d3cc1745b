"""train.save_attention_outputs=auto: the size of the saved outputs and the decision after step 1."""

from __future__ import annotations

import pytest
import torch

from mtraining.train.saved_outputs import device_memory, plan_saved_outputs, saved_outputs_bytes


def test_saved_outputs_bytes_of_qwen25_3b_at_128k():
    """36 layers x 131072 tokens x 16 heads x (128 bf16 values + one float32 LSE)."""
    per_layer = 131072 * 16 * (128 * 2 + 4)
    assert per_layer == 545_259_520
    assert saved_outputs_bytes(36, 131072, 16, 128, 2) == 36 * per_layer
    assert saved_outputs_bytes(2, 64, 4, 8, 4) == 2 * 64 * 4 * (8 * 4 + 4)


def test_plan_keeps_outputs_only_below_the_memory_fraction():
    keep, why = plan_saved_outputs(peak=71_000_000_000, saved=20_000_000_000, total=100_000_000_000)
    assert not keep and "off" in why and "> 90% of 100.0 GB" in why
    keep, why = plan_saved_outputs(peak=69_000_000_000, saved=20_000_000_000, total=100_000_000_000)
    assert keep and "on from the next step" in why and "peak 69.0 GB" in why and "20.0 GB <= 90%" in why
    assert plan_saved_outputs(50, 40, 100)[0] and not plan_saved_outputs(50, 41, 100)[0]
    assert plan_saved_outputs(50, 41, 100, fraction=0.95)[0]


def test_no_plan_without_a_gpu():
    assert device_memory(torch.device("cpu")) is None


@pytest.mark.cuda
def test_device_memory_on_gpu():
    x = torch.empty(1 << 20, device="cuda")
    peak, total = device_memory(x.device)
    assert 4 << 20 <= peak <= total

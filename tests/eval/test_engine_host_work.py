"""``Engine.respond``'s forward does its host work over the positions once per call, not in every layer.

On a GPU, host work over the positions in every layer (CPU ops past torch's parallel grain, device syncs) made a
64K read take 9 s instead of 0.5 s on a busy host (bench/reports/real_extension_h200x4_20261128.md). ``tests/host_work.py`` records that work on the CPU while a
tiny model answers a prompt of ``SEQ`` positions with its teacher-forced answer (the engine's packed documents);
the same call through 2 and through 4 layers must do the same host work, apart from the estimate's one device
read per sparse layer (the widths of its index lists, ``select_lines``: they size the lists, so they are read).
"""

from __future__ import annotations

import pytest
import torch

from mtraining.eval.engine import AttentionSpec, Engine
from mtraining.models import build_model
from tests.configs import TINY
from tests.host_work import GRAIN, HostWork, stub_kernels

SEQ = GRAIN + 1024  # positions: the position work of every document is past the grain
ANSWER = 8
MODEL = TINY | dict(hidden_size=16, intermediate_size=16, num_attention_heads=1, num_key_value_heads=1)
PATTERN = dict(threshold=0.9, v_size=1024, s_size=1024, last_q=64, local_window=128, sink_tokens=4)


def _respond(layers: int, sparse: bool) -> HostWork:
    """What one ``respond`` of a ``layers``-layer model recorded (attention's computations stubbed)."""
    torch.manual_seed(0)
    model = build_model(config=MODEL | dict(num_hidden_layers=layers, max_position_embeddings=SEQ)).eval()
    spec = AttentionSpec(sparse=sparse, block_size=128, backend="torch", pattern=PATTERN if sparse else {})
    ids = torch.randint(1, MODEL["vocab_size"], (SEQ,), generator=torch.Generator().manual_seed(1)).tolist()
    work = HostWork()
    with stub_kernels(), work.recording():
        engine = Engine(model, spec)  # built inside: the engine sees its model's device as the device
        engine.respond(ids[: SEQ - ANSWER], 1, reference=ids[SEQ - ANSWER :])
    return work


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_layers_repeat_no_host_work_over_the_positions(sparse):
    two, four = _respond(2, sparse), _respond(4, sparse)
    for kind in ("host", "device"):  # position work over the grain, on the host and as device launches
        repeated = {site: layers for site, layers in four.sites(kind).items() if {2, 3} & layers.keys()}
        assert two.count(kind) == four.count(kind), f"{kind} position work in every layer: {repeated}"
    reads = four.count("reads") - two.count("reads")
    assert reads == (2 if sparse else 0), f"device reads in every layer: {four.sites('reads')}"


def test_the_detector_tells_host_work_from_device_work():
    weights = torch.ones(GRAIN)  # made before recording: the device's, like a model's
    work = HostWork()
    with work.recording():
        host = torch.arange(GRAIN)  # no device: the host's
        assert host.device == torch.device("cpu") and weights.device != host.device  # as on a GPU
        on_device = torch.arange(GRAIN, device=weights.device)
        host.add(1), on_device.add(1), weights.mul(2)  # position work on each side; the weights' is math
        moved = host.to(weights.device)
        host.tolist(), int(on_device[0]), bool(moved.any())  # reads of device tensors wait for the GPU
    assert (work.count("host"), work.count("device"), work.count("reads")) == (3, 3, 2)

"""Fixtures of the kernel tests."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mtraining.ops.sparse import launch


@pytest.fixture(params=["kernel", "atomic"])
def dq_mode(request, monkeypatch):
    """Run the test with each way of making dQ (its own kernel, or added by the dK/dV kernels)."""
    default = launch.tile_config

    def with_mode(block_size, head_dim, device, dtype):
        cfg = default(block_size, head_dim, device, dtype)
        return launch.TileConfig(cfg.fwd, cfg.dq, replace(cfg.dkdv, dq_mode=request.param))

    monkeypatch.setattr(launch, "tile_config", with_mode)
    return request.param

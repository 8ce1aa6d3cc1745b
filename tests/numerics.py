"""Error measures shared by the kernel and ring tests."""

from __future__ import annotations

import torch


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float64 (0-safe)."""
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Max error relative to the reference's scale (at least 1); -inf (rows with no key) must match exactly."""
    got, ref = got.double(), ref.double()
    ref_inf = torch.isneginf(ref)
    assert torch.equal(torch.isneginf(got), ref_inf), f"{name}: rows with no key must have lse -inf"
    assert not torch.isnan(got).any(), f"{name}: NaN"
    err = (got - ref)[~ref_inf].abs().max().item() if (~ref_inf).any() else 0.0
    scale = max(ref[~ref_inf].abs().max().item(), 1.0) if (~ref_inf).any() else 1.0
    assert err <= tol * scale, f"{name}: max error {err:.3e} > {tol:.0e} x {scale:.2f}"

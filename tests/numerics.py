"""Error measures and references shared by the kernel, ring and model tests."""

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


def sdpa_by_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths, scale: float) -> torch.Tensor:
    """Causal attention [B, S, Hq, D] of q [B, S, Hq, D], k/v [B, S, Hkv, D] run by torch's SDPA on each document
    alone: ``lengths`` per batch row (a list of lists), the documents back to back. The reference for packed
    documents that shares no code with ours."""
    group = q.shape[2] // k.shape[2]
    rows = []
    for b, row in enumerate(lengths):
        parts, start = [], 0
        for n in row:
            qd, kd, vd = (t[b : b + 1, start : start + n].transpose(1, 2) for t in (q, k, v))
            kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
            out = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)
            parts.append(out.transpose(1, 2))
            start += n
        assert start == q.shape[1], (row, q.shape)
        rows.append(torch.cat(parts, 1))
    return torch.cat(rows, 0)

"""Bad inputs to single-device attention (issue 15), one table per kind:

- 15.6 a pattern used on another sequence: one clear ValueError on every backend and in the oracle;
- 15.7 non-finite keys: a NaN or an infinity in K or V reaches only the rows allowed to see that key;
  every other row, and the gradients that only such rows feed, equal the float64 oracle on finite inputs.
"""

from __future__ import annotations

import math

import pytest
import torch

from mtraining.ops import VerticalSlashPattern, attention_oracle, sparse_attention
from tests.factories import make_pattern, make_qkv
from tests.numerics import assert_close

N, G, B, HQ, HKV, D = 128, 16, 1, 4, 2, 16
SMALL = VerticalSlashPattern.dense(B, HQ, 64, G)  # estimated for a sequence of 64 tokens

# ----------------------------------------------------------------------------- 15.6 pattern on another sequence
# (case, sequence length of q and k, q_pos, k_pos, message)
WRONG_SEQUENCE = [
    (
        "sequence longer than the pattern's",
        128,
        None,
        None,
        "pattern is for a sequence of 64 tokens but .* reach position 127",
    ),
    ("positions past its length", 64, torch.arange(64, 128), torch.arange(64, 128), "reach position 127"),
    ("queries past its length", 64, torch.arange(16, 80), torch.arange(64), "reach position 79"),
    (
        "negative positions",
        32,
        torch.arange(-16, 16),
        torch.arange(-16, 16),
        "positions must be global token positions >= 0",
    ),
]


def _run(fn: str, q, k, v, pattern, q_pos, k_pos) -> None:
    if fn == "oracle":
        attention_oracle(q, k, v, pattern, q_pos, k_pos)
    else:
        sparse_attention(q, k, v, pattern, q_pos, k_pos, backend=fn)


@pytest.mark.parametrize("fn", ["torch", "triton", "oracle"])
@pytest.mark.parametrize("case,n,q_pos,k_pos,message", WRONG_SEQUENCE, ids=[c[0] for c in WRONG_SEQUENCE])
def test_pattern_of_another_sequence_is_refused(fn, case, n, q_pos, k_pos, message):
    q, k, v, _ = make_qkv(B, n, n, HQ, HKV, D, torch.float32, 0)
    with pytest.raises(ValueError, match=message):
        _run(fn, q, k, v, SMALL, q_pos, k_pos)


def test_pattern_on_its_sequence_or_a_prefix_runs():
    q, k, v, _ = make_qkv(B, 64, 64, HQ, HKV, D, torch.float64, 0)
    sparse_attention(q, k, v, SMALL, backend="torch")
    sparse_attention(q[:, :32], k[:, :32], v[:, :32], SMALL, backend="torch")  # the first 32 tokens of it


# ----------------------------------------------------------------------------- 15.7 non-finite keys
NAN, INF = math.nan, math.inf
# (case, pattern kind, [(tensor, key position, value)])
NONFINITE = [
    ("NaN in the last token's V, dense causal", "causal", [("v", N - 1, NAN)]),
    ("+inf in a middle token's K, dense causal", "causal", [("k", 70, INF)]),
    ("-inf in V of a key outside the pattern", "local_sinks", [("v", 100, -INF)]),
    ("NaN in K and +inf in V of two keys, sparse", "local_plus_verticals", [("k", 90, NAN), ("v", 91, INF)]),
]


def _poison(k: torch.Tensor, v: torch.Tensor, spots) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    k, v = k.clone(), v.clone()
    for name, pos, value in spots:
        (k if name == "k" else v)[:, pos, :, 1] = value
    return k, v, sorted({pos for _, pos, _ in spots})


def _blind(pattern, bad: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [B, HQ, N] that see no bad key, keys [B, HKV, N] that only such rows see and that are not bad)."""
    pos = torch.arange(N)
    allowed = pattern.pair_mask(pos, pos) if pattern is not None else (pos[None, :] <= pos[:, None])[None, None]
    allowed = allowed.expand(B, HQ, N, N)
    rows = ~allowed[..., bad].any(-1)
    seen_by_tainted = (allowed & ~rows[..., None]).any(-2)  # [B, HQ, N] keys
    keys = ~seen_by_tainted.view(B, HKV, HQ // HKV, N).any(2)
    keys[..., bad] = False
    return rows, keys


def _forward_backward(fn: str, q, k, v, do, pattern):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    if fn == "oracle":
        out, lse = attention_oracle(q, k, v, pattern)
    else:
        out, lse = sparse_attention(q, k, v, pattern, return_lse=True, backend=fn)
    out.backward(do)
    return out.detach(), lse, q.grad, k.grad, v.grad


@pytest.mark.parametrize(
    "fn",
    [
        "torch",
        "oracle",
        pytest.param(
            "triton",
            marks=pytest.mark.xfail(
                strict=True,
                reason="the Triton kernels multiply a masked pair's zero probability by the key's V inside the "
                "causal-diagonal block: 0 x NaN (reported to the kernels owner)",
            ),
        ),
    ],
)
@pytest.mark.parametrize("case,kind,spots", NONFINITE, ids=[c[0] for c in NONFINITE])
def test_nonfinite_keys_reach_only_the_rows_that_see_them(fn, case, kind, spots):
    if fn == "triton" and case != NONFINITE[0][0]:
        pytest.skip("one Triton case documents the kernels' gap")
    dtype = torch.float32 if fn == "triton" else torch.float64
    q, k, v, do = make_qkv(B, N, N, HQ, HKV, D, dtype, 1)
    pattern = make_pattern(kind, B, HQ, N, G, 1)
    bad_k, bad_v, bad = _poison(k, v, spots)
    got = _forward_backward(fn, q, bad_k, bad_v, do, pattern)
    # the float64 oracle on finite inputs: the bad keys zeroed, which no blind row can tell
    clean_k, clean_v = bad_k.nan_to_num(0.0, 0.0, 0.0), bad_v.nan_to_num(0.0, 0.0, 0.0)
    ref = _forward_backward("oracle", *(t.double() for t in (q, clean_k, clean_v, do)), pattern)
    rows, keys = _blind(pattern, bad)
    assert (~rows).any() and rows.any(), "the case must have rows on both sides"
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    by_row = rows.transpose(1, 2)  # [B, N, HQ]
    for name, g, r in zip(["out", "dq"], (got[0], got[2]), (ref[0], ref[2])):
        assert torch.isfinite(g[by_row]).all(), f"{name}: a row that cannot see a non-finite key is not finite"
        assert_close(name, g[by_row], r[by_row], tol)
    assert_close("lse", got[1][rows], ref[1][rows], tol)
    by_key = keys.transpose(1, 2)  # [B, N, HKV]
    for name, g, r in zip(["dk", "dv"], got[3:], ref[3:]):
        assert torch.isfinite(g[by_key]).all(), f"{name}: a key that only clean rows see has a non-finite gradient"
        assert_close(name, g[by_key], r[by_key], tol)
    assert not torch.isfinite(got[0][~by_row]).all(), "rows that see a non-finite key must not look finite"


# ----------------------------------------------------------------------------- 34.8 empty calls
@pytest.mark.parametrize("fn", ["torch", "triton"])
@pytest.mark.parametrize("keys", [0, 32])
def test_no_query_rows_give_empty_results(fn, keys):
    """A zero-length sequence (no queries; keys or none): an empty out and lse and zero key gradients, on every
    backend (the Triton path launches nothing)."""
    q, k, v, _ = make_qkv(B, 0, keys, HQ, HKV, D, torch.float32, 0)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = sparse_attention(q, k, v, return_lse=True, backend=fn)
    assert out.shape == (B, 0, HQ, D) and lse.shape == (B, HQ, 0) and lse.dtype == torch.float32
    out.sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k)) and torch.equal(v.grad, torch.zeros_like(v))


@pytest.mark.parametrize("fn", ["torch", "triton", "oracle"])
@pytest.mark.parametrize("shape", [(0, 16, HQ, D), (1, 16, HQ, 0)], ids=["no batch rows", "no head dim"])
def test_empty_batch_or_head_dim_is_refused(fn, shape):
    q = torch.randn(shape)
    k = q[:, :, :HKV]
    with pytest.raises(ValueError, match="needs batch >= 1 and head_dim >= 1"):
        _run(fn, q, k, k, None, None, None)

"""Bad inputs to single-device attention (issue 15), one table per kind:

- 15.6 a pattern used on another sequence: one clear ValueError on every backend and in the oracle;
- 15.7 non-finite keys: a NaN or an infinity in K or V reaches only the rows allowed to see that key;
  every other row, and the gradients that only such rows feed, equal the float64 oracle on finite inputs.
"""

from __future__ import annotations

import math

import pytest
import torch

from mtraining.ops import Documents, VerticalSlashPattern, attention_oracle, sparse_attention
from mtraining.ops.pattern.vertical_slash import attention_mask
from mtraining.ops.sparse import attention_backward, attention_delta, attention_forward
from tests.factories import make_pattern, make_qkv, striped_positions
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
    """K and V with ``spots`` [(tensor, local key row, value)] written into head dim 1, and those rows."""
    k, v = k.clone(), v.clone()
    for name, row, value in spots:
        (k if name == "k" else v)[:, row, :, 1] = value
    return k, v, sorted({row for _, row, _ in spots})


def _allowed(pattern, q_pos, k_pos, documents) -> torch.Tensor:
    """[B, HQ, Sq, Sk]: the pairs a row may see (``attention_mask``, with the documents' left bounds)."""
    bound = None if documents is None else documents.left_bounds(q_pos)
    return attention_mask(q_pos, k_pos, pattern, bound).expand(B, HQ, q_pos.numel(), k_pos.numel())


def _blind(allowed: torch.Tensor, bad: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [B, HQ, Sq] that see no bad key, keys [B, HKV, Sk] that only such rows see: a bad key no row
    sees among them, whose gradient is then 0)."""
    rows = ~allowed[..., bad].any(-1)
    seen_by_tainted = (allowed & ~rows[..., None]).any(-2)  # [B, HQ, Sk] keys
    keys = ~seen_by_tainted.view(B, HKV, HQ // HKV, -1).any(2)
    return rows, keys


def _forward_backward(fn: str, q, k, v, do, pattern, q_pos=None, k_pos=None, documents=None):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    if fn == "oracle":
        out, lse = attention_oracle(q, k, v, pattern, q_pos, k_pos, documents=documents)
    else:
        out, lse = sparse_attention(q, k, v, pattern, q_pos, k_pos, return_lse=True, backend=fn, documents=documents)
    out.backward(do)
    return out.detach(), lse, q.grad, k.grad, v.grad


def _check_blind(got, ref, allowed, bad, tol, spots) -> None:
    """Rows that see no bad key (out, lse, dq) and keys that only such rows see (dk, dv) equal the oracle on
    finite inputs; rows that see a bad V come out non-finite, and some of those that see a bad K."""
    rows, keys = _blind(allowed, bad)
    assert rows.any(), "the case must have rows that see no bad key"
    by_row = rows.transpose(1, 2)  # [B, Sq, HQ]
    for name, g, r in zip(["out", "dq"], (got[0], got[2]), (ref[0], ref[2])):
        assert torch.isfinite(g[by_row]).all(), f"{name}: a row that cannot see a non-finite key is not finite"
        assert_close(name, g[by_row], r[by_row], tol)
    assert_close("lse", got[1][rows], ref[1][rows], tol)
    by_key = keys.transpose(1, 2)  # [B, Sk, HKV]
    for name, g, r in zip(["dk", "dv"], got[3:], ref[3:]):
        assert torch.isfinite(g[by_key]).all(), f"{name}: a key that only clean rows see has a non-finite gradient"
        assert_close(name, g[by_key], r[by_key], tol)
    if (~by_row).any():
        tainted = got[0][~by_row]  # [rows, D]
        if any(name == "v" for name, _, _ in spots):
            assert not torch.isfinite(tainted).all(-1).any(), "every row that sees a non-finite V must show it"
        assert not torch.isfinite(tainted).all(), "rows that see a non-finite key must not look finite"


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's NaN arithmetic
@pytest.mark.parametrize("fn", ["torch", "oracle", "triton"])
@pytest.mark.parametrize("case,kind,spots", NONFINITE, ids=[c[0] for c in NONFINITE])
def test_nonfinite_keys_reach_only_the_rows_that_see_them(fn, case, kind, spots):
    dtype = torch.float32 if fn == "triton" else torch.float64
    q, k, v, do = make_qkv(B, N, N, HQ, HKV, D, dtype, 1)
    pattern = make_pattern(kind, B, HQ, N, G, 1)
    bad_k, bad_v, bad = _poison(k, v, spots)
    got = _forward_backward(fn, q, bad_k, bad_v, do, pattern)
    # the float64 oracle on finite inputs: the bad keys zeroed, which no blind row can tell
    clean_k, clean_v = bad_k.nan_to_num(0.0, 0.0, 0.0), bad_v.nan_to_num(0.0, 0.0, 0.0)
    ref = _forward_backward("oracle", *(t.double() for t in (q, clean_k, clean_v, do)), pattern)
    pos = torch.arange(N)
    allowed = _allowed(pattern, pos, pos, None)
    assert (~_blind(allowed, bad)[0]).any(), "the case must have rows that see a bad key"
    _check_blind(got, ref, allowed, bad, 1e-10 if dtype == torch.float64 else 2e-5, spots)


# ----------------------------------------------------------------------------- 15.7 in every masked tile of the kernels
def _pattern(diags: list[int], verticals: list[int]) -> VerticalSlashPattern:
    """Every head keeps block diagonals ``diags`` and key positions ``verticals`` (N tokens, G grid)."""
    diag = torch.zeros(B, HQ, N // G, dtype=torch.bool)
    vert = torch.zeros(B, HQ, N, dtype=torch.bool)
    diag[..., diags] = True
    vert[..., verticals] = True
    return VerticalSlashPattern.from_masks(diag, vert, G)


# Where a non-finite key meets rows that may not see it inside a tile the kernels load:
# (setup, pattern, documents [lengths] or None, bad key position).
MASKED_TILES = {
    # the causal-diagonal block: rows 96..99 of key 100's block come before it
    "diagonal": (None, None, 100),
    # a vertical column, no local block: rows 64..69 of vertical 70's block come before it
    "vertical": (([2], [5, 70, 90]), None, 70),
    # documents, the diagonal and an off-diagonal block: rows 45.. of key 40's blocks start the next document
    "documents, block": (([0, 1], [3, 50]), [45, 83], 40),
    # documents, a vertical column: rows 45..47 of a block that sees sink 3 start the next document
    # (in both: vertical 50 is the next document's, whose gradient the tainted rows 32..44 must not reach)
    "documents, vertical": (([0, 1], [3, 50]), [45, 83], 3),
    # a key no row may see, in an off-diagonal block masked by documents (rows 48..63 are the next document's)
    "unseen key": (([1], []), [40, 88], 35),
}
VALUES = {"NaN": NAN, "+inf": INF, "-inf": -INF}
# (setup, tensor, value): every value in K and in V at the diagonal, the others spread over the setups
TILE_CASES = [
    *(("diagonal", t, name) for t in ("k", "v") for name in VALUES),
    ("vertical", "k", "NaN"),
    ("vertical", "v", "-inf"),
    ("documents, block", "k", "-inf"),
    ("documents, block", "v", "NaN"),
    ("documents, block", "v", "+inf"),
    ("documents, vertical", "k", "+inf"),
    ("documents, vertical", "v", "NaN"),
    ("unseen key", "k", "NaN"),
    ("unseen key", "v", "+inf"),
]


def _triton_case(setup: str, tensor: str, value: float, dtype: torch.dtype):
    """(got of the Triton backend, the float64 oracle on finite inputs, allowed pairs, bad rows, spots)."""
    lines, lengths, position = MASKED_TILES[setup]
    pattern = None if lines is None else _pattern(*lines)
    documents = None if lengths is None else Documents.from_lengths(lengths)
    q, k, v, do = make_qkv(B, N, N, HQ, HKV, D, dtype, 2)
    spots = [(tensor, position, value)]
    bad_k, bad_v, bad = _poison(k, v, spots)
    got = _forward_backward("triton", q, bad_k, bad_v, do, pattern, documents=documents)
    clean = (t.nan_to_num(0.0, 0.0, 0.0).double() for t in (q, bad_k, bad_v, do))
    ref = _forward_backward("oracle", *clean, pattern, documents=documents)
    pos = torch.arange(N)
    return got, ref, _allowed(pattern, pos, pos, documents), bad, spots


def _check_tile_case(setup: str, tensor: str, value: str, dtype: torch.dtype, tol: float) -> None:
    got, ref, allowed, bad, spots = _triton_case(setup, tensor, VALUES[value], dtype)
    _check_blind(got, ref, allowed, bad, tol, spots)
    if setup == "unseen key":
        assert not allowed[..., bad].any()
        for name, g, r in zip(["dk", "dv"], got[3:], ref[3:]):
            assert_close(name, g[:, bad], r[:, bad], tol)  # 0: no row takes anything from it


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("setup,tensor,value", TILE_CASES, ids=["-".join(c) for c in TILE_CASES])
def test_nonfinite_keys_stay_behind_the_kernels_masks(setup, tensor, value):
    """-inf, +inf and NaN in K or V of one key, in each kind of tile the kernels mask (float32): rows that
    may not see the key, and keys that only they see, equal the oracle."""
    _check_tile_case(setup, tensor, value, torch.float32, 2e-5)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize(
    "setup,tensor,value",
    [("diagonal", "k", "NaN"), ("documents, block", "v", "NaN"), ("documents, vertical", "v", "+inf")],
)
def test_nonfinite_keys_stay_behind_the_masks_of_the_fused_dq(setup, tensor, value, dq_mode):
    """The same with dQ made by each way (its own kernel, or added atomically by the dK/dV kernels)."""
    _check_tile_case(setup, tensor, value, torch.float32, 2e-5)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize(
    "setup,tensor,value", [("diagonal", "v", "NaN"), ("vertical", "k", "-inf"), ("documents, block", "v", "+inf")]
)
def test_nonfinite_keys_stay_behind_the_kernels_masks_in_half_precision(setup, tensor, value):
    """The same in float16: the zeroed entries and the mask keep their dtype."""
    _check_tile_case(setup, tensor, value, torch.float16, 3e-3)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("tensor,value", [("v", NAN), ("k", INF), ("v", -INF)])
def test_nonfinite_keys_in_a_ring_step(tensor, value):
    """A striped ring's two chunk pairs on the Triton primitives: its own keys (diagonal blocks) merged
    into the other rank's (the forward kernel's MERGE), then each pair's backward with the whole rows'
    LSE and delta: the rows and keys a non-finite key cannot reach equal the oracle."""
    n, world = 2 * N, 2
    q_pos = striped_positions(n, G, world, 1)
    chunks = [striped_positions(n, G, world, r) for r in (1, 0)]
    k_pos = torch.cat(chunks)
    pattern = make_pattern("local_plus_verticals", B, HQ, n, G, 3)
    q, k, v, do = make_qkv(B, q_pos.numel(), k_pos.numel(), HQ, HKV, D, torch.float32, 3)
    row = 50  # position 114 of the own chunk: rows 112 and 113 of its block come before it
    spots = [(tensor, row, value)]
    bad_k, bad_v, bad = _poison(k, v, spots)
    cut = chunks[0].numel()
    parts = [(bad_k[:, :cut], bad_v[:, :cut], chunks[0]), (bad_k[:, cut:], bad_v[:, cut:], chunks[1])]
    scale = D**-0.5
    (k0, v0, pos0), (k1, v1, pos1) = parts
    out, lse = attention_forward(q, k0, v0, pattern, q_pos, pos0, scale, backend="triton")
    out, lse = attention_forward(q, k1, v1, pattern, q_pos, pos1, scale, backend="triton", merge_into=(out, lse))
    delta = attention_delta(do, out)
    grads = [
        attention_backward(do, q, kc, vc, lse, delta, pattern, q_pos, pos, scale, backend="triton")
        for kc, vc, pos in parts
    ]
    dq = grads[0][0] + grads[1][0]
    got = (out, lse, dq, torch.cat([g[1] for g in grads], 1), torch.cat([g[2] for g in grads], 1))
    clean = (t.nan_to_num(0.0, 0.0, 0.0).double() for t in (q, bad_k, bad_v, do))
    ref = _forward_backward("oracle", *clean, pattern, q_pos, k_pos)
    _check_blind(got, ref, _allowed(pattern, q_pos, k_pos, None), bad, 2e-5, spots)


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

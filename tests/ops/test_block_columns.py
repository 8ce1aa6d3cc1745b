"""Per-block columns (``VerticalSlashPattern.block_cols``): row i also keeps key j when j is one of its
query block's columns. The pattern's mask and pair counts against a mask built here from the raw parts,
and the torch backend on one device and in the gloo ring against a plain float64 masked softmax of that
mask, forward and backward; the Triton kernels (in the interpreter: float32, float16) likewise, on one device
(both ways of making dQ, tiles smaller than the block) and in the gloo ring.
"""

from __future__ import annotations

import pickle
import re

import pytest
import torch

from bench.imbalance import imbalance_report
from mtraining.ops import Documents, VerticalSlashPattern, sparse_attention
from mtraining.ops.sparse import launch
from mtraining.parallel import make_layout
from tests.bench.scripts import load_script
from tests.factories import make_qkv
from tests.numerics import assert_close
from tests.rings import SEQ, assert_gathered_close, ring_case

G, D = 16, 16  # the ring tests' grid and head dim (tests/rings.py)
N = 6 * G + 5  # a partial last block
TOL = 1e-10
PADDING = (-1, -7, 10_000)  # anything < 0 or >= seq_len


def random_columns(b: int, h: int, n: int, k: int, gen: torch.Generator, g: int = G) -> torch.Tensor:
    """int64 [b, h, num_blocks, k]: per query block r up to k distinct columns < r * g, in random slots
    among padding of every kind."""
    nb = -(-n // g)
    cols = torch.empty(b, h, nb, k, dtype=torch.int64)
    for bi in range(b):
        for hi in range(h):
            for r in range(nb):
                count = min(int(torch.randint(0, k + 1, (1,), generator=gen)), r * g)
                real = torch.randperm(r * g, generator=gen)[:count].tolist()
                pad = [PADDING[int(x)] for x in torch.randint(0, len(PADDING), (k - count,), generator=gen)]
                slots = torch.randperm(k, generator=gen).tolist()
                cols[bi, hi, r] = torch.tensor(real + pad)[slots]
    return cols


def document_ids(documents: Documents, b: int, n: int) -> torch.Tensor:
    """int64 [b, n]: the document index of every position, counted from the lengths."""
    rows = []
    for bi in range(b):
        lengths = documents.lengths(bi if documents.batch > 1 else 0).tolist()
        rows.append(torch.tensor([d for d, length in enumerate(lengths) for _ in range(length)]))
    return torch.stack(rows)


class Case:
    """A random pattern built from its raw parts (diagonal and vertical masks, per-block column lists), and
    the brute-force mask of those parts, built without the pattern."""

    def __init__(
        self, b: int, h: int, n: int, seed: int, k: int = 6, documents: Documents | None = None, g: int = G
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        nb = -(-n // g)
        self.diag = torch.rand(b, h, nb, generator=gen) < 0.3
        self.vert = torch.rand(b, h, n, generator=gen) < 0.08
        self.diag[:, 0, 0] = False  # head 0: no local block and late verticals: rows that see only columns or nothing
        self.vert[:, 0, : n // 2] = False
        self.cols = random_columns(b, h, n, k, gen, g)
        self.lines = VerticalSlashPattern.from_masks(self.diag, self.vert, g)
        self.pattern = self.lines.with_block_columns(self.cols)
        self.n, self.documents, self.g = n, documents, g

    def mask(self, columns: bool = True) -> torch.Tensor:
        """Boolean [B, H, N, N]: the kept pairs (within documents), from the raw parts."""
        b, h, nb = self.diag.shape
        g = self.g
        i = torch.arange(self.n)[:, None]
        j = torch.arange(self.n)[None, :]
        kept = self.diag[:, :, (i // g - j // g).clamp(min=0)] | self.vert[:, :, None, :]
        if columns:
            listed = torch.zeros(b, h, nb, self.n, dtype=torch.bool)  # listed[b, h, r, j]: j is a column of block r
            for bi in range(b):
                for hi in range(h):
                    for r in range(nb):
                        for c in self.cols[bi, hi, r].tolist():
                            if 0 <= c < self.n:
                                listed[bi, hi, r, c] = True
            kept = kept | listed[:, :, torch.arange(self.n) // g]
        kept = kept & (j <= i)
        if self.documents is not None:
            ids = document_ids(self.documents, b, self.n)
            kept = kept & (ids[:, :, None] == ids[:, None, :])[:, None]
        return kept


def masked_softmax(q, k, v, mask: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain float64 attention of q [B, Sq, Hq, D] over k/v [B, Sk, Hkv, D] on ``mask`` [B, Hq, Sq, Sk]:
    (out [B, Sq, Hq, D], lse [B, Hq, Sq]); rows that see nothing give 0 and -inf."""
    group = q.shape[2] // k.shape[2]
    kh, vh = (t.transpose(1, 2).repeat_interleave(group, 1) for t in (k, v))
    scores = (q.transpose(1, 2) @ kh.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    seen = mask.any(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~seen, 0.0), -1) * seen
    return (probs @ vh).transpose(1, 2), torch.logsumexp(scores, -1).detach()


def oracle(inputs, mask: torch.Tensor, rows: slice = slice(None)) -> tuple[torch.Tensor, ...]:
    """(out, lse, dq, dk, dv) of the masked softmax for query ``rows`` of the full inputs (q, k, v, dout)."""
    q, k, v, dout = (t.detach().clone() for t in inputs)
    q = q[:, rows].requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    out, lse = masked_softmax(q, k, v, mask[:, :, rows], D**-0.5)
    out.backward(dout[:, rows])
    return out.detach(), lse, q.grad, k.grad, v.grad


def entries_covered(case: Case) -> tuple[int, int]:
    """(real columns already kept by a vertical or a selected diagonal, real columns that add pairs)."""
    real = (case.cols >= 0) & (case.cols < case.n)
    c = case.cols.clamp(0, case.n - 1)
    delta = (torch.arange(c.shape[2])[:, None] - c // G).clamp(min=0)
    covered = case.vert.gather(-1, c.flatten(2)).view_as(c) | case.diag.gather(-1, delta.flatten(2)).view_as(c)
    return int((real & covered).sum()), int((real & ~covered).sum())


# --------------------------------------------------------------------------- the mask and its counts
@pytest.mark.parametrize("documents", [None, "shared", "per_row"])
def test_pair_mask_equals_the_brute_force_mask(documents):
    docs = {
        None: None,
        "shared": Documents.from_lengths([5, 30, 2, N - 37]),
        "per_row": Documents.from_lengths([[20, 17, N - 37], [N - 9, 9]]),
    }[documents]
    case = Case(2, 3, N, seed=1, documents=docs)
    want = case.mask()
    assert not torch.equal(want, case.mask(columns=False))  # the columns keep pairs of their own
    # the whole grid, and chunks of rows and keys in any order (as the ring passes them)
    chunks = (torch.tensor([100, 3, 64, 47, 48]), torch.tensor([90, 0, 47, 15, 16, 33, 100]))
    for q_pos, k_pos in [(torch.arange(N), torch.arange(N)), chunks]:
        got = case.pattern.pair_mask(q_pos, k_pos)
        if docs is not None:
            got = got & (docs.doc_ids(q_pos)[:, :, None] == docs.doc_ids(k_pos)[:, None, :])[:, None]
        assert torch.equal(got, want[:, :, q_pos][:, :, :, k_pos])


@pytest.mark.parametrize("documents", [None, "mixed", "per_row"])
def test_kept_pairs_and_density_count_the_brute_force_mask(documents):
    docs = {
        None: None,
        "mixed": Documents.from_lengths([1, 14, 3, 40, N - 58]),
        "per_row": Documents.from_lengths([[33, 31, N - 64], [7, N - 7]]),
    }[documents]
    case = Case(2, 4, N, seed=2, k=8, documents=docs)
    covered, adding = entries_covered(case)
    assert covered > 0 and adding > 0  # columns on verticals or selected diagonals add nothing: both kinds occur
    mask = case.mask()
    kept = mask.sum((-1, -2)).double()
    assert torch.equal(case.pattern.kept_pairs(docs), kept)
    assert bool((kept >= case.lines.kept_pairs(docs)).all()) and bool((kept > case.lines.kept_pairs(docs)).any())
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    if docs is not None:
        ids = document_ids(docs, 2, N)
        causal = causal & (ids[:, :, None] == ids[:, None, :])
    total = causal.sum((-1, -2)).double().reshape(-1, 1)
    assert torch.allclose(case.pattern.density(docs), kept / total, rtol=1e-12, atol=0)


# --------------------------------------------------------------------------- with_block_columns
def test_with_block_columns_sorts_pads_and_keeps_the_rest():
    case = Case(1, 2, N, seed=3)
    p, lines = case.pattern, case.lines
    assert p.block_cols.dtype == torch.int32 and p.block_cols.shape == (1, 2, 7, 6)
    real = p.block_cols < N
    assert bool((p.block_cols[~real] == N).all())  # every padding kind becomes seq_len
    assert bool((p.block_cols[..., 1:] >= p.block_cols[..., :-1]).all())  # ascending, padding last
    for bi, hi, r in [(0, 0, 3), (0, 1, 6)]:
        given = sorted(c for c in case.cols[bi, hi, r].tolist() if 0 <= c < N)
        assert p.block_cols[bi, hi, r, : len(given)].tolist() == given
    assert p.block_diags is lines.block_diags and p.vertical_pos is lines.vertical_pos
    assert p.index_cache is not lines.index_cache and len(p.index_cache) == 0
    for copy in (p.to("cpu"), pickle.loads(pickle.dumps(p))):
        assert torch.equal(copy.block_cols, p.block_cols)
    # no real column: no columns
    assert lines.with_block_columns(torch.zeros(1, 2, 7, 0, dtype=torch.int32)).block_cols is None
    assert lines.with_block_columns(torch.full((1, 2, 7, 3), -1, dtype=torch.int16)).block_cols is None


@pytest.mark.parametrize(
    "head,block,columns,match",
    [
        (
            1,
            2,
            [3, 32],
            r"before their query block's first row: block 2 \(first row 32\) of batch 0, head 1 holds column 32",
        ),
        (0, 4, [69, 8], "block 4 .* holds column 69"),
        (0, 0, [0], "block 0 .* holds column 0"),
        (1, 3, [17, 4, 17], "repeat column 17 in block 3 of batch 0, head 1"),
    ],
)
def test_with_block_columns_names_the_broken_rule(head, block, columns, match):
    cols = torch.full((1, 2, 7, 4), -1)
    cols[0, head, block, : len(columns)] = torch.tensor(columns)
    with pytest.raises(ValueError, match=match):
        Case(1, 2, N, seed=4).lines.with_block_columns(cols)


@pytest.mark.parametrize(
    "cols,match",
    [
        (torch.full((1, 2, 6, 4), -1), r"\[B, H, num_blocks, K\] = \[1, 2, 7, K\] .*got \(1, 2, 6, 4\)"),
        (torch.full((1, 2, 7), -1), r"got \(1, 2, 7\)"),
        (torch.full((2, 2, 7, 1), -1), r"got \(2, 2, 7, 1\)"),
        (torch.full((1, 2, 7, 4), -1.0), "integer tensor, got torch.float32"),
        (torch.zeros(1, 2, 7, 4, dtype=torch.bool), "integer tensor, got torch.bool"),
    ],
)
def test_with_block_columns_refuses_wrong_shapes_and_dtypes(cols, match):
    with pytest.raises(ValueError, match=match):
        Case(1, 2, N, seed=4).lines.with_block_columns(cols)


# --------------------------------------------------------------------------- the torch backend
@pytest.mark.parametrize(
    "b,hq,hkv,documents,sq",
    [
        (2, 4, 2, None, N),  # GQA
        (1, 4, 1, None, 37),  # the last 37 rows only: from inside a block
        (2, 4, 2, "shared", N),
        (2, 2, 2, "per_row", N),
    ],
)
def test_sparse_attention_torch_matches_the_masked_softmax(b, hq, hkv, documents, sq):
    docs = {
        None: None,
        "shared": Documents.from_lengths([12, 40, 3, N - 55]),
        "per_row": Documents.from_lengths([[50, N - 50], [9, 9, N - 18]]),
    }[documents]
    case = Case(b, hq, N, seed=5 + hq + sq, documents=docs)
    inputs = make_qkv(b, N, N, hq, hkv, D, torch.float64, gen=hq + sq)
    rows = slice(N - sq, N)
    ref = oracle(inputs, case.mask(), rows)
    without = oracle(inputs, case.mask(columns=False), rows)
    assert (ref[0] - without[0]).abs().max() > 1e-2 and (ref[3] - without[3]).abs().max() > 1e-2  # columns matter
    q, k, v = (t.clone().requires_grad_() for t in (inputs[0][:, rows], inputs[1], inputs[2]))
    out, lse = sparse_attention(q, k, v, case.pattern, return_lse=True, backend="torch", documents=docs)
    out.backward(inputs[3][:, rows])
    if sq == N:
        assert torch.isneginf(ref[1]).any()  # rows that see nothing are part of the case
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, q.grad, k.grad, v.grad), ref):
        assert_close(name, got, want, TOL)


# --------------------------------------------------------------------------- the ring on gloo
@pytest.mark.slow
@pytest.mark.parametrize(
    "world,documents,ring",
    [(2, False, None), (3, False, None), (3, True, None), (4, True, dict(ring="hierarchical", inner_size=2))],
)
def test_ring_torch_matches_the_masked_softmax(pool, world, documents, ring):
    n = SEQ[world]
    docs = Documents.from_lengths([7, 60, G, n - 67 - G]) if documents else None
    case = Case(2, 4, n, seed=10 + world, documents=docs)
    inputs = make_qkv(2, n, n, 4, 2, D, torch.float64, gen=world)
    ref = oracle(inputs, case.mask())
    results = pool.run(ring_case, world, "striped", inputs, case.pattern, None, ring, "torch", False, None, docs)
    assert_gathered_close(results, "striped", ref, TOL, f" ({world} ranks, {ring or 'flat'})")


# --------------------------------------------------------------------------- the Triton kernels
DOCS = {
    None: None,
    "shared": Documents.from_lengths([12, 40, 3, N - 55]),
    "per_row": Documents.from_lengths([[50, N - 50], [9, 9, N - 18]]),
}
TRITON_TOL = {torch.float32: 2e-5, torch.float16: 4e-3}


def check_triton(case: Case, inputs, rows: slice, dtype: torch.dtype) -> None:
    """The Triton backend in ``dtype`` on the query ``rows`` against the float64 masked softmax of the case."""
    ref = oracle(inputs, case.mask(), rows)
    without = oracle(inputs, case.mask(columns=False), rows)
    assert (ref[0] - without[0]).abs().max() > 1e-2 and (ref[3] - without[3]).abs().max() > 1e-2  # columns matter
    q, k, v = (t.to(dtype).requires_grad_() for t in (inputs[0][:, rows], inputs[1], inputs[2]))
    out, lse = sparse_attention(q, k, v, case.pattern, return_lse=True, backend="triton", documents=case.documents)
    out.backward(inputs[3][:, rows].to(dtype))
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, q.grad, k.grad, v.grad), ref):
        assert_close(name, got, want, TRITON_TOL[dtype])


@pytest.mark.slow
@pytest.mark.parametrize(
    "b,hq,hkv,documents,sq,dtype",
    [
        (2, 4, 2, None, N, torch.float32),  # GQA
        (1, 4, 1, None, 37, torch.float32),  # the last 37 rows only: from inside a block
        (2, 4, 2, "shared", N, torch.float32),
        (2, 2, 2, "per_row", N, torch.float16),
    ],
)
def test_sparse_attention_triton_matches_the_masked_softmax(dq_mode, b, hq, hkv, documents, sq, dtype):
    case = Case(b, hq, N, seed=25 + hq + sq, documents=DOCS[documents])
    check_triton(case, make_qkv(b, N, N, hq, hkv, D, torch.float64, gen=hq + sq), slice(N - sq, N), dtype)


def test_triton_tiles_smaller_than_the_block(monkeypatch):
    """Blocks of G = 32 walked by 16-row and 16-key tiles: every tile of a block reads the block's columns."""
    monkeypatch.setattr(launch, "tile_config", lambda *_: launch.TileConfig(*[launch.Tiles(16, 16, 16, 4, 1)] * 3))
    n = 4 * 32 + 9
    case = Case(2, 2, n, seed=9, k=10, documents=Documents.from_lengths([40, 70, n - 110]), g=32)
    check_triton(case, make_qkv(2, n, n, 2, 1, D, torch.float64, gen=9), slice(None), torch.float32)


def triton_ring_case(group, inputs, pattern, documents):
    """Worker: ``ring_case`` on the Triton backend in float32."""
    return ring_case(
        group, "striped", [t.float() for t in inputs], pattern, None, None, "triton", False, None, documents
    )


@pytest.mark.slow
@pytest.mark.parametrize("world,documents", [(2, False), (3, True)])
def test_ring_triton_matches_the_masked_softmax(pool, world, documents):
    n = SEQ[world]
    docs = Documents.from_lengths([7, 60, G, n - 67 - G]) if documents else None
    case = Case(1, 4, n, seed=20 + world, documents=docs)
    inputs = make_qkv(1, n, n, 4, 2, D, torch.float64, gen=20 + world)
    results = pool.run(triton_ring_case, world, inputs, case.pattern, docs)
    assert_gathered_close(results, "striped", oracle(inputs, case.mask()), 2e-5, f" ({world} ranks)")


def test_benchmarks_that_count_only_lines_refuse_block_columns():
    """bench/imbalance.py and the block rounding of bench/block_sparse_peers.py would drop the columns."""
    case = Case(1, 2, 4 * G, seed=8)
    with pytest.raises(ValueError, match=re.escape("not per-block columns (pattern.block_cols)")):
        imbalance_report(case.pattern, make_layout("striped", 4 * G, 2, G))
    with pytest.raises(ValueError, match=re.escape("not per-block columns (pattern.block_cols)")):
        load_script("block_sparse_peers").block_mask(case.pattern)

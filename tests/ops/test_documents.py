"""Packed documents on one device: the boundaries, the oracle's definition, both backends and the walks.

Pair (i, j) is computed iff j <= i, doc(i) == doc(j) and the pattern keeps it. The oracle tests document
equality by index; the backends and kernels use each row's left bound (the first position of its
document). Everything is checked against the float64 oracle, forward and backward, and the oracle
itself against attention over each document alone.
"""

from __future__ import annotations

import pytest
import torch

from mtraining.ops import Documents, PatternConfig, attention_oracle, estimate_pattern, sparse_attention
from mtraining.ops.dense import dense_backend
from mtraining.ops.documents import document_starts, resolve_documents
from mtraining.ops.estimate import estimator
from mtraining.ops.estimate.estimator import select_lines
from mtraining.ops.sparse import attention_backward, attention_delta, attention_forward
from mtraining.ops.sparse import index as ki
from mtraining.parallel import make_layout
from tests.factories import make_documents, make_pattern, make_qkv
from tests.numerics import assert_close, rel_err

CPU_TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.float64: 1e-10}


# --------------------------------------------------------------------------- the boundaries
def test_constructors_agree():
    by_cu = Documents.from_cu_seqlens([0, 3, 10, 16])
    by_len = Documents.from_lengths([3, 7, 6])
    by_ids = Documents.from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5]]))
    for docs in (by_cu, by_len, by_ids):
        assert docs.seq_len == 16 and docs.starts[0].tolist() == [0, 3, 10]
        assert docs.digest() == by_cu.digest()
    pos = torch.tensor([0, 2, 3, 9, 10, 15])
    assert by_cu.left_bounds(pos).tolist() == [[0, 0, 3, 3, 10, 10]]
    assert by_cu.doc_ids(pos).tolist() == [[0, 0, 1, 1, 2, 2]]
    assert by_cu.lengths().tolist() == [3, 7, 6]
    # position ids that do not start at 0 still start a document at row 0 (a document cut by the sample)
    cut = Documents.from_position_ids(torch.tensor([7, 8, 0, 1]))
    assert cut.starts[0].tolist() == [0, 2]


@pytest.mark.parametrize(
    "ids,starts",
    [
        ([0, 1, 2, 0, 1], [0, 3]),  # Hugging Face's packing: restarts at 0
        ([0, 1, 2, 3, 5, 6, 7], [0, 4]),  # a document whose ids run 5.. (issue 34.2)
        ([4, 5, 6, 2, 3, 9], [0, 3, 5]),  # any value that does not continue the previous one
        ([0, 1, 1, 2], [0, 2]),  # a repeated id
        ([0, 0, 0], [0, 1, 2]),  # every token alone
        ([10, 11, 12, 13], [0]),  # one document, ids offset
    ],
)
def test_a_document_starts_where_the_position_ids_do_not_continue(ids, starts):
    """The one rule (flash-attention's varlen convention): pos[i] != pos[i - 1] + 1 starts a document."""
    assert [r.tolist() for r in document_starts(torch.tensor(ids))] == [starts]
    assert Documents.from_position_ids(torch.tensor([ids])).starts[0].tolist() == starts


def test_batch_rows_and_resolution():
    docs = Documents.from_lengths([[4, 4], [8]])
    assert docs.batch == 2 and not docs.shared and not docs.single
    assert docs.left_bounds(torch.arange(8)).tolist() == [[0] * 4 + [4] * 4, [0] * 8]
    assert resolve_documents(docs, 2, 8) is docs
    assert resolve_documents(Documents.from_lengths([[8], [8]]), 2, 8) is None  # one document per row: as today
    assert resolve_documents(None, 3, 8) is None


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda: Documents([[1, 4]], 8), "start at position 0"),
        (lambda: Documents([[0, 4, 4]], 8), "rise strictly"),
        (lambda: Documents([[0, 9]], 8), "below seq_len"),
        (lambda: Documents.from_cu_seqlens([[0, 4, 8], [0, 9]]), "end at the sequence length"),
        (lambda: Documents.from_lengths([3, 0]), ">= 1"),
        (lambda: Documents.from_position_ids(torch.zeros(2, 2, 2, dtype=torch.long)), "position_ids"),
        (
            lambda: Documents.from_position_ids(torch.tensor([0, 1, 2, -1, 0])),
            r"must be >= 0 .*, got -1 at batch row 0, index 3",
        ),
        (lambda: Documents.from_position_ids(torch.tensor([0.0, 1.0])), "integers"),
        (lambda: Documents.from_position_ids(torch.tensor([True, False])), "integers"),
        (lambda: Documents.from_cu_seqlens([0, 2.5, 8]), "cu_seqlens row 0 must be a flat list of integers"),
        (lambda: Documents.from_cu_seqlens(torch.tensor([0.0, 4.0, 8.0])), "integers"),
        (lambda: Documents.from_cu_seqlens([0, 6, 4, 8]), "rise strictly .* entry 2 is 4 after 6"),
        (lambda: Documents.from_cu_seqlens([0, 4, 4, 8]), "rise strictly .* entry 2 is 4 after 4"),
        (lambda: Documents.from_cu_seqlens([2, 4, 8]), "from 0 to the sequence length"),
        (lambda: Documents.from_cu_seqlens([8]), "from 0 to the sequence length"),
        (lambda: Documents.from_cu_seqlens(8), "list of integers"),
        (lambda: Documents.from_cu_seqlens([0, [4], 8]), "flat list of integers"),
        (lambda: Documents.from_lengths([2.5, 5.5]), "integers"),
        (lambda: Documents([[0, 2.5]], 8), "integers"),
        (lambda: resolve_documents(Documents.from_lengths([4, 4]), 1, 16), "16"),
        (lambda: resolve_documents(Documents.from_lengths([[4, 4]] * 2), 3, 8), "batch rows"),
        (lambda: resolve_documents([0, 4], 1, 8), "Documents"),
    ],
)
def test_bad_documents_name_the_fix(build, match):
    with pytest.raises(ValueError, match=match):
        build()


# --------------------------------------------------------------------------- the oracle
@pytest.mark.parametrize("kind", ["random", "causal", "local_plus_verticals"])
def test_oracle_is_attention_within_each_document(kind):
    """The oracle with documents equals the oracle run on each document alone (its rows and keys, at their
    global positions, under the same global pattern)."""
    gen = torch.Generator().manual_seed(11)
    n, g = 80, 16
    docs = Documents.from_lengths([7, 30, 1, 42])
    pattern = make_pattern(kind, 1, 2, n, g, gen)
    q, k, v, _ = make_qkv(1, n, n, 2, 1, 16, torch.float64, gen)
    out, lse = attention_oracle(q, k, v, pattern, documents=docs)
    for start, length in zip(docs.starts[0].tolist(), docs.lengths().tolist()):
        rows = slice(start, start + length)
        pos = torch.arange(start, start + length)
        want, want_lse = attention_oracle(q[:, rows], k[:, rows], v[:, rows], pattern, pos, pos)
        assert_close("out", out[:, rows], want, 1e-12)
        assert_close("lse", lse[..., rows], want_lse, 1e-12)
    assert rel_err(out, attention_oracle(q, k, v, pattern)[0]) > 0.1  # the documents change the answer


# --------------------------------------------------------------------------- backends against the oracle
def check_backend(backend, dtype, q, k, v, pattern, docs, q_pos=None, k_pos=None, gen=None, tol=None):
    """Forward and backward of ``sparse_attention`` with documents against the float64 oracle."""
    tol = tol or CPU_TOL[dtype]
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out_ref, lse_ref = attention_oracle(q64, k64, v64, pattern, q_pos, k_pos, documents=docs)
    grad = torch.randn(out_ref.shape, generator=gen, dtype=torch.float64)
    refs = torch.autograd.grad(out_ref, (q64, k64, v64), grad)
    out, lse = sparse_attention(q, k, v, pattern, q_pos, k_pos, return_lse=True, backend=backend, documents=docs)
    grads = torch.autograd.grad(out, (q, k, v), grad.to(dtype))
    assert not torch.isnan(out).any()
    assert rel_err(out, out_ref) < tol, rel_err(out, out_ref)
    assert_close("lse", lse, lse_ref, 50 * tol)
    for name, got, ref in zip("qkv", grads, refs):
        assert not torch.isnan(got).any(), f"d{name} has unwritten (NaN) entries"
        assert rel_err(got, ref) < 2 * tol, f"d{name}: {rel_err(got, ref)}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,docs_kind,seq,block,heads,batch",
    [
        ("random", "mixed", 77, 16, (4, 2), 2),  # partial last block, per-row documents, GQA
        ("local_plus_verticals", "short", 96, 32, (2, 1), 1),  # documents shorter than a block
        ("dense", "spanning", 96, 16, (2, 2), 1),
        ("causal", "mixed", 83, 16, (2, 1), 2),  # no pattern: the dense path with documents
        ("local_far", "quarters", 128, 16, (2, 1), 1),
    ],
)
@pytest.mark.parametrize("backend,dtype", [("torch", torch.float64), ("triton", torch.float32)])
def test_backends_match_oracle(kind, docs_kind, seq, block, heads, batch, backend, dtype):
    gen = torch.Generator().manual_seed(seq * 31 + block)
    hq, hkv = heads
    q, k, v, _ = make_qkv(batch, seq, seq, hq, hkv, 16, torch.float64, gen)
    pattern = make_pattern(kind, batch, hq, seq, block, gen, diags=3, verticals=12)
    docs = make_documents(docs_kind, seq, block, gen, batch)
    check_backend(backend, dtype, q, k, v, pattern, docs, gen=gen)


def test_triton_half_precision_and_one_row_for_the_batch():
    """fp16 kernels, one row of boundaries for a batch of two."""
    gen = torch.Generator().manual_seed(5)
    n, g = 64, 16
    q, k, v, _ = make_qkv(2, n, n, 4, 2, 16, torch.float64, gen)
    pattern = make_pattern("random_heads", 2, 4, n, g, gen)
    docs = Documents.from_lengths([9, 20, 3, 32])
    check_backend("triton", torch.float16, q, k, v, pattern, docs, gen=gen)


@pytest.mark.parametrize("q_rank,k_rank", [(1, 0), (3, 1), (2, 2)])
def test_ring_step_chunk_pairs(q_rank, k_rank):
    """A striped layout's chunk pairs (one ring step) with boundaries inside stripes: the per-chunk
    primitives of both backends equal the oracle on those rows and keys."""
    gen = torch.Generator().manual_seed(q_rank * 4 + k_rank)
    n, g, world = 256, 16, 4
    layout = make_layout("striped", n, world, g)
    q_pos, k_pos = layout.positions(q_rank), layout.positions(k_rank)
    pattern = make_pattern("random", 1, 4, n, g, gen)
    docs = Documents.from_lengths([37, 5, 90, 11, 113])
    q, k, v, _ = make_qkv(1, q_pos.numel(), k_pos.numel(), 4, 2, 16, torch.float64, gen)
    ref, ref_lse = attention_oracle(q, k, v, pattern, q_pos, k_pos, documents=docs)
    bound = docs.left_bounds(q_pos)
    for backend, dtype, tol in (("torch", torch.float64, 1e-10), ("triton", torch.float32, 2e-5)):
        args = (q.to(dtype), k.to(dtype), v.to(dtype), pattern, q_pos, k_pos, 0.25)
        out, lse = attention_forward(*args, backend=backend, q_bound=bound)
        want, want_lse = attention_oracle(*args[:6], softmax_scale=0.25, documents=docs)
        assert_close(f"out {backend}", out, want, 20 * tol)
        assert_close(f"lse {backend}", lse, want_lse, 50 * tol)
        do = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(dtype)
        grads = attention_backward(
            do, *args[:3], lse, attention_delta(do, out), *args[3:], backend=backend, q_bound=bound
        )
        qq, kk, vv = (t.double().requires_grad_() for t in args[:3])
        o64, _ = attention_oracle(qq, kk, vv, pattern, q_pos, k_pos, softmax_scale=0.25, documents=docs)
        refs = torch.autograd.grad(o64, (qq, kk, vv), do.double())
        for name, got, r in zip("qkv", grads, refs):
            assert rel_err(got, r) < 2 * tol, f"d{name} {backend}: {rel_err(got, r)}"
    assert ref.shape == out.shape and ref_lse.shape == lse.shape


def test_dropping_the_bound_fails(monkeypatch):
    """The tests above can fail: with the left bound dropped (every row sees from position 0) the kernels
    compute across documents and no longer match the oracle."""
    gen = torch.Generator().manual_seed(2)
    n, g = 64, 16
    q, k, v, _ = make_qkv(1, n, n, 2, 1, 16, torch.float64, gen)
    pattern = make_pattern("random", 1, 2, n, g, gen)
    docs = Documents.from_lengths([9, 20, 3, 32])
    monkeypatch.setattr(Documents, "left_bounds", lambda self, pos: torch.zeros(1, pos.numel(), dtype=torch.int32))
    for backend, dtype in (("torch", torch.float64), ("triton", torch.float32)):
        with pytest.raises(AssertionError):
            check_backend(backend, dtype, q, k, v, pattern, docs, gen=gen)


def test_one_document_is_todays_attention_bit_for_bit():
    gen = torch.Generator().manual_seed(4)
    n, g = 64, 16
    q, k, v, _ = make_qkv(2, n, n, 2, 1, 16, torch.float32, gen)
    pattern = make_pattern("random", 2, 2, n, g, gen)
    one = Documents.from_lengths([n])
    for backend in ("torch", "triton"):
        want = sparse_attention(q, k, v, pattern, return_lse=True, backend=backend)
        got = sparse_attention(q, k, v, pattern, return_lse=True, backend=backend, documents=one)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_dense_blocks_by_document():
    """No pattern: dense blocks, one causal block per document, through the reference per-block path."""
    gen = torch.Generator().manual_seed(8)
    n = 96
    q, k, v, _ = make_qkv(1, n, n, 2, 2, 16, torch.float64, gen)
    docs = Documents.from_lengths([10, 50, 36])
    with dense_backend("reference"):
        check_backend("torch", torch.float64, q, k, v, None, docs, gen=gen)


# --------------------------------------------------------------------------- the walks
def kept_blocks(pattern, docs, q_pos, k_pos, g):
    """Boolean [B, H, nQB, nKB]: which (query block, key block) pairs of the chunk hold a pair that the
    block part of the pattern keeps within one document, from the oracle's definition."""
    same = docs.doc_ids(q_pos)[:, :, None] == docs.doc_ids(k_pos)[:, None, :]
    causal = k_pos[None, :] <= q_pos[:, None]
    delta = q_pos[:, None] // g - k_pos[None, :] // g
    block_part = pattern.diag_mask()[:, :, delta.clamp(min=0)] & (delta >= 0)
    kept = block_part & (same & causal)[:, None]
    b, h, sq, sk = kept.shape
    return kept.view(b, h, -1, g, sk // g, g).any(-1).any(-2)


def walk_blocks(walk, pos_other, g, n_other):
    """Boolean [B, H, nBlocks, nOtherBlocks] of the blocks a walk visits (its lists and its diagonal)."""
    b, h, nblocks, _ = walk.starts.shape
    seen = torch.zeros(b, h, nblocks, n_other, dtype=torch.bool)
    for idx in torch.cartesian_prod(torch.arange(b), torch.arange(h), torch.arange(nblocks)).tolist():
        bi, hi, blk = idx
        for start in walk.starts[bi, hi, blk, : walk.count[bi, hi, blk]].tolist():
            seen[bi, hi, blk, start // g] = True
        if walk.diag[bi, hi, blk] >= 0:
            seen[bi, hi, blk, walk.diag[bi, hi, blk] // g] = True
    return seen


@pytest.mark.parametrize("docs_kind", ["mixed", "short", "spanning"])
@pytest.mark.parametrize("ranks", [None, (3, 1), (2, 2)])
def test_walks_visit_exactly_the_blocks_holding_kept_pairs(docs_kind, ranks):
    """Work follows the pairs the documents keep: the blocks each walk visits are exactly those holding a
    kept pair, the prefix it visits without a mask holds no pair of two documents, and the rest does."""
    g, n = 16, 256
    gen = torch.Generator().manual_seed(len(docs_kind) * 7 + (ranks or (0, 0))[0])
    pattern = make_pattern("random_heads", 2, 3, n, g, gen)
    docs = make_documents(docs_kind, n, g, gen, batch=2)
    if ranks is None:
        q_pos = k_pos = torch.arange(n)
    else:
        layout = make_layout("striped", n, 4, g)
        q_pos, k_pos = layout.positions(ranks[0]), layout.positions(ranks[1])
    q_pos, k_pos = q_pos.int(), k_pos.int()
    bound = docs.left_bounds(q_pos)
    pair = ki.chunk_pair_torch(pattern, q_pos, k_pos)
    qwalk = ki.query_walk_torch(pattern, pair, bound)
    kwalk = ki.key_walk_torch(pattern, pair, 4, bound)
    kept = kept_blocks(pattern, docs, q_pos, k_pos, g)
    assert torch.equal(walk_blocks(qwalk, k_pos, g, kept.shape[-1]), kept)
    assert torch.equal(walk_blocks(kwalk, q_pos, g, kept.shape[-2]), kept.transpose(-1, -2))
    all_causal = ki.query_walk_torch(pattern, pair)
    cut = qwalk.count.sum() < all_causal.count.sum()  # the documents cut work (spanning: a long document)
    assert cut or docs_kind == "spanning"
    # the unmasked prefix holds only pairs inside one document; the masked rest crosses a boundary
    crossing = docs.doc_ids(q_pos)[:, :, None] != docs.doc_ids(k_pos)[:, None, :]
    crossing = crossing & (k_pos[None, :] <= q_pos[:, None])
    crossing = crossing.view(2, -1, g, k_pos.numel() // g, g).any(-1).any(-2)  # [B, nQB, nKB]
    for bi, hi, blk in torch.cartesian_prod(torch.arange(2), torch.arange(3), torch.arange(qwalk.count.shape[-1])):
        listed = qwalk.starts[bi, hi, blk, : qwalk.count[bi, hi, blk]] // g
        plain = int(qwalk.unmasked[bi, hi, blk])
        assert not crossing[bi, blk, listed[:plain].long()].any()
        assert crossing[bi, blk, listed[plain:].long()].all()
    # verticals: each query block starts at the first vertical its rows' documents reach
    vpos = pair.vcol_pos
    lo = bound[:, ::g]
    for bi, hi in torch.cartesian_prod(torch.arange(2), torch.arange(3)).tolist():
        first = qwalk.vfirst[bi, hi]
        assert bool((vpos[bi, hi].long()[None, :] < lo[bi].long()[:, None]).sum(-1).eq(first).all())


# --------------------------------------------------------------------------- accounting
@pytest.mark.parametrize(
    "kind,docs_kind,batch",
    [("random", "mixed", 1), ("random_heads", "short", 2), ("local_far", "spanning", 1), ("verticals", "quarters", 2)],
)
def test_kept_pairs_and_density_count_the_document_mask(kind, docs_kind, batch):
    """kept_pairs/density with documents count exactly the pairs of the oracle's mask (and without, as before)."""
    gen = torch.Generator().manual_seed(len(kind) + batch)
    n, g = 16 * 7 + 5, 16
    pattern = make_pattern(kind, 2, 3, n, g, gen, diags=3, verticals=20)
    docs = make_documents(docs_kind, n, g, gen, batch=batch)
    q64 = torch.zeros(2, n, 3, 16, dtype=torch.float64)
    k64 = torch.zeros(2, n, 1, 16, dtype=torch.float64)
    _, lse = attention_oracle(q64, k64, k64, pattern, documents=docs)  # all scores 0: lse = log(kept pairs)
    kept = lse.exp().sum(-1).round()
    assert torch.equal(pattern.kept_pairs(docs), kept)
    _, lse_dense = attention_oracle(q64, k64, k64, None, documents=docs)
    assert torch.allclose(pattern.density(docs), kept / lse_dense.exp().sum(-1).round())
    _, lse_all = attention_oracle(q64, k64, k64, pattern)
    assert torch.equal(pattern.kept_pairs(), lse_all.exp().sum(-1).round())


# --------------------------------------------------------------------------- estimation
def brute_document_scores(q, k, docs, last_q, scale):
    """(vertical, slash) [B, Hq, N] float64: the last ``last_q`` rows of each document (all of a shorter one)
    against their own document's keys, softmax-normalised within it, by brute force."""
    b, n, hq, _ = q.shape
    group = hq // k.shape[2]
    vertical = torch.zeros(b, hq, n, dtype=torch.float64)
    slash = torch.zeros(b, hq, n, dtype=torch.float64)
    for bi in range(b):
        row = min(bi, docs.batch - 1)
        for start, length in zip(docs.starts[row].tolist(), docs.lengths(row).tolist()):
            for i in range(start + length - min(last_q, length), start + length):
                keys = torch.arange(start, i + 1)
                kh = k[bi, keys].double().repeat_interleave(group, dim=1)  # [j, Hq, D]
                p = torch.softmax(torch.einsum("hd,jhd->hj", q[bi, i].double(), kh) * scale, -1)
                vertical[bi, :, keys] += p
                slash[bi, :, i - keys] += p
    return vertical, slash


@pytest.mark.parametrize("docs_kind,batch", [("mixed", 2), ("short", 1), ("spanning", 1), ("quarters", 2)])
def test_estimate_scores_each_document_against_its_own_keys(docs_kind, batch):
    """The estimate with documents equals line selection on brute-force per-document scores; every document's
    first sinks are forced; dropping the documents' bounds gives other scores (the check can fail)."""
    gen = torch.Generator().manual_seed(len(docs_kind) * 3 + batch)
    n, g, hq, hkv = 112, 16, 4, 2
    q, k, _, _ = make_qkv(batch, n, n, hq, hkv, 16, torch.float64, gen)
    docs = make_documents(docs_kind, n, g, gen, batch)
    config = PatternConfig(v_size=40, s_size=48, last_q=8, block_size=g, sink_tokens=2, local_window=16)
    pattern = estimate_pattern(q, k, config, documents=docs)
    vertical, slash = brute_document_scores(q, k, docs, config.last_q, 0.25)
    want = select_lines(vertical.float(), slash.float(), config, n, documents=docs)
    assert torch.equal(pattern.vertical_mask(), want.vertical_mask())
    assert torch.equal(pattern.diag_mask(), want.diag_mask())
    sinks = estimator.document_sinks(docs, config.sink_tokens, q.device).expand(batch, hq, n)
    enough = sinks.sum(-1) <= config.v_size
    assert (pattern.vertical_mask() | ~sinks)[enough].all()  # every document's sinks where the budget allows
    assert pattern.num_verticals.max() <= config.v_size
    ignored = select_lines(*brute_document_scores(q, k, Documents.from_lengths([n]), config.last_q, 0.25), config, n)
    assert not torch.equal(ignored.vertical_mask(), pattern.vertical_mask())


def test_document_sinks_are_forced_earliest_first():
    """More documents than the vertical budget holds sinks for: the earliest documents' sinks win."""
    n = 64
    docs = Documents.from_lengths([4] * 16)
    config = PatternConfig(v_size=6, s_size=8, last_q=4, block_size=16, sink_tokens=2, local_window=4)
    vertical = torch.rand(1, 1, n, generator=torch.Generator().manual_seed(0))
    pattern = select_lines(vertical, torch.rand(1, 1, n), config, n, documents=docs)
    assert pattern.vertical_pos[0, 0].tolist() == [0, 1, 4, 5, 8, 9]


def test_scoring_rows_of_short_documents():
    docs = Documents.from_lengths([3, 10, 1])
    pos, bound = estimator.scoring_rows(docs, 0, 4)
    assert pos.tolist() == [0, 1, 2, 9, 10, 11, 12, 13]
    assert bound.tolist() == [0, 0, 0, 3, 3, 3, 3, 13]

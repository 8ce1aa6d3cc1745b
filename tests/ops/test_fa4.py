"""backend="fa4" (ops/sparse/fa4.py): the selected blocks by a block-sparse kernel, the verticals outside them by the
Triton kernels (interpreter), merged exactly; and the tile lists a pattern becomes (ops/sparse/block_lists.py).

On the CPU the block part is ``TorchBlocks``, exact masked attention on the listed tiles, standing in for FA4; the
one ``cuda`` test runs FA4 itself (flash-attn-4 installed).
"""

from __future__ import annotations

import sys

import pytest
import torch

from mtraining.ops import VerticalSlashPattern, attention_oracle
from mtraining.ops.numerics import row_delta
from mtraining.ops.sparse import fa4, sparse_attention
from mtraining.ops.sparse.attention import ChunkPlan
from mtraining.ops.sparse.block_lists import dense_mask, sparse_blocks
from tests.fa4_blocks import TorchBlocks, tile_pairs
from tests.factories import make_documents, make_pattern, make_qkv
from tests.numerics import assert_close, rel_err

TOL = 2e-5  # float32 against the float64 oracle, as tests/ops/test_kernels.py


def blocks_only(b: int, h: int, n: int, g: int, seed: int) -> VerticalSlashPattern:
    """Random block diagonals (the main one on most heads), no verticals."""
    gen = torch.Generator().manual_seed(seed)
    diag = torch.rand(b, h, -(-n // g), generator=gen) < 0.4
    diag[:, 1:, 0] = True
    return VerticalSlashPattern.from_masks(diag, torch.zeros(b, h, n, dtype=torch.bool), g)


def inside_blocks(b: int, h: int, n: int, g: int, seed: int) -> VerticalSlashPattern:
    """The double-count trap: the first two block diagonals, one far one, and verticals of which many lie in
    selected blocks of their rows (every key of the first blocks, and random ones)."""
    gen = torch.Generator().manual_seed(seed)
    nb = -(-n // g)
    diag = torch.zeros(b, h, nb, dtype=torch.bool)
    diag[..., :2] = True
    diag[..., nb // 2] = True
    vert = torch.rand(b, h, n, generator=gen) < 0.1
    vert[..., : g + 3] = True
    return VerticalSlashPattern.from_masks(diag, vert, g)


def pattern_of(kind: str, b: int, h: int, n: int, g: int, seed: int) -> VerticalSlashPattern:
    if kind == "blocks_only":
        return blocks_only(b, h, n, g, seed)
    if kind == "inside_blocks":
        return inside_blocks(b, h, n, g, seed)
    pattern = make_pattern(kind, b, h, n, g, seed, diags=2, verticals=n // 8)
    assert pattern is not None
    return pattern


# ----------------------------------------------------------------------------- tile lists
@pytest.mark.parametrize("kind", ["random", "blocks_only", "inside_blocks", "dense", "empty"])
@pytest.mark.parametrize("n,g,tile", [(96, 16, 16), (100, 32, 16), (128, 32, 32), (90, 32, 8), (70, 32, 16)])
def test_tile_lists_cover_the_selected_blocks(kind, n, g, tile):
    pattern = pattern_of(kind, 2, 3, n, g, seed=n + g + tile)
    blocks = sparse_blocks(pattern, n, tile)
    n_tiles = -(-n // tile)
    no_verticals = VerticalSlashPattern.from_masks(pattern.diag_mask(), torch.zeros(2, 3, n, dtype=torch.bool), g)
    want = no_verticals.pair_mask(torch.arange(n), torch.arange(n))
    assert torch.equal(tile_pairs(blocks.forward, tile, n, per_query=True), want), "forward lists"
    assert torch.equal(tile_pairs(blocks.backward, tile, n, per_query=False), want), "backward lists"
    on_diagonal = torch.arange(n) // tile
    on_diagonal = on_diagonal[:, None] == on_diagonal[None, :]
    for lists, name in ((blocks.forward, "forward"), (blocks.backward, "backward")):
        partial, full = dense_mask(lists, tile, n)
        assert not (partial & ~on_diagonal).any(), f"{name}: a partial tile off the main diagonal"
        assert not (full & on_diagonal).any(), f"{name}: a full tile on the main diagonal"
        for count, index in ((lists.partial_count, lists.partial_index), (lists.full_count, lists.full_index)):
            assert count.dtype == index.dtype == torch.int32 and count.shape == (2, 3, n_tiles)
            used = torch.arange(index.shape[-1]) < count[..., None]
            steps = index[..., 1:] - index[..., :-1]
            assert (steps[used[..., 1:]] > 0).all(), f"{name}: lists must ascend"
            assert (index[used] < n_tiles).all() and (index[~used] == 0).all()
            assert index.shape[-1] <= n_tiles, f"{name}: lists wider than the tiles (FA4 refuses them)"


def test_tile_must_divide_the_pattern_block():
    with pytest.raises(ValueError, match="multiple of the block-sparse tile 128"):
        sparse_blocks(blocks_only(1, 1, 256, 64, 0), 256)


# ----------------------------------------------------------------------------- forward and backward
def _chunk(pattern: VerticalSlashPattern, n: int, scale: float) -> ChunkPlan:
    pos = torch.arange(n, dtype=torch.int32)
    return ChunkPlan(pattern, pos, pos, scale, backend="fa4", dense=None)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["inside_blocks", "verticals", "blocks_only", "random", "local_far"])
@pytest.mark.parametrize("n,g,tile,heads", [(256, 32, 16, (4, 2)), (200, 16, 16, (2, 1))])
def test_split_matches_oracle(kind, n, g, tile, heads):
    """Forward (out, lse) and backward (dq, dk, dv, given the whole rows' out, lse and delta) of the split
    against the float64 oracle: each kept pair computed once, by the blocks or by a vertical."""
    hq, hkv = heads
    pattern = pattern_of(kind, 1, hq, n, g, seed=n + g)
    q, k, v, do = make_qkv(1, n, n, hq, hkv, 16, torch.float32, gen=n + g + hq)
    backend, scale = fa4.SplitBackend(TorchBlocks(), tile), 0.25
    chunk = _chunk(pattern, n, scale)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out_ref, lse_ref = attention_oracle(q64, k64, v64, pattern, softmax_scale=scale)
    grads_ref = torch.autograd.grad(out_ref, (q64, k64, v64), do.double())

    out, lse = backend.forward(chunk, q, k, v, torch.float32)
    assert rel_err(out, out_ref) < TOL
    assert_close("lse", lse, lse_ref, 50 * TOL)
    out_ref, lse_ref = out_ref.detach().float(), lse_ref.float()
    grads = backend.backward(chunk, do, q, k, v, out_ref, lse_ref, row_delta(do, out_ref), torch.float32)
    for name, got, ref in zip("qkv", grads, grads_ref):
        assert not torch.isnan(got).any(), f"d{name} has unwritten (NaN) entries"
        assert rel_err(got, ref) < 2 * TOL, f"d{name}"


def test_sparse_attention_runs_the_split(monkeypatch):
    """sparse_attention(backend="fa4") plans the split and its autograd backward hands it the rows' out."""
    n, g = 256, 128
    monkeypatch.setattr(fa4, "FA4", fa4.SplitBackend(TorchBlocks(), tile=32))
    pattern = inside_blocks(1, 4, n, g, seed=5)
    q, k, v, do = make_qkv(1, n, n, 4, 2, 16, torch.float32, gen=5)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out_ref, lse_ref = attention_oracle(q64, k64, v64, pattern)
    grads_ref = torch.autograd.grad(out_ref, (q64, k64, v64), do.double())
    out, lse = sparse_attention(q, k, v, pattern, return_lse=True, backend="fa4")
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert rel_err(out, out_ref) < TOL
    assert_close("lse", lse, lse_ref, 50 * TOL)
    for name, got, ref in zip("qkv", grads, grads_ref):
        assert rel_err(got, ref) < 2 * TOL, f"d{name}"


# ----------------------------------------------------------------------------- what fa4 does not take
@pytest.mark.parametrize(
    "case,match",
    [
        ("no pattern", "dense causal attention use backend='auto'"),
        ("positions", "default positions"),
        ("fewer queries", "as many queries as keys"),
        ("documents", "packed documents; use backend='triton'"),
        ("columns", "per-block columns"),
        ("block 64", "multiple of 128"),
    ],
)
def test_unsupported_calls_name_the_fix(case, match):
    n, g = 256, 64 if case == "block 64" else 128
    q, k, v, _ = make_qkv(1, n, n, 2, 1, 16, torch.float32)
    pattern = blocks_only(1, 2, n, g, 0)
    kwargs: dict = {}
    if case == "no pattern":
        pattern = None
    elif case == "positions":
        kwargs = dict(q_pos=torch.arange(n), k_pos=torch.arange(n))
    elif case == "fewer queries":
        q = q[:, -128:]
    elif case == "documents":
        kwargs = dict(documents=make_documents("quarters", n, g, 0))
    elif case == "columns":
        columns = torch.full((1, 2, 2, 1), -1)
        columns[:, :, 1, 0] = 0  # key 0 for the rows of block 1
        pattern = pattern.with_block_columns(columns)
    with pytest.raises(ValueError, match=match):
        sparse_attention(q, k, v, pattern, backend="fa4", **kwargs)


def test_fa4_on_cpu_or_in_float32_names_the_fix():
    q, k, v, _ = make_qkv(1, 256, 256, 2, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="CUDA in float16 or bfloat16"):
        sparse_attention(q, k, v, blocks_only(1, 2, 256, 128, 0), backend="fa4")


def test_missing_flash_attn_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import flash_attn raises ImportError
    with pytest.raises(ImportError, match="pip install flash-attn-4"):
        fa4.FlashAttention4().backward(*[torch.empty(0)] * 6, None, 1.0)  # type: ignore[arg-type]


def test_ring_steps_are_refused():
    pos = torch.arange(128, dtype=torch.int32)
    plan = ChunkPlan(blocks_only(1, 1, 128, 128, 0), pos, pos, 1.0, backend="fa4", dense=None)
    q = torch.zeros(1, 128, 1, 16)
    with pytest.raises(ValueError, match="not ring steps"):
        plan.forward(q, q, q, q.dtype, merge_into=(q, torch.zeros(1, 1, 128)))


# ----------------------------------------------------------------------------- FA4 itself
@pytest.mark.cuda
@pytest.mark.parametrize("g,kind,d", [(128, "local_far", 128), (256, "local_far", 128), (128, "random", 128), (128, "local_far", 64)])  # fmt: skip
def test_fa4_matches_oracle_bf16(g, kind, d):
    """The real backend (flash-attn-4 kernels, Triton verticals) in bf16 at 8K tokens against the float32 torch
    backend (itself checked against the float64 oracle): out, lse, dq, dk, dv. "random": query tiles that meet
    no block, rows that see no key. Head dims 128 (Qwen2.5-3B) and 64 (SmolLM2, FA4's other tile choice)."""
    pytest.importorskip("flash_attn.cute", reason="flash-attn-4 is not installed")
    from mtraining.ops.sparse import attention_backward, attention_delta, attention_forward

    n, hq, hkv = 8192 - 64 * (g == 256), 8, 2
    gen = torch.Generator().manual_seed(g)
    q, k, v = (torch.randn(1, n, h, d, generator=gen).cuda() for h in (hq, hkv, hkv))
    pattern = make_pattern(kind, 1, hq, n, g, gen, diags=4, verticals=256)
    assert pattern is not None
    pattern = pattern.to("cuda")
    pos = torch.arange(n, device="cuda", dtype=torch.int32)
    scale = d**-0.5
    out_ref, lse_ref = attention_forward(q, k, v, pattern, pos, pos, scale, backend="torch")
    do = torch.randn(out_ref.shape, generator=gen).cuda()
    grads_ref = attention_backward(
        do, q, k, v, lse_ref, attention_delta(do, out_ref), pattern, pos, pos, scale, backend="torch"
    )
    qb, kb, vb = (t.bfloat16().requires_grad_() for t in (q, k, v))
    out, lse = sparse_attention(qb, kb, vb, pattern, return_lse=True, backend="fa4")
    grads = torch.autograd.grad(out, (qb, kb, vb), do.bfloat16())
    assert rel_err(out, out_ref) < 1e-2
    assert_close("lse", lse, lse_ref, 5e-3)
    for name, got, ref in zip("qkv", grads, grads_ref):
        assert not torch.isnan(got).any(), f"d{name}"
        assert rel_err(got, ref) < 2e-2, f"d{name}"

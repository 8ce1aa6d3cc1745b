"""Choosing per-block columns (ops/estimate/block_columns.py) against a brute-force float64 ranking, on one
device and over gloo ranks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from mtraining.ops import PatternConfig, estimate_pattern
from mtraining.ops.estimate.block_columns import select_block_columns
from mtraining.ops.estimate.hashing import hash_codes, hash_planes
from mtraining.parallel import make_layout
from mtraining.parallel.estimate import _block_columns_cp, estimate_pattern_cp
from tests.factories import make_documents
from tests.rings import LAYOUTS, SEQ, G

CONFIG = PatternConfig(v_size=8, s_size=6, last_q=16, block_size=G, sink_tokens=2, local_window=4)
TABLES, BITS = 4, 3  # coarse hashes: many mates, so the ranking (not the hash) decides most columns


def inputs(seed: int, b: int, n: int, hq: int, hkv: int, d: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, hq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, n, hkv, d, generator=gen, dtype=torch.float64)
    return q, k


def brute_force(q, k, pattern, per_block, scale, documents=None, seed=0) -> list[list[list[set[int]]]]:
    """Each block's chosen columns as sets, by loops over blocks, rows and keys in float64."""
    b, n, hq, d = q.shape
    group = hq // k.shape[2]
    planes = hash_planes(hq, d, TABLES, BITS, seed).double()
    codes_q = hash_codes(q.transpose(1, 2), planes, BITS)
    codes_k = hash_codes(k.transpose(1, 2).repeat_interleave(group, dim=1), planes, BITS)
    pos = torch.arange(n)
    kept = pattern.pair_mask(pos, pos)  # [B, H, N, N]
    starts = torch.zeros(b, n, dtype=torch.long) if documents is None else documents.left_bounds(pos).long()
    chosen = []
    for bi in range(b):
        per_head = []
        for h in range(hq):
            keys = k[bi, :, h // group]
            logits = q[bi, :, h] @ keys.T * scale  # [N, N]
            blocks = []
            for r in range(pattern.num_blocks):
                score = {}
                for i in range(r * G, min((r + 1) * G, n)):
                    seen = [j for j in range(starts[bi, i], i + 1)]
                    kept_keys = [j for j in seen if kept[bi, h, i, j]]
                    lse = torch.logsumexp(logits[i, kept_keys or seen], 0)
                    for j in seen:
                        if j >= r * G or kept[bi, h, i, j]:
                            continue
                        if not bool((codes_q[bi, h, i] == codes_k[bi, h, j]).any()):
                            continue
                        score[j] = score.get(j, 0.0) + float(torch.exp(logits[i, j] - lse))
                ranked = sorted(score, key=lambda j: -score[j])[:per_block]
                blocks.append(set(ranked))
            per_head.append(blocks)
        chosen.append(per_head)
    return chosen


def as_sets(columns: torch.Tensor, n: int) -> list[list[list[set[int]]]]:
    return [[[{int(j) for j in blk if j < n} for blk in head] for head in row] for row in columns]


@pytest.mark.parametrize("scorer", ["sorted", "dense"])
@pytest.mark.parametrize("docs_kind", [None, "mixed", "short"])
@pytest.mark.parametrize("b,hq,hkv,n", [(1, 2, 1, 96), (2, 4, 2, 104)])
def test_columns_match_brute_force(docs_kind, b, hq, hkv, n, scorer):
    q, k = inputs(n + b, b, n, hq, hkv)
    documents = None if docs_kind is None else make_documents(docs_kind, n, G, 7, b)
    lines = estimate_pattern(q, k, CONFIG, documents=documents)
    scale = 0.25
    got = select_block_columns(q, k, lines, 3, scale, documents=documents, tables=TABLES, bits=BITS, scorer=scorer)
    assert got.shape == (b, hq, lines.num_blocks, 3) and got.dtype == torch.int32
    assert bool(((got.diff(dim=-1) > 0) | (got[..., 1:] == n)).all())  # ascending, padding last
    assert as_sets(got, n) == brute_force(q, k, lines, 3, scale, documents)
    if docs_kind != "short":  # short documents may leave no key before a block in its rows' documents
        assert any(s for row in as_sets(got, n) for head in row for s in head)  # the test chose something


def test_rows_given_by_position_rank_only_their_blocks():
    """q_pos names whole blocks: their columns are those of the full call, every other block is padding."""
    q, k = inputs(3, 1, 96, 2, 2)
    lines = estimate_pattern(q, k, CONFIG)
    full = select_block_columns(q, k, lines, 4, 0.25, tables=TABLES, bits=BITS)
    rows = torch.cat([torch.arange(16, 32), torch.arange(64, 80)])
    part = select_block_columns(q[:, rows], k, lines, 4, 0.25, q_pos=rows, tables=TABLES, bits=BITS)
    assert torch.equal(part[:, :, [1, 4]], full[:, :, [1, 4]])
    assert bool((part[:, :, [0, 2, 3, 5]] == 96).all())


def test_no_mates_no_columns_and_zero_per_block():
    q, k = inputs(5, 1, 64, 2, 2)
    lines = estimate_pattern(q, k, CONFIG)
    assert select_block_columns(q, k, lines, 0, 0.25).shape == (1, 2, 4, 0)
    # one table of 30 bits: a query and a key share no bucket (almost surely), so no block finds a candidate
    assert bool((select_block_columns(q, k, lines, 4, 0.25, tables=1, bits=30) == 64).all())


def test_config_checks_block_columns():
    with pytest.raises(ValueError, match="block_columns must be >= 0"):
        PatternConfig(block_columns=-1)
    q, k = inputs(1, 1, 64, 2, 2)
    config = PatternConfig(v_size=8, s_size=6, last_q=16, block_size=G, local_window=4, block_columns=2)
    with pytest.raises(ValueError, match="whole sequence at default positions"):
        estimate_pattern(q[:, 32:], k, config)


def columns_case(group, layout_name, q, k, config, docs):
    """Worker: the per-block columns of the whole sequence from this rank's shards."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = make_layout(layout_name, q.shape[1], world, G)
    lines = estimate_pattern(q, k, CONFIG, documents=docs)
    return _block_columns_cp(layout.shard(q, rank), layout.shard(k, rank), lines, config, group, layout, 0, 0.25, docs)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("docs_kind", [None, "mixed"])
def test_distributed_columns_equal_single_device(pool, world, layout_name, docs_kind):
    n = SEQ[world]
    q, k = inputs(world, 1, n, 4, 2)
    docs = None if docs_kind is None else make_documents(docs_kind, n, G, 5, 1)
    config = PatternConfig(
        v_size=8, s_size=6, last_q=16, block_size=G, local_window=4, block_columns=3, column_tables=TABLES,
        column_bits=BITS,
    )  # fmt: skip
    lines = estimate_pattern(q, k, CONFIG, documents=docs)
    want = select_block_columns(q, k, lines, 3, 0.25, documents=docs, tables=TABLES, bits=BITS)
    for got in pool.run(columns_case, world, layout_name, q, k, config, docs):
        assert torch.equal(got, want)


def estimate_case(group, layout_name, q, k, config, docs):
    """Worker: the distributed estimate (lines and columns) from this rank's shards."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = make_layout(layout_name, q.shape[1], world, G)
    p = estimate_pattern_cp(layout.shard(q, rank), layout.shard(k, rank), config, group, layout, documents=docs)
    return p.block_cols, p.density(docs)


@pytest.mark.parametrize("docs_kind", [None, "mixed"])
def test_estimates_carry_the_columns_alike_on_one_device_and_over_ranks(pool, docs_kind):
    n = SEQ[2]
    q, k = inputs(9, 1, n, 4, 2)
    docs = None if docs_kind is None else make_documents(docs_kind, n, G, 6, 1)
    config = PatternConfig(v_size=8, s_size=6, last_q=16, block_size=G, local_window=4, block_columns=3)
    lines = estimate_pattern(q, k, replace(config, block_columns=0), documents=docs)
    single = estimate_pattern(q, k, config, documents=docs)
    assert single.block_cols is not None and bool((single.density(docs) > lines.density(docs)).all())
    for cols, density in pool.run(estimate_case, 2, "striped", q, k, config, docs):
        assert torch.equal(cols, single.block_cols) and torch.equal(density, single.density(docs))

"""Pattern estimation vs brute force in float64: partial LSE, line scores, line selection, end to end."""

from __future__ import annotations

import math

import pytest
import torch

from mtraining.ops.estimate import estimator
from mtraining.ops.estimate.budgets import Budgets
from mtraining.ops.estimate.estimator import (
    PatternConfig,
    PositionPlan,
    estimate_pattern,
    last_query_partial_lse,
    line_scores,
    select_lines,
)
from mtraining.ops.pattern import VerticalSlashPattern


# --------------------------------------------------------------------------- brute force
def brute_scores(q, q_pos, k, k_pos, scale, seq_len, row_lse=None):
    """(lse [B, Hq, R], vertical [B, Hq, Sk], slash [B, Hq, seq_len]) in float64, slash by a python loop."""
    group = q.shape[2] // k.shape[2]
    qh = q.double().transpose(1, 2)
    kh = k.double().transpose(1, 2).repeat_interleave(group, dim=1)
    s = (qh @ kh.transpose(-1, -2)) * scale
    causal = k_pos[None, :] <= q_pos[:, None]
    s = s.masked_fill(~causal, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    norm = lse if row_lse is None else row_lse.double()
    p = torch.nan_to_num(torch.exp(s - norm[..., None]), nan=0.0)
    slash = torch.zeros(q.shape[0], q.shape[2], seq_len, dtype=torch.float64)
    for a, qp in enumerate(q_pos.tolist()):
        for c, kp in enumerate(k_pos.tolist()):
            if qp >= kp:
                slash[..., qp - kp] += p[..., a, c]
    return lse, p.sum(-2), slash


def brute_select(scores, budget, forced, threshold=None):
    """Boolean [B, H, N] of kept lines: forced ones, then the highest scores (topk or mass threshold)."""
    b, h, n = scores.shape
    keep = torch.zeros(b, h, n, dtype=torch.bool)
    for bi in range(b):
        for hi in range(h):
            row = scores[bi, hi].double()
            rest = row.clone()
            rest[:forced] = -math.inf
            cap = int(budget[hi])
            if threshold is None:
                count = cap
            else:
                total, mass, count = float(row.sum()), float(row[:forced].sum()), forced
                for value in torch.sort(rest[forced:], descending=True).values.tolist():
                    if mass >= threshold * total or count >= cap:
                        break
                    mass, count = mass + value, count + 1
                count = min(max(count, forced), cap)
            keep[bi, hi, :forced] = True
            top = torch.topk(rest, count - forced).indices if count > forced else torch.empty(0, dtype=torch.long)
            keep[bi, hi, top] = True
    return keep


def brute_pattern(vertical, slash, v_budget, s_budget, config, seq_len):
    vmask = brute_select(vertical, v_budget, config.sink_tokens, config.threshold)
    smask = brute_select(slash, s_budget, config.local_window, config.threshold)
    num_blocks = -(-seq_len // config.block_size)
    diag = torch.zeros(*smask.shape[:2], num_blocks, dtype=torch.bool)
    for bi, hi, d in smask.nonzero().tolist():
        diag[bi, hi, d // config.block_size] = True
        if d % config.block_size and d // config.block_size + 1 < num_blocks:
            diag[bi, hi, d // config.block_size + 1] = True
    return vmask, diag


def assert_close(actual, expected, what):
    torch.testing.assert_close(actual.double(), expected.double(), rtol=2e-5, atol=2e-6, msg=what)


def _qk(b, r, hq, hkv, d, sk, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, r, hq, d, generator=g) * 1.5
    k = torch.randn(b, sk, hkv, d, generator=g) * 1.5
    return q, k


@pytest.fixture(params=[None, 97], ids=["one-chunk", "tiny-chunks"])
def chunking(request, monkeypatch):
    if request.param is not None:
        monkeypatch.setattr(estimator, "_CHUNK_ELEMENTS", request.param)
    return request.param


# --------------------------------------------------------------------------- partial LSE / line scores
@pytest.mark.parametrize(
    "b,hq,hkv,d,seq,r",
    [(1, 2, 2, 16, 64, 8), (2, 4, 2, 16, 37, 5), (1, 6, 2, 32, 53, 1), (2, 8, 1, 16, 29, 29)],
)
def test_line_scores_contiguous_match_brute_force(chunking, b, hq, hkv, d, seq, r):
    q, k = _qk(b, r, hq, hkv, d, seq, seed=seq)
    q_pos, k_pos = torch.arange(seq - r, seq), torch.arange(seq)
    scale = 0.7 / math.sqrt(d)
    lse = last_query_partial_lse(q, q_pos, k, k_pos, scale)
    vertical, slash = line_scores(q, q_pos, k, k_pos, scale, lse, seq)
    ref_lse, ref_v, ref_s = brute_scores(q, q_pos, k, k_pos, scale, seq)
    assert lse.dtype == vertical.dtype == slash.dtype == torch.float32
    assert vertical.shape == (b, hq, seq) and slash.shape == (b, hq, seq)
    assert_close(lse, ref_lse, "lse")
    assert_close(vertical, ref_v, "vertical")
    assert_close(slash, ref_s, "slash")
    # every row's probabilities sum to one: both score kinds carry R units of mass per head
    assert_close(slash.sum(-1), torch.full((b, hq), float(r)), "slash mass")


def _split_keys(seq: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Two disjoint key subsets covering 0..seq-1 in a layout-like arrangement."""
    if kind == "striped":
        stripe = torch.arange(seq) // 4 % 2 == 0
        return torch.arange(seq)[stripe], torch.arange(seq)[~stripe]
    if kind == "zigzag":
        a = torch.cat([torch.arange(0, seq // 4), torch.arange(3 * seq // 4, seq)])
        b = torch.arange(seq // 4, 3 * seq // 4)
        return a, b
    perm = torch.randperm(seq, generator=torch.Generator().manual_seed(seq))  # arbitrary order
    return perm[: seq // 3], perm[seq // 3 :]


@pytest.mark.parametrize("min_run", [16, 1], ids=["short-runs-general", "short-runs-as-runs"])
@pytest.mark.parametrize("kind", ["striped", "zigzag", "shuffled"])
@pytest.mark.parametrize("b,hq,hkv,d,seq,r", [(1, 4, 2, 16, 61, 7), (2, 2, 1, 32, 48, 16)])
def test_key_subsets_combine_to_the_whole(monkeypatch, chunking, min_run, kind, b, hq, hkv, d, seq, r):
    monkeypatch.setattr(estimator, "_MIN_RUN", min_run)  # 1: even runs of one key take the run path
    q, k = _qk(b, r, hq, hkv, d, seq, seed=seq + r)
    q_pos, k_all = torch.arange(seq - r, seq), torch.arange(seq)
    scale = 1.0 / math.sqrt(d)
    ref_lse, ref_v, ref_s = brute_scores(q, q_pos, k, k_all, scale, seq)
    parts = _split_keys(seq, kind)
    lse = torch.logaddexp(*[last_query_partial_lse(q, q_pos, k[:, p], p, scale) for p in parts])
    assert_close(lse, ref_lse, "combined lse")
    vertical = torch.zeros(b, hq, seq)
    slash = torch.zeros(b, hq, seq)
    for p in parts:
        part_lse, part_v, part_s = brute_scores(q, q_pos, k[:, p], p, scale, seq, row_lse=lse)
        v, s = line_scores(q, q_pos, k[:, p], p, scale, lse, seq)
        assert_close(v, part_v, f"vertical of subset ({kind})")
        assert_close(s, part_s, f"slash of subset ({kind})")
        assert_close(last_query_partial_lse(q, q_pos, k[:, p], p, scale), part_lse, "partial lse")
        vertical[..., p] = v
        slash += s
    assert_close(vertical, ref_v, "assembled vertical")
    assert_close(slash, ref_s, "summed slash")


def _layout_keys(seq: int, kind: str, world: int, run: int) -> list[torch.Tensor]:
    """Each rank's key positions: stripes of ``run`` dealt round-robin, or zigzag chunks (rank r: r, 2W-1-r).

    ``seq`` need not divide: the last stripe or chunk is then shorter.
    """
    pos = torch.arange(seq)
    if kind == "striped":
        return [pos[pos // run % world == rank] for rank in range(world)]
    return [
        torch.cat([pos[rank * run : (rank + 1) * run], pos[(2 * world - 1 - rank) * run :][:run]])
        for rank in range(world)
    ]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk_runs", [None, 2, 0], ids=["one-chunk", "two-runs-a-chunk", "half-run-chunks"])
@pytest.mark.parametrize(
    "kind,world,run,seq",
    [
        ("striped", 2, 16, 200),
        ("striped", 3, 32, 250),
        ("striped", 2, 64, 256),
        ("zigzag", 2, 51, 203),
        ("zigzag", 3, 43, 256),
    ],
)
def test_key_runs_match_brute_force(monkeypatch, kind, world, run, seq, chunk_runs, dtype):
    """Keys in runs of consecutive positions (striped/zigzag shards, short last runs): per-run diagonal sums."""
    b, hq, hkv, d, r = 2, 4, 2, 16, 24
    if chunk_runs is not None:  # chunks of two runs with their padding, or of half a run (runs cut in pieces)
        step = chunk_runs * (run + r) if chunk_runs else run // 2
        monkeypatch.setattr(estimator, "_CHUNK_ELEMENTS", b * hq * r * step)
    q, k = (t.to(dtype) for t in _qk(b, r, hq, hkv, d, seq, seed=seq + run))
    q_pos = torch.arange(seq - r, seq)
    scale = 1.0 / math.sqrt(d)
    parts = _layout_keys(seq, kind, world, run)
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))
    lse = torch.stack([last_query_partial_lse(q, q_pos, k[:, p], p, scale) for p in parts]).logsumexp(0)
    ref_lse, ref_v, ref_s = brute_scores(q, q_pos, k, torch.arange(seq), scale, seq)
    assert_close(lse, ref_lse, "combined lse")
    slash = torch.zeros(b, hq, seq, dtype=torch.float64)
    for p in parts:
        plan = PositionPlan.from_positions(q_pos, p)
        assert plan.run in (run, p.numel())  # the run path (zigzag's middle rank holds one contiguous run)
        v, s = line_scores(q, q_pos, k[:, p], p, scale, lse, seq, plan=plan)
        _, part_v, part_s = brute_scores(q, q_pos, k[:, p], p, scale, seq, row_lse=lse)
        # float64 inputs: only the float32 outputs round, so any misplaced probability would show
        tol = {"rtol": 1e-6, "atol": 1e-9} if dtype == torch.float64 else {"rtol": 2e-5, "atol": 2e-6}
        torch.testing.assert_close(v.double(), part_v, **tol, msg=f"vertical of a {kind} shard")
        torch.testing.assert_close(s.double(), part_s, **tol, msg=f"slash of a {kind} shard")
        slash += s
    torch.testing.assert_close(slash, ref_s, rtol=2e-5, atol=2e-6, msg="summed slash")


def test_position_plan_detects_runs():
    rows = torch.arange(90, 100)
    plan = PositionPlan.from_positions
    assert plan(rows, torch.arange(100)).run == 100  # one contiguous run
    assert plan(rows, torch.arange(100)) == PositionPlan.contiguous(90, 10, 0, 100)
    striped = _layout_keys(100, "striped", 2, 16)
    assert plan(rows, striped[1]).run == 16  # 16..31, 48..63, 80..95
    zigzag = _layout_keys(100, "zigzag", 2, 25)
    assert plan(rows, zigzag[0]).run == 25 and plan(rows, zigzag[1]).run == 50  # 25..74: one run
    assert plan(rows, torch.cat([torch.arange(0, 16), torch.arange(40, 60)])).run == 16  # short last run
    off_grid = torch.cat([torch.arange(0, 20), torch.arange(40, 50), torch.arange(60, 80)])
    assert plan(rows, off_grid).run == 0  # a run starts at key 30, off the grid of the first run (20)
    assert plan(rows, torch.cat([torch.arange(0, 8), torch.arange(40, 48)])).run == 0  # runs below 16 keys
    assert plan(rows, torch.arange(100).flip(0)).run == 0  # descending
    assert plan(rows.flip(0), torch.arange(100)).run == 0  # rows not ascending
    # keys after the first row: the index range a causal mask may be needed in
    assert plan(rows, torch.arange(100)).late == (91, 99)
    assert plan(rows, torch.arange(50)).late is None
    assert plan(rows, torch.tensor([95, 3, 7, 99, 4])).late == (0, 3)
    assert plan(rows, torch.arange(100)).late_keys(80, 95) == (91, 95)  # the keys a chunk's causal mask covers
    for q_lo, n_rows, k_lo, n_keys in ((90, 10, 50, 50), (40, 8, 0, 48), (0, 1, 0, 1), (60, 4, 0, 30), (7, 3, 7, 3)):
        contiguous = PositionPlan.contiguous(q_lo, n_rows, k_lo, n_keys)  # what packed documents' estimate uses
        assert plan(torch.arange(q_lo, q_lo + n_rows), torch.arange(k_lo, k_lo + n_keys)) == contiguous


@pytest.mark.parametrize(
    "run,keys,step_keys", [(16, 100, 50), (16, 100, 5), (100, 100, 30), (0, 77, 10), (16, 96, 200)]
)
def test_position_plan_chunks_cover_whole_runs(monkeypatch, run, keys, step_keys):
    rows = 8
    monkeypatch.setattr(estimator, "_CHUNK_ELEMENTS", step_keys * rows)
    plan = PositionPlan(rows, keys, 200, 207, 0, 150, run, (40, keys - 1))
    chunks = plan.chunks(rows)
    assert [a for a, *_ in chunks] == [0] + [b for _, b, *_ in chunks[:-1]] and chunks[-1][1] == keys
    for start, stop, chunk_run, partly_causal in chunks:
        assert partly_causal == (stop > 40)
        if run == 0:
            assert chunk_run == 0 and stop - start <= step_keys
            continue
        assert chunk_run > 0 and (stop - start) % chunk_run == 0
        assert start // run == (stop - 1) // run or chunk_run == run  # a piece of one run, or whole runs
        if stop - start > chunk_run:
            assert (stop - start) // chunk_run * (chunk_run + rows) <= step_keys


def test_arbitrary_query_positions_and_empty_rows(chunking):
    """Non-contiguous rows (general path) and rows that see none of these keys (-inf LSE, zero scores)."""
    b, hq, hkv, d, seq = 2, 4, 2, 16, 50
    q, _ = _qk(b, 5, hq, hkv, d, 1, seed=3)
    _, k = _qk(1, 1, 1, hkv, d, seq, seed=4)
    k = k.expand(b, -1, -1, -1)
    q_pos = torch.tensor([49, 3, 30, 10, 44])
    k_pos = torch.arange(20, 40)  # rows 3 and 10 see nothing here
    scale = 0.25
    lse = last_query_partial_lse(q, q_pos, k[:, k_pos], k_pos, scale)
    ref_lse, _, _ = brute_scores(q, q_pos, k[:, k_pos], k_pos, scale, seq)
    assert torch.isneginf(lse[..., 1]).all() and torch.isneginf(lse[..., 3]).all()
    assert_close(lse, ref_lse, "lse with empty rows")
    full_lse = last_query_partial_lse(q, q_pos, k, torch.arange(seq), scale)
    v, s = line_scores(q, q_pos, k[:, k_pos], k_pos, scale, full_lse, seq)
    _, ref_v, ref_s = brute_scores(q, q_pos, k[:, k_pos], k_pos, scale, seq, row_lse=full_lse)
    assert_close(v, ref_v, "vertical")
    assert_close(s, ref_s, "slash")
    assert torch.isfinite(v).all() and torch.isfinite(s).all()


# --------------------------------------------------------------------------- select_lines
def _random_scores(b, h, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, h, n, generator=g) ** 4, torch.rand(b, h, n, generator=g) ** 4


@pytest.mark.parametrize("threshold", [None, 0.3, 0.8, 1.0])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("sort_elements", [None, 300], ids=["all-heads", "head-by-head"])
def test_select_lines_matches_brute_force(monkeypatch, threshold, per_head, sort_elements):
    if sort_elements is not None:
        monkeypatch.setattr(estimator, "_SORT_ELEMENTS", sort_elements)
    b, h, n = 2, 4, 300
    vertical, slash = _random_scores(b, h, n, seed=7)
    if per_head:
        budgets = Budgets.from_dict({"default": {"v_size": [5, 9, 40, 7], "s_size": [30, 16, 64, 100]}})
        config = PatternConfig(block_size=16, sink_tokens=3, local_window=16, threshold=threshold, budgets=budgets)
    else:
        config = PatternConfig(v_size=20, s_size=50, block_size=32, sink_tokens=2, local_window=20, threshold=threshold)
    pattern = select_lines(vertical, slash, config, n)
    v_budget, s_budget = config.head_budgets(0, h, n)
    ref_v, ref_diag = brute_pattern(vertical, slash, v_budget, s_budget, config, n)
    assert torch.equal(pattern.vertical_mask(), ref_v)
    assert torch.equal(pattern.diag_mask(), ref_diag)
    assert pattern.seq_len == n and pattern.block_size == config.block_size
    counts = pattern.num_verticals.long()
    assert (counts <= v_budget).all() and (counts >= config.sink_tokens).all()
    if threshold is None:
        assert torch.equal(counts, v_budget.expand(b, h))


def test_threshold_keeps_the_fewest_lines():
    """One dominant line beyond the forced ones reaches the threshold: exactly forced + 1 lines."""
    n = 64
    vertical = torch.full((1, 1, n), 0.01)
    vertical[..., 40] = 10.0
    slash = torch.full((1, 1, n), 0.01)
    slash[..., 50] = 10.0
    config = PatternConfig(v_size=30, s_size=30, block_size=16, sink_tokens=2, local_window=4, threshold=0.9)
    pattern = select_lines(vertical, slash, config, n)
    assert pattern.vertical_pos[0, 0, : int(pattern.num_verticals)].tolist() == [0, 1, 40]
    # offsets 0..3 and 50 (64 tokens: 4 blocks, so 50 crosses only diagonal 3)
    assert pattern.diag_mask()[0, 0].nonzero().flatten().tolist() == [0, 1, 3]
    # reaching the threshold exactly is enough (binary fractions: no rounding)
    vertical = torch.zeros(1, 1, n)
    vertical[..., 10], vertical[..., 20], vertical[..., 30] = 0.5, 0.25, 0.25
    exact = PatternConfig(v_size=30, s_size=30, block_size=16, sink_tokens=0, local_window=4, threshold=0.5)
    assert select_lines(vertical, slash, exact, n).vertical_pos[0, 0].tolist() == [10]


def test_select_lines_is_deterministic_under_ties():
    b, h, n = 1, 3, 200
    vertical = torch.zeros(b, h, n)
    vertical[..., 100:] = 1.0  # 100 equal scores, budget 10: the lowest indices win
    slash = torch.ones(b, h, n)
    config = PatternConfig(v_size=10, s_size=40, block_size=16, sink_tokens=2, local_window=16)
    first = select_lines(vertical, slash, config, n)
    again = select_lines(vertical.clone(), slash.clone(), config, n)
    assert first.vertical_pos[0, 0].tolist() == [0, 1] + list(range(100, 108))
    assert first.diag_mask()[0, 0].nonzero().flatten().tolist() == [0, 1, 2, 3]  # offsets 0..39
    for name in ("block_diags", "num_diags", "vertical_pos", "num_verticals"):
        assert torch.equal(getattr(first, name), getattr(again, name))


# --------------------------------------------------------------------------- end to end
@pytest.mark.slow
@pytest.mark.parametrize(
    "b,hq,hkv,d,seq,threshold", [(1, 4, 2, 16, 160, None), (2, 2, 1, 32, 131, None), (1, 4, 4, 16, 200, 0.7)]
)
def test_estimate_pattern_end_to_end(chunking, b, hq, hkv, d, seq, threshold):
    g = torch.Generator().manual_seed(seq)
    q = torch.randn(b, seq, hq, d, generator=g) * 2
    k = torch.randn(b, seq, hkv, d, generator=g) * 2
    config = PatternConfig(
        v_size=24, s_size=40, last_q=16, block_size=16, sink_tokens=3, local_window=20, threshold=threshold
    )
    pattern = estimate_pattern(q, k, config, layer_idx=2)
    pos = torch.arange(seq)
    scale = 1 / math.sqrt(d)
    _, vertical, slash = brute_scores(q[:, -16:], pos[-16:], k, pos, scale, seq)
    v_budget, s_budget = config.head_budgets(2, hq, seq)
    ref_v, ref_diag = brute_pattern(vertical, slash, v_budget, s_budget, config, seq)
    assert torch.equal(pattern.vertical_mask(), ref_v)
    assert torch.equal(pattern.diag_mask(), ref_diag)
    pairs = pattern.pair_mask(pos, pos)
    causal = pos[None, :] <= pos[:, None]
    offset = pos[:, None] - pos[None, :]
    sinks = causal & (pos[None, :] < config.sink_tokens)
    window = causal & (offset < config.local_window)
    assert pairs[:, :, sinks].all() and pairs[:, :, window].all()
    assert not pairs[:, :, ~causal].any()


def test_estimate_pattern_ignores_row_order():
    """Shuffled rows with their positions give the same pattern; bf16 inputs give a valid one."""
    seq, d = 96, 16
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, seq, 4, d, generator=g) * 2
    k = torch.randn(1, seq, 2, d, generator=g) * 2
    config = PatternConfig(v_size=10, s_size=24, last_q=8, block_size=16, sink_tokens=1, local_window=8)
    plain = estimate_pattern(q, k, config)
    perm_q = torch.randperm(seq, generator=g)
    perm_k = torch.randperm(seq, generator=g)
    shuffled = estimate_pattern(q[:, perm_q], k[:, perm_k], config, q_pos=perm_q, k_pos=perm_k)
    assert torch.equal(plain.vertical_mask(), shuffled.vertical_mask())
    assert torch.equal(plain.diag_mask(), shuffled.diag_mask())
    half = estimate_pattern(q.bfloat16(), k.bfloat16(), config)
    assert (half.num_verticals == 10).all() and half.vertical_mask()[..., 0].all()


def test_estimate_pattern_with_keys_in_layout_order():
    """Keys given in striped or zigzag order (runs of consecutive positions) give the plain pattern."""
    seq, d = 256, 16
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, seq, 4, d, generator=g) * 2
    k = torch.randn(2, seq, 2, d, generator=g) * 2
    config = PatternConfig(v_size=12, s_size=40, last_q=24, block_size=16, sink_tokens=2, local_window=16)
    plain = estimate_pattern(q, k, config)
    for kind, run in (("striped", 16), ("zigzag", 32)):
        order = torch.cat(_layout_keys(seq, kind, 4, run))
        assert estimator.PositionPlan.from_positions(torch.arange(seq - 24, seq), order).run == run
        ordered = estimate_pattern(q, k[:, order], config, k_pos=order)
        for name in ("block_diags", "num_diags", "vertical_pos", "num_verticals"):
            assert torch.equal(getattr(ordered, name), getattr(plain, name)), (kind, name)


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"v_size": 0}, "v_size must be >= 1"),
        ({"s_size": -3}, "s_size must be >= 1"),
        ({"last_q": 0}, "last_q must be >= 1"),
        ({"v_size": 2.5}, "v_size must be an int"),
        ({"local_window": 0}, "local_window must be >= 1"),
        ({"sink_tokens": -1}, "sink_tokens must be >= 0"),
        ({"block_size": 48}, "power of two >= 16"),
        ({"block_size": 8}, "power of two >= 16"),
        ({"threshold": 0.0}, r"threshold must be None or a fraction in \(0, 1\]"),
        ({"threshold": 1.5}, r"threshold must be None or a fraction in \(0, 1\]"),
        ({"threshold": "0.9"}, "threshold must be None or a fraction"),
        ({"v_size": 3, "sink_tokens": 4}, "sink_tokens .4. exceeds the smallest vertical budget .3."),
        ({"s_size": 64, "local_window": 128}, "local_window .128. exceeds the smallest slash budget .64."),
        ({"budgets": {"default": {}}}, "budgets must be a Budgets"),
        (
            {"v_size": 2048, "budgets": Budgets.from_dict({"default": {"v_size": 8, "s_size": 256}})},
            "either v_size/s_size or budgets",
        ),
        (
            {"budgets": Budgets.from_dict({"default": {"v_size": [8, 2], "s_size": 256}}, source="b.yaml")},
            r"sink_tokens \(4\) exceeds the smallest vertical budget \(2 in b.yaml\)",
        ),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PatternConfig(**kwargs)


def test_budget_larger_than_sequence():
    config = PatternConfig(v_size=64, s_size=256, block_size=16)
    with pytest.raises(ValueError, match="v_size 64 .layer 3, head 0. exceeds the sequence length 50"):
        config.head_budgets(3, 2, 50)
    with pytest.raises(ValueError, match="s_size 256 .layer 0, head 0. exceeds the sequence length 200"):
        config.head_budgets(0, 2, 200)
    per_head = PatternConfig(block_size=16, budgets=Budgets.from_dict({"default": {"v_size": [8, 99], "s_size": 128}}))
    with pytest.raises(ValueError, match="v_size 99 .layer 0, head 1. exceeds the sequence length 90"):
        per_head.head_budgets(0, 2, 90)
    q = torch.randn(1, 100, 2, 16)
    with pytest.raises(ValueError, match="s_size 256 .layer 0, head 0. exceeds the sequence length 100"):
        estimate_pattern(q, q, config)
    with pytest.raises(ValueError, match="layer_idx must be >= 0"):
        config.head_budgets(-1, 2, 500)


def test_estimate_pattern_errors():
    config = PatternConfig(v_size=8, s_size=16, last_q=16, block_size=16, local_window=8)
    q = torch.randn(1, 32, 4, 16)
    k = torch.randn(1, 32, 2, 16)
    with pytest.raises(ValueError, match=r"last_q \(16\) exceeds the 8 query rows"):
        estimate_pattern(q[:, :8], k, config)
    with pytest.raises(ValueError, match="4 dims"):
        estimate_pattern(q[0], k, config)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        estimate_pattern(torch.randn(1, 32, 3, 16), k, config)
    with pytest.raises(ValueError, match="config must be a PatternConfig"):
        estimate_pattern(q, k, {"v_size": 8})
    with pytest.raises(ValueError, match="k_pos must hold each position 0..31 once"):
        estimate_pattern(q, k, config, q_pos=torch.arange(32), k_pos=torch.arange(32) * 2)


def test_line_function_errors():
    q = torch.randn(1, 4, 2, 16)
    k = torch.randn(1, 10, 2, 16)
    qp, kp = torch.arange(6, 10), torch.arange(10)
    lse = last_query_partial_lse(q, qp, k, kp, 0.25)
    with pytest.raises(ValueError, match="row_lse must be a float tensor"):
        line_scores(q, qp, k, kp, 0.25, lse[..., :2], 10)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, seq_len=8\)"):
        line_scores(q, qp, k, kp, 0.25, lse, 8)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, seq_len=10\)"):
        line_scores(q, qp, k, kp - 1, 0.25, lse, 10)
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        line_scores(q, qp, k, kp, 0.25, lse, 0)
    with pytest.raises(ValueError, match="q_last_pos and k_pos are required"):
        last_query_partial_lse(q, None, k, kp, 0.25)
    with pytest.raises(ValueError, match="need at least one row and one key"):
        last_query_partial_lse(q, qp, k[:, :0], kp[:0], 0.25)
    with pytest.raises(ValueError, match="k_pos must be 1-D with 10 entries"):
        last_query_partial_lse(q, qp, k, kp[:5], 0.25)


def test_select_lines_errors():
    config = PatternConfig(v_size=8, s_size=16, block_size=16, local_window=8)
    good = torch.rand(1, 2, 40)
    with pytest.raises(ValueError, match=r"vertical_scores must be a float tensor \[B, Hq, seq_len=50\]"):
        select_lines(good, good, config, 50)
    with pytest.raises(ValueError, match="slash_scores must be a float tensor"):
        select_lines(good, good[0], config, 40)
    with pytest.raises(ValueError, match="same shape|one shape"):
        select_lines(good, torch.rand(1, 3, 40), config, 40)
    bad = good.clone()
    bad[0, 1, 5] = float("nan")
    with pytest.raises(ValueError, match="negative, NaN or infinite"):
        select_lines(bad, good, config, 40)
    with pytest.raises(ValueError, match="negative, NaN or infinite"):
        select_lines(good, -good, config, 40)
    with pytest.raises(ValueError, match="config must be a PatternConfig"):
        select_lines(good, good, None, 40)
    with pytest.raises(ValueError, match="s_size 16 .layer 0, head 0. exceeds the sequence length 12"):
        select_lines(good[..., :12], good[..., :12], config, 12)


def test_from_lines_round_trip_of_selection():
    """select_lines output equals building the pattern from the same lines by hand."""
    vertical, slash = _random_scores(1, 2, 128, seed=11)
    config = PatternConfig(v_size=6, s_size=20, block_size=32, sink_tokens=1, local_window=4)
    pattern = select_lines(vertical, slash, config, 128)
    v_top = torch.topk(torch.cat([torch.full((1, 2, 1), 9.0), vertical[..., 1:]], -1), 6).indices
    s_top = torch.topk(torch.cat([torch.full((1, 2, 4), 9.0), slash[..., 4:]], -1), 20).indices
    expected = VerticalSlashPattern.from_lines(v_top, s_top, 128, 32)
    assert torch.equal(pattern.vertical_mask(), expected.vertical_mask())
    assert torch.equal(pattern.diag_mask(), expected.diag_mask())


@pytest.mark.parametrize("seq,g", [(128, 32), (100, 16), (75, 64)])
def test_from_lines_matches_masks(seq, g):
    """Lines with padding, offsets on block edges and a short last block give the masks' pattern."""
    gen = torch.Generator().manual_seed(seq)
    b, h, v, s = 2, 3, 9, 12
    verts = torch.stack([torch.randperm(seq, generator=gen)[:v] for _ in range(b * h)]).view(b, h, v)
    slashes = torch.randint(0, seq, (b, h, s), generator=gen)
    slashes[0, 0, :4] = torch.tensor([0, g, (seq - 1) // g * g, seq - 1])
    slashes[1, 2, 3] = slashes[1, 2, 4]  # a repeated slash is fine
    verts[0, 1, 5:] = -1  # padding
    slashes[1, 0, 2:] = -1
    pattern = VerticalSlashPattern.from_lines(verts, slashes, seq, g)
    num_blocks = -(-seq // g)
    vmask = torch.zeros(b, h, seq + 1, dtype=torch.bool).scatter_(-1, verts.where(verts >= 0, seq), True)[..., :seq]
    diag = torch.zeros(b, h, num_blocks, dtype=torch.bool)
    for bi, hi, si in (slashes >= 0).nonzero().tolist():
        d = int(slashes[bi, hi, si])
        diag[bi, hi, d // g] = True
        if d % g and d // g + 1 < num_blocks:
            diag[bi, hi, d // g + 1] = True
    expected = VerticalSlashPattern.from_masks(diag, vmask, g)
    for name in ("block_diags", "num_diags", "vertical_pos", "num_verticals"):
        assert torch.equal(getattr(pattern, name), getattr(expected, name)), name
        assert getattr(pattern, name).is_contiguous()


def test_from_lines_errors():
    verts, slashes = torch.tensor([[[3, 7, 3]]]), torch.tensor([[[0, 5]]])
    with pytest.raises(ValueError, match="repeats a position"):
        VerticalSlashPattern.from_lines(verts, slashes, 64, 16)
    with pytest.raises(ValueError, match=r"must be < seq_len \(64\)"):
        VerticalSlashPattern.from_lines(torch.tensor([[[3, 64]]]), slashes, 64, 16)
    with pytest.raises(ValueError, match=r"must be < seq_len \(64\)"):
        VerticalSlashPattern.from_lines(torch.tensor([[[3]]]), torch.tensor([[[70]]]), 64, 16)

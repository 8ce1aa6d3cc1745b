"""experiments/extension/local_verticals.py: the masked reference attention equals a float64 oracle, and each block's extra
columns are the keys before it that rank highest by its pooled query or its exact mass, skipping the pattern's."""

from __future__ import annotations

import pytest
import torch

from experiments.extension import local_verticals as lv

pytestmark = pytest.mark.slow


def _inputs(s: int = 150, h: int = 2, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, s, h, d, generator=g) for _ in range(3)]


def test_masked_attention_matches_a_float64_oracle():
    q, k, v = _inputs()
    s = q.shape[1]
    keep = torch.rand(1, 2, s, s, generator=torch.Generator().manual_seed(1)) < 0.3
    keep |= torch.eye(s, dtype=torch.bool)  # every row keeps at least its own key
    keep &= torch.ones(s, s, dtype=torch.bool).tril()
    out, lse = lv.masked_attention(q, k, v, keep, 0.3)
    logits = torch.einsum("bshd,bthd->bhst", q.double(), k.double()) * 0.3
    logits = logits.masked_fill(~keep, float("-inf"))
    want_lse = logits.logsumexp(-1)
    want = torch.einsum("bhst,bthd->bshd", (logits - want_lse[..., None]).exp(), v.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("how", ["pooled", "rows4", "exact"])
def test_each_block_takes_its_top_keys_before_it_that_the_pattern_lacks(how):
    q, k, _ = _inputs()
    s, per_block, scale = q.shape[1], 5, 0.5
    pos = torch.arange(s)
    causal = pos[None, :] <= pos[:, None]
    kept = torch.zeros(1, 2, s, s, dtype=torch.bool)
    kept[..., :4] = True  # sinks
    kept &= causal
    extra = lv.block_columns(q, k, kept, scale, per_block, how)
    qd, kd = q.double()[0].transpose(0, 1), k.double()[0].transpose(0, 1)  # [H, S, D]
    for head in range(2):
        for start in range(0, s, lv.BLOCK):
            rows = slice(start, min(start + lv.BLOCK, s))
            if how == "pooled":
                score = qd[head, rows].mean(0) @ kd[head].T
            else:
                logits = (qd[head, rows] @ kd[head].T * scale).masked_fill(~causal[rows], float("-inf"))
                probs = logits.softmax(-1)
                if how == "rows4":
                    probs = probs[pos[rows] % 4 == 3]
                score = probs.sum(0)
            candidates = [j for j in range(4, start)]  # before the block, not a sink
            want = set(sorted(candidates, key=lambda j: -float(score[j]))[:per_block])
            for r in range(rows.start, rows.stop):
                got = set(torch.nonzero(extra[0, head, r]).flatten().tolist())
                assert got == want, (head, start, r)


def _block_logits(q, keys, how: str):
    """[rows, key blocks] logits of rows q [R, D] against key blocks keys [nb, BLOCK or fewer, D], plainly."""
    if how.startswith("keyblocks"):
        return torch.stack([q @ block.mean(0) for block in keys], -1)
    return torch.stack([torch.maximum(q * block.amax(0), q * block.amin(0)).sum(-1) for block in keys], -1)


@pytest.mark.parametrize("how", ["keyblocks", "bounds", "keyblocksmax", "boundsmax"])
def test_key_block_scores_take_the_whole_key_block_that_the_rows_vote_for(how):
    q, k, _ = _inputs(s=3 * lv.BLOCK + 10)
    s, scale = q.shape[1], 0.5
    extra = lv.block_columns(q, k, torch.zeros(1, 2, s, s, dtype=torch.bool), scale, lv.BLOCK, how)
    qd, kd = q.double()[0].transpose(0, 1), k.double()[0].transpose(0, 1)
    for head in range(2):
        key_blocks = [kd[head, j : j + lv.BLOCK] for j in range(0, s, lv.BLOCK)]
        for block in (1, 2, 3):
            rows = slice(block * lv.BLOCK, min((block + 1) * lv.BLOCK, s))
            logits = _block_logits(qd[head, rows], key_blocks[:block], how)
            if how.startswith("bounds"):  # an upper bound of every score in its block
                exact = torch.stack([(qd[head, rows] @ kb.T).amax(-1) for kb in key_blocks[:block]], -1)
                assert (logits >= exact - 1e-9).all()
            probs = (logits * scale).softmax(-1)
            votes = probs.amax(0) if how.endswith("max") else probs.sum(0)
            best = int(votes.argmax())
            want = set(range(best * lv.BLOCK, (best + 1) * lv.BLOCK))
            for r in range(rows.start, rows.stop):
                assert set(torch.nonzero(extra[0, head, r]).flatten().tolist()) == want, (head, block, r)
        assert not extra[0, head, : lv.BLOCK].any()  # the first block has nothing before it


def test_without_extra_columns_the_stand_in_is_the_librarys_sparse_attention():
    from mtraining.ops.pattern import VerticalSlashPattern
    from mtraining.ops.sparse.attention import sparse_attention

    g = torch.Generator().manual_seed(2)
    s, d = 192, 16
    q = torch.randn(1, s, 4, d, generator=g)  # 4 query heads over 2 KV heads
    k, v = (torch.randn(1, s, 2, d, generator=g) for _ in range(2))
    verticals = torch.stack([torch.randperm(s, generator=g)[:12] for _ in range(4)])[None]
    slashes = torch.tensor([[[0, 1, 70], [0, 5, 130], [0, 2, -1], [0, 64, 100]]])
    pattern = VerticalSlashPattern.from_lines(verticals, slashes, s, 32)
    stand_in = lv.LocalColumns(0, "pooled", sparse_attention)
    out, lse = stand_in(q, k, v, pattern, softmax_scale=0.25, return_lse=True)
    want, want_lse = sparse_attention(q, k, v, pattern, softmax_scale=0.25, return_lse=True, backend="torch")
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    assert 0 < stand_in.density < 1


def test_a_vector_shares_a_bucket_with_itself_and_never_with_its_negation():
    x = torch.randn(1, 2, 40, 8, generator=torch.Generator().manual_seed(3))
    same = lv.same_bucket(x, torch.cat([x, -x], 2))  # [1, 2, 40, 80]
    assert same[..., :40].diagonal(dim1=-2, dim2=-1).all()
    assert not same[..., 40:].diagonal(dim1=-2, dim2=-1).any()


def test_lsh_ranks_bucket_mates_by_their_mass_against_the_patterns():
    q, k, _ = _inputs()
    s, per_block, scale = q.shape[1], 5, 0.5
    pos = torch.arange(s)
    causal = pos[None, :] <= pos[:, None]
    kept = (torch.zeros(1, 2, s, s, dtype=torch.bool) | (pos[None, :] < 4) | (pos[:, None] - pos[None, :] < 8)) & causal
    extra = lv.block_columns(q, k, kept, scale, per_block, "lsh")
    qh, kh = q.transpose(1, 2), k.transpose(1, 2)
    mates = lv.same_bucket(qh, kh)[0]
    qd, kd = qh.double()[0], kh.double()[0]
    for head in range(2):
        logits = (qd[head] @ kd[head].T * scale).masked_fill(~causal, float("-inf"))
        lse = logits.masked_fill(~kept[0, head], float("-inf")).logsumexp(-1, keepdim=True)
        mass = (logits - lse).exp() * mates[head]
        for start in range(lv.BLOCK, s, lv.BLOCK):
            rows = slice(start, min(start + lv.BLOCK, s))
            score = mass[rows].sum(0)
            free = [j for j in range(start) if not kept[0, head, rows.stop - 1, j] and score[j] > 0]
            want = set(sorted(free, key=lambda j: -float(score[j]))[:per_block])
            got = set(torch.nonzero(extra[0, head, rows.start]).flatten().tolist())
            assert got == want, (head, start)

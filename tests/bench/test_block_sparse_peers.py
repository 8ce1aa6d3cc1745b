"""bench/block_sparse_peers.py: a vertical-slash pattern rounded up to blocks, and the BlockMask of those blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.bench.scripts import load_script
from tests.factories import make_pattern


def _pairs_per_block(pairs: torch.Tensor, block: int) -> torch.Tensor:
    """[B, H, n, n] pairs -> [B, H, nb, nb]: does the block hold a pair."""
    b, h, n, _ = pairs.shape
    nb = -(-n // block)
    padded = F.pad(pairs, (0, nb * block - n, 0, nb * block - n))
    return padded.view(b, h, nb, block, nb, block).any(-1).any(-2)


@pytest.mark.parametrize("seq_len,seed", [(96, 0), (100, 1), (128, 2), (77, 3)])
def test_a_block_is_kept_iff_the_pattern_has_a_pair_in_it(seq_len, seed):
    peers = load_script("block_sparse_peers")
    pattern = make_pattern("random", 1, 3, seq_len, 16, seed)
    pos = torch.arange(seq_len)
    expected = _pairs_per_block(pattern.pair_mask(pos, pos), 16)
    assert expected.any() and not expected.all()
    assert torch.equal(peers.block_mask(pattern), expected)


@pytest.mark.parametrize("seq_len,seed", [(96, 0), (100, 1), (77, 3)])
def test_rounded_pattern_keeps_exactly_the_causal_pairs_of_the_kept_blocks(seq_len, seed):
    peers = load_script("block_sparse_peers")
    pattern = make_pattern("random", 1, 3, seq_len, 16, seed)
    rounded = peers.rounded_pattern(pattern)
    pos = torch.arange(seq_len)
    kept = peers.block_mask(pattern)
    blocks = kept.repeat_interleave(16, -1).repeat_interleave(16, -2)[..., :seq_len, :seq_len]
    causal = pos[None, :] <= pos[:, None]
    assert torch.equal(rounded.pair_mask(pos, pos), blocks & causal)
    assert torch.equal(peers.block_mask(rounded), kept)
    assert bool((rounded.density() > pattern.density()).all())


def test_flex_block_mask_lists_the_kept_blocks_both_ways():
    peers = load_script("block_sparse_peers")
    pattern = make_pattern("random", 1, 3, 100, 16, 4)
    kept = peers.block_mask(pattern)
    mask = peers.flex_block_mask(kept, 100, 16)
    assert torch.equal(mask.to_dense().bool(), kept)

    def dense(num: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        real = torch.arange(idx.shape[-1]) < num[..., None]
        out = torch.zeros(*idx.shape[:-1], idx.shape[-1] + 1, dtype=torch.bool)
        return out.scatter_(-1, torch.where(real, idx.long(), idx.shape[-1]), True)[..., :-1]

    diagonal = torch.eye(kept.shape[-1], dtype=torch.bool)
    assert torch.equal(dense(mask.kv_num_blocks, mask.kv_indices), kept & diagonal)
    assert torch.equal(dense(mask.full_kv_num_blocks, mask.full_kv_indices), kept & ~diagonal)
    # the backward's q-direction lists (what FA4's backward reads) are the transpose
    q_lists = dense(mask.q_num_blocks, mask.q_indices) | dense(mask.full_q_num_blocks, mask.full_q_indices)
    assert torch.equal(q_lists, kept.transpose(-1, -2))

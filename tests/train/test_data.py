"""Data: reading and tokenising local files, packing into samples, sharding into every CP layout."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mtraining.parallel.layout import make_layout
from mtraining.train.data import TextTokenizer, token_stream
from mtraining.train.packing import PackedSamples, shard_batch

DATA = Path(__file__).resolve().parents[2] / "data"


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer(DATA / "tokenizer.json")


def test_text_files_are_tokenised_and_joined_with_the_separator(tmp_path, tokenizer):
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"body": "Ada keeps the red lamp."}) + "\n\n" + json.dumps({"body": "Who?"}) + "\n"
    )
    (tmp_path / "b.txt").write_text("In the old mill.")
    np.save(tmp_path / "c.npy", np.array([7, 8, 9], dtype=np.uint16))
    np.array([5, 6], dtype=np.uint32).tofile(tmp_path / "d.bin")
    stream = token_stream(
        [str(tmp_path / "*.jsonl"), str(tmp_path / "b.txt"), str(tmp_path / "[cd].*")], tokenizer, "body"
    )
    eos = tokenizer.separator_id(None)
    assert eos == tokenizer.token_id("<|endoftext|>")
    docs = np.split(stream[:-5], np.flatnonzero(stream[:-5] == eos) + 1)[:-1]
    assert [tokenizer.decode(d[:-1].tolist()) for d in docs] == ["Ada keeps the red lamp.", "Who?", "In the old mill."]
    assert stream[-5:].tolist() == [7, 8, 9, 5, 6] and stream.dtype == np.int64


def test_data_errors_name_the_fix(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="matches no file"):
        token_stream([str(tmp_path / "none*.jsonl")], tokenizer)
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(ValueError, match="unsupported file type"):
        token_stream([str(tmp_path / "x.csv")], tokenizer)
    (tmp_path / "y.jsonl").write_text(json.dumps({"content": "a"}) + "\n")
    with pytest.raises(ValueError, match="set data.text_field"):
        token_stream([str(tmp_path / "y.jsonl")], tokenizer)
    with pytest.raises(ValueError, match="set data.tokenizer"):
        token_stream([str(tmp_path / "y.jsonl")], None)
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tokenizer.separator_id("<nope>")
    with pytest.raises(ValueError, match="lower data.seq_len"):
        PackedSamples(np.arange(10), seq_len=16)


def test_parquet_documents(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["one two", "three"]}), tmp_path / "t.parquet")
    stream = token_stream([str(tmp_path / "t.parquet")], tokenizer)
    assert (stream == tokenizer.separator_id(None)).sum() == 2


def test_packing_predicts_every_token_once_and_orders_deterministically():
    stream = np.arange(1000)
    packed = PackedSamples(stream, seq_len=64, seed=3)
    assert packed.num_samples == (1000 - 1) // 64
    s = packed.sample(2)
    assert s.tolist() == list(range(128, 193))  # inputs s[:-1], labels s[1:]
    labels = np.concatenate([packed.sample(i)[1:] for i in range(packed.num_samples)])
    assert labels.tolist() == list(range(1, packed.num_samples * 64 + 1))
    # A step's dp ranks draw disjoint samples; every epoch visits each sample once, reshuffled.
    n = packed.num_samples
    epoch0 = [packed.global_sample(k) for k in range(n)]
    epoch1 = [packed.global_sample(k) for k in range(n, 2 * n)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(n)) and epoch0 != epoch1
    a, b = packed.batch(1, 0, 2, 2), packed.batch(1, 1, 2, 2)
    assert a.shape == (2, 65) and not set(a[:, 0].tolist()) & set(b[:, 0].tolist())
    assert torch.equal(PackedSamples(stream, 64, seed=3).batch(1, 1, 2, 2), b)
    assert [PackedSamples(stream, 64, shuffle=False).global_sample(k) for k in range(3)] == [0, 1, 2]


@pytest.mark.parametrize("name", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_shards_round_trip_in_every_layout(name, world_size):
    layout = make_layout(name, 256, world_size, 16)
    samples = torch.randint(0, 100, (3, 257))
    shards = [shard_batch(samples, layout, r) for r in range(world_size)]
    assert torch.equal(layout.gather([s.input_ids for s in shards]), samples[:, :-1])
    assert torch.equal(layout.gather([s.labels for s in shards]), samples[:, 1:])
    for r, s in enumerate(shards):
        assert torch.equal(s.position_ids[0], layout.positions(r))
        # each label is the token that follows its input in the global sequence
        assert torch.equal(s.labels, samples[:, s.position_ids[0] + 1])
    with pytest.raises(ValueError, match="seq_len \\+ 1"):
        shard_batch(samples[:, :-1], layout, 0)

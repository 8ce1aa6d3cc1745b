"""Training data: sources from a config, packing, weighted deterministic order, sharding, memory at scale."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mtraining.data.tokenizer import TextTokenizer, Tokenizer
from mtraining.models import build_config
from mtraining.parallel.layout import make_layout
from mtraining.train.config import parse_config
from mtraining.train.data import load_sources, open_sources
from mtraining.train.launch import run_local
from mtraining.train.packing import PackedSamples, SampleOrder, first_draw, shard_batch

DATA = Path(__file__).resolve().parents[2] / "data"


def _config(tmp_path: Path, sources: list, **data) -> object:
    raw = {
        "model": {"config": {"model_type": "qwen2", "vocab_size": 512}},
        "data": {"sources": sources, "seq_len": 16, "cache_dir": str(tmp_path / "cache"), **data},
        "train": {"steps": 1},
        "attention": {"sparse": False, "block_size": 16},
    }
    return parse_config(raw)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return TextTokenizer(DATA / "tokenizer.json")


def test_sources_join_text_and_token_files_with_the_separator(tmp_path, tokenizer):
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"body": "Ada keeps the red lamp."}) + "\n\n" + json.dumps({"body": "Who?"}) + "\n"
    )
    (tmp_path / "b.txt").write_text("In the old mill.")
    np.save(tmp_path / "c.npy", np.array([7, 8, 9], dtype=np.uint16))
    np.array([5, 6], dtype=np.uint32).tofile(tmp_path / "d.bin")
    cfg = _config(
        tmp_path,
        [{"path": str(tmp_path / "*.jsonl"), "text_field": "body"}, str(tmp_path / "b.txt"), str(tmp_path / "[cd].*")],
        tokenizer=str(DATA / "tokenizer.json"),
    )
    sources = load_sources(cfg, tokenize=True, log=lambda _: None)
    assert [s.files for s in sources] == [1, 1, 2]
    eos = tokenizer.separator_id(None)
    text = np.concatenate([s.stream.read(0, len(s.stream)) for s in sources[:2]])
    docs = np.split(text, np.flatnonzero(text == eos) + 1)[:-1]
    assert [tokenizer.decode(d[:-1].tolist()) for d in docs] == ["Ada keeps the red lamp.", "Who?", "In the old mill."]
    assert sources[2].stream.read(0, 5).tolist() == [7, 8, 9, 5, 6] and sources[2].max_id == 9
    assert sources[0].max_id == max(text[: len(sources[0].stream)])
    # the ranks load what the cache holds; a text file missing from it is an error, not a silent re-tokenisation
    again = load_sources(cfg, tokenize=False)
    assert [len(s.stream) for s in again] == [len(s.stream) for s in sources]
    (tmp_path / "b.txt").write_text("Changed.")
    with pytest.raises(ValueError, match="is not in the token cache"):
        load_sources(cfg, tokenize=False)


def test_data_errors_name_the_fix(tmp_path):
    (tmp_path / "y.jsonl").write_text(json.dumps({"content": "a"}) + "\n")
    with pytest.raises(ValueError, match="set data.tokenizer"):
        load_sources(_config(tmp_path, [str(tmp_path / "y.jsonl")]), tokenize=True)
    tok = str(DATA / "tokenizer.json")
    with pytest.raises(ValueError, match=r"y\.jsonl:1 has no field 'text'"):
        load_sources(_config(tmp_path, [str(tmp_path / "y.jsonl")], tokenizer=tok), tokenize=True, log=print)
    with pytest.raises(ValueError, match="not in the vocabulary"):
        load_sources(_config(tmp_path, [str(tmp_path / "y.jsonl")], tokenizer=tok, separator="<nope>"), tokenize=True)
    with pytest.raises(ValueError, match="give every source a weight or none"):
        _config(tmp_path, [{"path": "a", "weight": 1.0}, "b"])
    with pytest.raises(ValueError, match="lower data.seq_len"):
        PackedSamples(np.arange(10), seq_len=16)


def test_ids_beyond_the_vocabulary_name_the_file_and_the_token_type(tmp_path):
    """uint16 ids read as uint32 pair up into ids above 65535: refused, naming the file and data.token_dtype
    (as for ids of another tokenizer)."""
    from mtraining.train.check import check_model

    np.random.default_rng(0).integers(1, 512, 100).astype(np.uint16).tofile(tmp_path / "ids.bin")
    np.save(tmp_path / "fine.npy", np.arange(10, dtype=np.uint16))
    cfg = _config(tmp_path, [str(tmp_path / "fine.npy"), str(tmp_path / "ids.bin")])
    sources = load_sources(cfg, tokenize=True)
    assert sources[0].max_id == 9 and sources[1].max_id > 65535
    with pytest.raises(ValueError, match=r"ids\.bin holds token id \d+ but the model's vocab_size is 512; .*uint16 ids "
                       "read as uint32 pair up .*set data.token_dtype to that type"):  # fmt: skip
        check_model(cfg, build_config(config=cfg.model.config), sources)
    right = _config(tmp_path, [str(tmp_path / "ids.bin")], token_dtype="uint16")
    check_model(right, build_config(config=cfg.model.config), load_sources(right, tokenize=True))


def test_a_token_file_that_cannot_be_written_is_a_save_failure(tmp_path):
    """`mtraining tokenize CONFIG OUT` into a folder that cannot be made: exit 5's error, not a traceback, and
    an earlier OUT is replaced whole or not at all."""
    from mtraining.train.data import write_token_file
    from mtraining.train.errors import SaveFailed

    np.save(tmp_path / "c.npy", np.array([7, 8, 9], dtype=np.uint16))
    sources = load_sources(_config(tmp_path, [str(tmp_path / "c.npy")]), tokenize=True)
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(
        SaveFailed, match=r"writing the token file .*file/out\.npy failed: File exists .*; choose another folder"
    ):
        write_token_file(sources, tmp_path / "file" / "out.npy")
    out = tmp_path / "out.npy"
    assert write_token_file(sources, out) == np.uint16 and np.load(out).tolist() == [7, 8, 9]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npy", "file", "out.npy"]  # no temporary file left


def test_packing_predicts_every_token_once_and_orders_deterministically():
    stream = np.arange(1000)
    packed = PackedSamples(stream, seq_len=64, seed=3)
    n = packed.sources[0].num_samples
    assert n == (1000 - 1) // 64
    assert packed.sources[0].sample(2).tolist() == list(range(128, 193))  # inputs s[:-1], labels s[1:]
    labels = np.concatenate([packed.sources[0].sample(i)[1:] for i in range(n)])
    assert labels.tolist() == list(range(1, n * 64 + 1))
    # every epoch visits each sample once, reshuffled; the draw is a pure function of its index and the seed
    epoch0 = [packed.order.draw(k)[1] for k in range(n)]
    epoch1 = [packed.order.draw(k)[1] for k in range(n, 2 * n)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(n)) and epoch0 != epoch1
    fresh = PackedSamples(stream, seq_len=64, seed=3)
    assert [fresh.order.draw(k) for k in (2 * n - 1, 5, 0)] == [packed.order.draw(k) for k in (2 * n - 1, 5, 0)]
    assert [PackedSamples(stream, 64, shuffle=False).order.draw(k)[1] for k in range(3)] == [0, 1, 2]
    # a step's data-parallel ranks draw disjoint samples; micro-batches follow the step's draws
    a = packed.batch(first_draw(1, 0, 1, 0, 2, 2), 2)
    b = packed.batch(first_draw(1, 0, 1, 1, 2, 2), 2)
    assert a.shape == (2, 65) and not set(a[:, 0].tolist()) & set(b[:, 0].tolist())
    assert [first_draw(1, m, 4, 0, 1, 1) for m in range(4)] == [first_draw(1, 0, 1, 0, 1, 4) + m for m in range(4)]


def test_weighted_sources_are_drawn_in_proportion_and_each_epoch_covers_a_source():
    sizes = [50, 7, 1000]
    order = SampleOrder(sizes, [0.5, 0.25, 0.25], seed=1)
    draws = [order.draw(k) for k in range(3 * order.block)]
    for source, share in enumerate((0.5, 0.25, 0.25)):
        picked = [i for s, i in draws if s == source]
        assert len(picked) == round(3 * order.block * share)  # exact per block
        first_epoch = picked[: sizes[source]]
        assert sorted(first_epoch) == list(range(sizes[source]))
    # without weights, in proportion to the number of samples; a tiny source still gets drawn
    natural = SampleOrder([1, 100_000], None, seed=0)
    assert natural.block > 4096 and natural.counts[0] >= 1 and 0 < natural.shares[0] < 2e-5
    # unshuffled mixing interleaves evenly
    plain = SampleOrder([10, 10], [0.5, 0.5], seed=0, shuffle=False)
    assert [plain.draw(k) for k in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]


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


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _read_batches(cfg, steps: int) -> dict:
    """On a rank: open the sources (rank 0 scans the token file once, the other waits) and read batches."""
    import torch.distributed as dist

    before = _rss_mb()
    sources = open_sources(cfg, log=lambda _: None)
    data = PackedSamples([s.stream for s in sources], cfg.data.seq_len, seed=0)
    rank, world = dist.get_rank(), dist.get_world_size()
    checksum = 0
    for step in range(steps):
        batch = data.batch(first_draw(step, 0, 1, rank, world, cfg.data.batch_size), cfg.data.batch_size)
        checksum += int(batch.sum())
    return {"growth_mb": _rss_mb() - before, "tokens": len(sources[0].stream), "checksum": checksum}


def test_a_multi_gigabyte_token_file_stays_on_disk(tmp_path):
    """1 G tokens (2 GiB of uint16, written sparse: only a few pages hold data): each of 2 ranks opens the
    source (rank 0 scans it once for its largest id) and reads 20 batches of two 64K-token samples; its
    resident memory grows by less than 200 MB (the int64 copy of the stream the trainer once made: 8 GiB)."""
    tokens = 1 << 30
    path = tmp_path / "big.npy"
    big = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint16, shape=(tokens,))
    big[:: 1 << 22] = np.arange(len(big[:: 1 << 22])) % 500  # touches one page in every 8 MB
    del big
    cfg = _config(tmp_path, [str(path)], seq_len=65536, batch_size=2)  # blocks of 16 divide it
    results = run_local(_read_batches, 2, cfg, 20)
    for r in results:
        assert r["tokens"] == tokens
        assert r["growth_mb"] < 200, r
    print(f"RSS growth per rank (MB): {[round(r['growth_mb'], 1) for r in results]}")


@pytest.mark.parametrize("name", ["contiguous", "zigzag", "striped"])
def test_documents_from_separators_sharded_with_the_layout(name):
    """A document ends after every separator; a sample starts one at 0; the boundaries are global and the
    same on every rank; reset position ids count from each token's document start."""
    sep, n, world = 7, 64, 4
    layout = make_layout(name, n, world, 8)
    samples = torch.randint(8, 100, (2, n + 1))
    samples[0, [5, 6, 40, n - 1, n]] = sep  # two separators in a row: a one-token document; the last input
    samples[1, [20]] = sep
    shards = [shard_batch(samples, layout, r, separator=sep, reset_position_ids=True) for r in range(world)]
    docs = shards[0].documents
    assert docs.starts[0].tolist() == [0, 6, 7, 41] and docs.starts[1].tolist() == [0, 21]
    assert all(s.documents.digest() == docs.digest() for s in shards)
    position_ids = layout.gather([s.position_ids for s in shards])
    starts = docs.left_bounds(torch.arange(n))
    assert torch.equal(position_ids, torch.arange(n) - starts)
    assert position_ids[0, :8].tolist() == [0, 1, 2, 3, 4, 5, 0, 0]
    plain = shard_batch(samples, layout, 0, separator=sep)
    assert torch.equal(plain.position_ids[0], layout.positions(0)) and plain.documents.digest() == docs.digest()
    assert shard_batch(samples, layout, 0).documents is None
    same = samples.clone()
    same[1] = same[0]
    assert shard_batch(same, layout, 0, separator=sep).documents.batch == 1  # one row of boundaries for all


def test_document_masking_refuses_a_token_file_without_its_separator(tmp_path):
    """Masking found no document in a token file written without the separator (or with another model's EOS):
    every sample trained as one document, with exit 0."""
    tokenizer = str(DATA / "tokenizer.json")
    ids = np.asarray(TextTokenizer(tokenizer).encode(["Ada keeps the red lamp. " * 40])[0], dtype=np.uint16)
    np.save(tmp_path / "t.npy", ids)
    masked = _config(tmp_path, [str(tmp_path / "t.npy")], tokenizer=tokenizer, document_masking=True)
    with pytest.raises(ValueError, match="t.npy never holds the separator id 0, so data.document_masking would"):
        load_sources(masked, tokenize=True)
    assert load_sources(_config(tmp_path, [str(tmp_path / "t.npy")], tokenizer=tokenizer), tokenize=True)
    np.save(tmp_path / "t.npy", np.append(ids, 0).astype(np.uint16))
    assert load_sources(masked, tokenize=True)


@pytest.mark.parametrize("key", ["data.cache_dir", "checkpoint.dir", "log.dir", "checkpoint.export_dir"])
def test_a_run_output_inside_a_data_folder_is_refused(tmp_path, key):
    """What the run writes there was read as data from the next start on (a cache's .json record, a manifest or
    metrics.jsonl as documents without text, a cache's .bin as token ids)."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text('{"text": "Ada keeps the red lamp."}\n' * 50)
    out = str(tmp_path / "data" / "out")
    cfg = _config(tmp_path, [str(tmp_path / "data")], tokenizer=str(DATA / "tokenizer.json"))
    cfg = parse_config(cfg.model_dump(), [f"{key}={out}"])
    with pytest.raises(ValueError, match=f"holds {key}=.*data/out: .*set {key} to a folder outside the data"):
        load_sources(cfg, tokenize=True)

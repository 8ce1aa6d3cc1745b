"""Checks before the ranks start (one message from the launcher), RoPE range warnings, and what an export records."""

from __future__ import annotations

import json
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
import yaml

from mtraining.data.tokens import TokenPart
from mtraining.models import build_config
from mtraining.train.check import check_model
from mtraining.train.config import parse_config
from mtraining.train.data import Source
from mtraining.train.launch import run_local
from mtraining.train.preflight import rope_warning
from tests.train.trainer_runs import RAW as TRAINER_RAW

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data"
TINY = {**TRAINER_RAW["model"]["config"], "max_position_embeddings": 64}  # trained here at 128
RAW = {
    "model": {"config": TINY, "dtype": "float32"},
    "attention": {"sparse": False, "block_size": 16, "backend": "torch"},
    "data": {"sources": [str(DATA / "tiny_corpus.jsonl")], "tokenizer": str(DATA / "tokenizer.json"), "seq_len": 128},
    "train": {"steps": 1, "device": "cpu", "activation_checkpointing": False},
    "log": {"progress": False},
}


@pytest.mark.parametrize(
    "fields, max_id, expected",
    [
        ({}, 511, None),
        (
            {},
            512,
            "corpus.bin holds token id 512 but the model's vocab_size is 512; if its ids were written with a "
            "narrower type than data.token_dtype=uint32",
        ),
        (
            {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1},
            10,
            r"sliding-window attention \(window 32\) in layers \[1\].*use_sliding_window: false",
        ),
        ({"attention_dropout": 0.1}, 10, "attention_dropout: 0.0"),
    ],
)
def test_model_checks_name_the_fix(fields, max_id, expected):
    cfg = parse_config(RAW)
    hf_config = build_config(config={**TINY, **fields})
    sources = [Source("corpus.bin", [TokenPart("corpus.bin", "uint32", 10, max_id, "corpus.bin")], None, 1)]
    if expected is None:
        check_model(cfg, hf_config, sources)
        return
    with pytest.raises(ValueError, match=expected):
        check_model(cfg, hf_config, sources)


def test_rope_warning_when_the_sequence_outgrows_the_model_with_rope_unchanged():
    hf_config = build_config(config=TINY)  # 64 positions, trained here at 128
    assert "exceeds the model's max_position_embeddings (64)" in rope_warning(parse_config(RAW), hf_config)
    for change in ("model.rope_theta=40000", "model.rope_parameters={rope_type: yarn, factor: 2.0}"):
        assert rope_warning(parse_config(RAW, [change]), hf_config) is None
    assert rope_warning(parse_config(RAW, ["data.seq_len=64"]), hf_config) is None


def _train_and_export(cfg) -> None:
    from mtraining.train.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        trainer.run()
    finally:
        trainer.close()


@pytest.mark.parametrize(
    "rope, dtype, export_dtype, saved",
    [
        ("model.rope_theta=40000", "float32", "auto", "F32"),
        ("model.rope_parameters={rope_type: yarn, factor: 2.0}", "bfloat16", "auto", "BF16"),
        ("model.overrides={rope_theta: 40000}", "bfloat16", "float32", "F32"),
    ],
)
def test_a_context_extended_export_records_its_length_rope_and_dtype(tmp_path, rope, dtype, export_dtype, saved):
    """A 64-position model trained at 128 exports max_position_embeddings 128 and its RoPE (so evaluation at 128
    is accepted), in the training dtype unless checkpoint.export_dtype asks otherwise."""
    from mtraining.eval.loading import check_rope_range, load

    out = tmp_path / "export"
    cfg = parse_config(
        RAW, [rope, f"model.dtype={dtype}", f"checkpoint.export_dir={out}", f"checkpoint.export_dtype={export_dtype}"]
    )
    run_local(_train_and_export, 1, cfg)
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == 128
    rope_parameters = config["rope_parameters"]
    if "yarn" in rope:
        assert rope_parameters["rope_type"] == "yarn" and rope_parameters["original_max_position_embeddings"] == 64
    else:
        assert rope_parameters["rope_theta"] == 40000
    raw = (out / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {saved}
    loaded = load(out, device="cpu", dtype="float32")
    check_rope_range([128], 0, loaded.max_positions, allow=False)  # refused at 64 before
    with pytest.raises(ValueError, match="exceeds the model's RoPE range"):
        check_rope_range([256], 0, loaded.max_positions, allow=False)
    assert torch.isfinite(next(loaded.model.parameters())).all()


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"model": {"config": {**TINY, "vocab_size": 100}}}, "vocab_size is 100"),
        (
            {"model": {"path": "models/none"}},
            "model.path: {tmp}/models/none does not exist (written relative in train.yaml",
        ),
        (
            {"data": {**RAW["data"], "tokenizer": "nowhere/tokenizer.json"}},
            "data.tokenizer: {tmp}/nowhere/tokenizer.json",
        ),
        ({"model": {"config": {**TINY, "model_type": "mistral", "sliding_window": 16}}}, "sliding-window attention"),
        ({"log": {"wandb": {"project": "p"}}}, 'pip install -e ".[wandb]"'),
    ],
    ids=["vocabulary", "model path", "tokenizer", "sliding window", "wandb missing"],
)
def test_the_launcher_reports_a_mistake_once_before_starting_ranks(tmp_path, monkeypatch, change, expected):
    from typer.testing import CliRunner

    from mtraining.cli import app

    monkeypatch.setattr("mtraining.train.torchrun.launch", lambda *a, **k: pytest.fail("torchrun was started"))
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({**RAW, **change}))
    result = CliRunner().invoke(app, ["train", str(config), "--nproc", "2", "parallel.context=2"])
    assert result.exit_code == 2, result.output
    expected = expected.format(tmp=tmp_path)
    assert result.output.count("error:") == 1 and expected in result.output and "Traceback" not in result.output


def test_a_malformed_data_file_is_one_message_naming_file_and_line(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from mtraining.cli import app

    monkeypatch.setattr("mtraining.train.torchrun.launch", lambda *a, **k: pytest.fail("torchrun was started"))
    (tmp_path / "docs.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "cut\n')
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({**RAW, "data": {**RAW["data"], "sources": ["docs.jsonl"]}}))
    result = CliRunner().invoke(app, ["train", str(config), "--nproc", "2", "parallel.context=2"])
    assert result.exit_code == 2 and result.output.count("error:") == 1 and "Traceback" not in result.output
    assert f"{tmp_path / 'docs.jsonl'}:2: not valid JSON" in result.output


def _tiny_export(cfg, out) -> None:
    from mtraining.models import build_model
    from mtraining.train.export import export_model

    hf = build_model(**cfg.model.hf_kwargs())
    export_model(cfg, hf.state_dict(), hf.config, out)


def test_an_export_replaces_only_an_earlier_export_and_never_the_base_model(tmp_path, monkeypatch):
    """checkpoint.export_dir (or `mtraining export`'s OUT) that is model.path, or a folder holding files no
    export wrote, is refused before anything is written; an earlier export is replaced whole, and an export
    that fails half way leaves it as it was."""
    from mtraining.train import export as export_module
    from mtraining.train.outputs import check_output_dirs

    cfg = parse_config(RAW)
    out = tmp_path / "export"
    _tiny_export(cfg, out)
    first = (out / "model.safetensors").read_bytes()
    based = parse_config(RAW, [f"model.path={out}", "model.config=null", f"checkpoint.export_dir={out}"])
    with pytest.raises(
        ValueError, match="checkpoint.export_dir=.* is the folder of model.path: the export would replace"
    ):
        check_output_dirs(based)
    for inside in ("checkpoint.dir", "log.dir"):  # empty at the start, replaced whole by the export at the end
        with pytest.raises(ValueError, match=f"export.* holds {inside}=.*an export replaces its folder whole"):
            check_output_dirs(parse_config(RAW, [f"{inside}={tmp_path / 'run' / 'sub'}", f"checkpoint.export_dir={tmp_path / 'run'}"]))  # fmt: skip
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": 1}')
    with pytest.raises(ValueError, match=r"mine holds files that no export wrote \(config.json\)"):
        check_output_dirs(parse_config(RAW, [f"checkpoint.export_dir={mine}"]))
    with pytest.raises(ValueError, match="holds files that no export wrote"):
        _tiny_export(cfg, mine)
    assert [p.name for p in mine.iterdir()] == ["config.json"] and "mine" in (mine / "config.json").read_text()
    # the ranks check their folders at once: another rank's probe in a new export folder is not a user's file
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / ".write-test-4242").write_bytes(b"")
    check_output_dirs(parse_config(RAW, [f"checkpoint.export_dir={fresh}"]))

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_module, "export_hf", broken)
    with pytest.raises(Exception, match="no space left"):
        _tiny_export(cfg, out)
    assert (out / "model.safetensors").read_bytes() == first and not list(tmp_path.glob("*.partial*"))
    monkeypatch.undo()
    torch.manual_seed(1)
    _tiny_export(cfg, out)  # an earlier export: replaced
    assert (out / "model.safetensors").read_bytes() != first and not list(tmp_path.glob("export.*"))

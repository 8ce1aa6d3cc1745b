"""`mtraining check`: every problem of a run found without GPUs, all at once, with exit status 2; the same
checks in the --nproc launcher and in the ranks of a direct torchrun launch; the messages name the key."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from mtraining.cli import app
from mtraining.train.check import Launch, check_run, safetensors_header
from mtraining.train.config import load_config
from tests.configs import TINY

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data"
RAW = {
    "model": {"config": TINY, "dtype": "float32"},
    "attention": {"block_size": 16, "backend": "torch", "v_size": 16, "s_size": 32, "last_q": 16, "local_window": 16},
    "data": {"sources": [str(DATA / "tiny_corpus.jsonl")], "tokenizer": str(DATA / "tokenizer.json"), "seq_len": 128},
    "train": {"steps": 4, "device": "cpu"},
    "optim": {"warmup_steps": 1},
    "log": {"progress": False},
}


def _write(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


def _check(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["check", *map(str, args)])
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """TINY saved as a Hugging Face folder (config.json, model.safetensors) with the shipped tokenizer.json."""
    from mtraining.models import build_model

    folder = tmp_path_factory.mktemp("tiny-model")
    torch.manual_seed(0)
    build_model(config=TINY).save_pretrained(folder)
    (folder / "tokenizer.json").write_bytes((DATA / "tokenizer.json").read_bytes())
    return folder


def test_a_good_config_passes(tmp_path):
    code, out = _check(_write(tmp_path / "c.yaml", RAW))
    assert code == 0 and "no problems found" in out, out


def test_every_problem_is_reported_at_once_naming_its_key(tmp_path, monkeypatch):
    """Config keys (with 'did you mean'), the launch shape, the model path, a data source and the tokenizer:
    one run, one list, exit 2; paths say what they are relative to."""
    monkeypatch.chdir(tmp_path)
    raw = {**RAW, "data": {**RAW["data"], "sources": ["docs/*.jsonl", str(DATA / "tiny_corpus.jsonl")]}}
    config = _write(tmp_path / "c.yaml", raw)
    code, out = _check(
        config,
        "--nproc",
        "3",
        "train.stepz=3",
        "model.config=null",
        "model.path=nope",
        "data.tokenizer=null",
    )
    assert code == 2, out
    text = " ".join(out.split())
    assert "4 problems (checked in" in text
    for expected in (
        "train.stepz: unknown key; remove it or fix its spelling; did you mean train.steps?",
        "the launch has 3 ranks but parallel.data x parallel.context = 1 x 1 = 1",
        f"model.path: nope does not exist (given on the command line: relative to the working directory, {tmp_path})",
        f"data.sources[0]: data source {tmp_path / 'docs/*.jsonl'} matches no file or folder; check the path "
        f"(written relative in c.yaml: relative paths in a config are relative to its folder, {tmp_path})",
    ):
        assert expected.split(" (")[0] in text, (expected, text)
    assert "no tokenizer at nope" not in text  # the model path's problem, said once, under its own key


def test_a_relative_path_in_the_file_says_the_file_folder(tmp_path):
    folder = tmp_path / "exp"
    folder.mkdir()
    raw = {**RAW, "data": {**RAW["data"], "sources": ["corpus.jsonl"]}}
    code, out = _check(_write(folder / "c.yaml", raw))
    text = " ".join(out.split())
    assert (
        code == 2 and f"data.sources[0]: {folder / 'corpus.jsonl'} does not exist (written relative in c.yaml" in text
    )
    assert f"relative paths in a config are relative to its folder, {folder}" in text


def test_the_tokenizer_of_model_path_is_named_as_such(tmp_path, model_dir):
    """data.tokenizer unset: the tokenizer comes from model.path, and a model folder without one says so."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((model_dir / name).read_bytes())
    raw = {**RAW, "model": {"path": str(bare), "dtype": "float32"}, "data": {**RAW["data"], "tokenizer": None}}
    code, out = _check(_write(tmp_path / "c.yaml", raw))
    text = " ".join(out.split())
    assert code == 2 and "data.tokenizer is not set, so the tokenizer comes from model.path" in text, text
    np.save(tmp_path / "ids.npy", np.arange(1000, dtype=np.uint16) % TINY["vocab_size"])
    tokens = {**raw, "data": {**raw["data"], "sources": [str(tmp_path / "ids.npy")]}}
    assert _check(_write(tmp_path / "t.yaml", tokens))[0] == 0  # token files need no tokenizer
    np.save(tmp_path / "ids.npy", np.arange(1000, dtype=np.uint16))
    code, out = _check(_write(tmp_path / "t.yaml", tokens))
    assert code == 2 and f"{tmp_path / 'ids.npy'} holds token id 999 but the model's vocab_size is 512" in out, out
    raw["model"]["path"] = str(model_dir)
    assert _check(_write(tmp_path / "c.yaml", raw))[0] == 0


def test_weights_are_checked_against_the_config_from_their_headers(tmp_path, model_dir):
    """Shapes from the safetensors header (no weight read) against the config: a changed config.json, a missing
    tensor and a truncated file are each named."""
    import shutil

    header = safetensors_header(model_dir / "model.safetensors")
    assert header["model.embed_tokens.weight"]["shape"] == [TINY["vocab_size"], TINY["hidden_size"]]
    cases = {}
    wide = shutil.copytree(model_dir, tmp_path / "wide")
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "intermediate_size": 256}))
    cases[wide] = "do not have the shapes config.json (with model.overrides) gives, e.g. model.layers.0.mlp"
    deep = shutil.copytree(model_dir, tmp_path / "deep")
    deeper = {k: v for k, v in config.items() if k != "layer_types"} | {"num_hidden_layers": 3}
    (deep / "config.json").write_text(json.dumps(deeper))
    cases[deep] = "lacks 12 of the model's 38 weights (e.g. model.layers.2."
    odd = shutil.copytree(model_dir, tmp_path / "odd")
    (odd / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))  # 2 layer_types
    cases[odd] = "config.json (with model.overrides) does not make a qwen2 config"
    cut = shutil.copytree(model_dir, tmp_path / "cut")
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    cases[cut] = "model.safetensors is truncated"
    for folder, expected in cases.items():
        raw = {**RAW, "model": {"path": str(folder), "dtype": "float32"}}
        code, out = _check(_write(tmp_path / "c.yaml", raw))
        assert code == 2 and expected in " ".join(out.split()), out


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # a one-process save
def test_a_changed_schedule_is_refused_before_any_rank_starts(tmp_path):
    """The newest checkpoint's recorded run against this one: another train.steps is refused by check (and so by
    the launcher) unless checkpoint.allow_changed_schedule; the trainer itself never starts."""
    from mtraining.models import build_model
    from mtraining.train.checkpoint import save_checkpoint
    from mtraining.train.loss import CausalLMLoss
    from mtraining.train.resume import describe_run, model_identity

    raw = {**RAW, "checkpoint": {"dir": str(tmp_path / "ck")}}
    cfg = load_config(_write(tmp_path / "c.yaml", raw))
    model = CausalLMLoss(build_model(config=TINY))
    run = describe_run(cfg, model_identity(model.model.config, model.state_dict()), 1, 1)
    save_checkpoint(tmp_path / "ck", 2, model, torch.optim.AdamW(model.parameters()), run)
    assert _check(tmp_path / "c.yaml")[0] == 0
    code, out = _check(tmp_path / "c.yaml", "train.steps=8")
    text = " ".join(out.split())
    assert code == 2 and "resume: resuming step_00000002 with another schedule (train.steps 4 -> 8" in text, text
    assert _check(tmp_path / "c.yaml", "train.steps=8", "checkpoint.allow_changed_schedule=true")[0] == 0
    result = CliRunner().invoke(app, ["train", str(tmp_path / "c.yaml"), "--nproc", "2", "train.steps=8"])
    assert result.exit_code == 2 and "with another schedule" in result.output
    (tmp_path / "ck" / "step_00000002" / "manifest.json").unlink()  # as an earlier version wrote it: refused, kept
    code, out = _check(tmp_path / "c.yaml")
    assert code == 2 and "It is neither loaded nor replaced" in " ".join(out.split()), out


def test_the_papers_recipe_is_checked_whole_on_a_machine_without_its_files():
    """configs/qwen2.5-3b_32k_to_512k.yaml as launched (4 nodes x 8): the missing model and both data folders
    are reported together, and the shared storage it needs is listed."""
    code, out = _check(ROOT / "configs" / "qwen2.5-3b_32k_to_512k.yaml", "--nproc", "8", "--nnodes", "4")
    text = " ".join(out.split())
    assert code == 2
    for expected in ("model.path: /models/Qwen2.5-3B does not exist", "data.sources[0]: /data/long does not exist"):
        assert expected in text
    assert "data.sources[1]: /data/short does not exist" in text
    assert "shared storage (several nodes): checkpoint.dir:" in text
    code, out = _check(ROOT / "configs" / "qwen2.5-3b_32k_to_512k.yaml", "--nproc", "8")
    assert "the launch has 8 ranks but parallel.data x parallel.context = 1 x 32" in " ".join(out.split())


def test_estimates_are_printed_for_gpu_runs(tmp_path, model_dir):
    raw = {**RAW, "model": {"path": str(model_dir)}, "train": {**RAW["train"], "device": "cuda"}}
    code, out = _check(_write(tmp_path / "c.yaml", raw), "--gpu", "h200", "--usd-per-gpu-hour", "2")
    assert code == 0, out
    text = " ".join(out.split())
    assert "memory per GPU, estimated:" in text and "of the H200 141GB's 141 GB" in text
    assert "time, estimated:" in text and "ring cost model" in text and "cost at $2 per GPU-hour" in text
    assert "estimates: none for train.device=cpu" in " ".join(_check(_write(tmp_path / "d.yaml", RAW))[1].split())


def _build_trainer(cfg) -> None:
    from mtraining.train.trainer import Trainer

    Trainer(cfg).close()


def test_the_ranks_of_a_direct_torchrun_launch_run_the_same_checks(tmp_path):
    """Without the launcher (torchrun by hand; here two gloo ranks) the trainer refuses the run with every problem
    in one message before it builds the model."""
    from mtraining.train.launch import run_local

    bad = [f"data.sources=[{tmp_path / 'a.jsonl'}, {tmp_path / 'b.jsonl'}]", f"data.tokenizer={tmp_path / 't.json'}"]
    cfg = load_config(_write(tmp_path / "c.yaml", RAW), [*bad, "parallel.data=2"])
    with pytest.raises(RuntimeError) as err:
        run_local(_build_trainer, 2, cfg)
    msg = str(err.value)
    assert "3 problems:" in msg and "data.tokenizer:" in msg and "data.sources[1]:" in msg, msg


def test_fa4_without_flash_attn_4_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import flash_attn raises ImportError
    overrides = ["attention.backend=fa4", "attention.block_size=128", "train.device=auto", "model.dtype=bfloat16"]
    cfg = load_config(_write(tmp_path / "c.yaml", RAW), overrides)
    problems = check_run(cfg, Launch(1))[0].problems
    assert any(
        "attention.backend=fa4 needs FlashAttention-4" in p and "pip install flash-attn-4" in p for p in problems
    )


def test_check_run_collects_instead_of_raising(tmp_path):
    cfg = load_config(_write(tmp_path / "c.yaml", RAW), ["data.sources=[nowhere.jsonl]", "data.cache_dir=/proc/x/y"])
    report, found = check_run(cfg, Launch(2))
    assert len(report.problems) >= 2 and found.hf_config is not None and found.model is not None
    with pytest.raises(ValueError, match="problems:\n  - "):
        report.raise_problems()

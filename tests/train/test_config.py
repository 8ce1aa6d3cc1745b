"""Config validation: the shipped configs load; bad configs fail at start with a message naming the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from mtraining.cli import app
from mtraining.train.config import ConfigError, apply_overrides, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]
BASE = {
    "model": {"config": {"model_type": "qwen2"}},
    "data": {"sources": ["x.jsonl"], "seq_len": 1024},
    "train": {"steps": 10},
    "parallel": {"context": 4},
    "attention": {"block_size": 128, "v_size": 256, "s_size": 512},
}


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
    cfg = load_config(path)
    assert cfg.world_size >= 1


def test_the_papers_recipe_is_the_papers():
    """configs/qwen2.5-3b_32k_to_512k.yaml: 4 nodes x 8 GPUs, hierarchical striped ring, the reference's budgets,
    AdamW (0.9, 0.95) without weight decay, lr 2e-5, clip 1, a 512K RoPE base, accumulation to the global batch."""
    cfg = load_config(ROOT / "configs" / "qwen2.5-3b_32k_to_512k.yaml")
    cfg.check_world_size(32)
    assert (cfg.parallel.ring, cfg.attention.layout, cfg.inner_size(8), cfg.data.seq_len) == (
        "hierarchical",
        "striped",
        8,
        524288,
    )
    att = cfg.attention
    assert (att.v_size, att.s_size, att.sink_tokens, att.local_window, att.sparse) == (1000, 6096, 30, 100, True)
    o = cfg.optim
    assert (o.lr, o.betas, o.weight_decay, o.grad_clip) == (2e-5, (0.9, 0.95), 0.0, 1.0)
    assert cfg.model.rope_theta == 1.28e8 and cfg.micro_batches == 16 and cfg.tokens_per_step == 8 << 20
    assert not cfg.log.recall and [s.weight for s in cfg.data.source_specs] == [0.6, 0.4]


def test_relative_paths_are_relative_to_the_config_file(tmp_path):
    folder = tmp_path / "exp"
    folder.mkdir()
    sources = [{"path": "corpus/*.jsonl", "weight": 2.0}, {"path": "../short", "weight": 1.0}]
    raw = {
        **BASE,
        "data": {**BASE["data"], "sources": sources, "tokenizer": "/abs/tok.json"},
        "checkpoint": {"dir": "ck"},
        "log": {"dir": "~/logs"},
    }
    (folder / "c.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_config(folder / "c.yaml", ["checkpoint.export_dir=out"])  # command-line paths stay as given
    assert [s.path for s in cfg.data.source_specs] == [str(folder / "corpus/*.jsonl"), str(tmp_path / "short")]
    assert cfg.data.tokenizer == "/abs/tok.json" and cfg.checkpoint.dir == str(folder / "ck")
    assert cfg.log.dir == str(Path.home() / "logs") and cfg.checkpoint.export_dir == "out"


def test_a_wrong_path_says_what_it_is_relative_to(tmp_path, monkeypatch):
    """A path written relative in the file is relative to the file's folder; one given on the command line to the
    working directory: messages about a wrong path say which (Config.path_note)."""
    folder = tmp_path / "exp"
    folder.mkdir()
    monkeypatch.chdir(tmp_path)
    raw = {**BASE, "data": {**BASE["data"], "sources": ["a.jsonl", "/abs/b.jsonl"]}, "checkpoint": {"dir": "ck"}}
    (folder / "c.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_config(folder / "c.yaml", ["log.dir=logs"])
    assert cfg.path_note("data.sources[0]") == (
        f" (written relative in c.yaml: relative paths in a config are relative to its folder, {folder})"
    )
    assert cfg.path_note("data.sources[1]") == "" and "relative to its folder" in cfg.path_note("checkpoint.dir")
    assert cfg.path_note("log.dir") == f" (given on the command line: relative to the working directory, {tmp_path})"
    cfg = load_config(folder / "c.yaml", ["data.sources=[x.jsonl]", "checkpoint.dir=/abs/ck"])
    assert "command line" in cfg.path_note("data.sources[0]") and cfg.path_note("checkpoint.dir") == ""


def test_every_config_problem_is_listed_and_checking_goes_on_without_the_bad_keys():
    """parse_config_partly (mtraining check): all problems of every round; the config without the bad keys."""
    from mtraining.train.config import apply_overrides, parse_config_partly

    bad = ["train.stepz=1", "atention={}", "log.wandb={projct: x}", "data.sources=[{path: a, weight: -1}]"]
    cfg, problems = parse_config_partly(apply_overrides(BASE, bad))
    assert cfg is not None and cfg.train.steps == 10 and cfg.log.wandb is None
    assert [p.split(":")[0] for p in problems] == [
        "data.sources[0].weight",
        "train.stepz",
        "log.wandb.project",
        "log.wandb.projct",
        "atention",
    ]
    cfg, problems = parse_config_partly(apply_overrides(BASE, ["train.steps=null", "train.stepz=1"]))
    assert cfg is None and problems == [
        "train.steps: Input should be a valid integer",
        "train.stepz: unknown key; remove it or fix its spelling; did you mean train.steps?",
    ]


def test_overrides_parse_values_as_yaml_and_reach_nested_sections():
    cfg = parse_config(
        BASE, ["train.steps=3", "attention.dense_layers=[0, 1]", "model.config.hidden_size=64", "checkpoint.dir=null"]
    )
    assert cfg.train.steps == 3 and cfg.attention.dense_layers == [0, 1]
    assert cfg.model.config["hidden_size"] == 64 and cfg.checkpoint.dir is None
    assert BASE["train"]["steps"] == 10  # the input is not modified


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["train.stepz=1"], "train.stepz: unknown key; remove it or fix its spelling; did you mean train.steps?"),
        (["attention.blocksize=64"], "attention.blocksize: unknown key; remove it or fix its spelling; did you mean "),
        (
            ["log.wandb={projct: x}"],
            "log.wandb.projct: unknown key; remove it or fix its spelling; did you mean log.wandb.project?",
        ),
        (["data.sources=[{path: a, wieght: 1}]"], "did you mean data.sources[0].weight?"),
        (["optim.zzz=1"], "optim.zzz: unknown key; remove it or fix its spelling\n"),
        (["data.seq_len=1000"], "use a multiple of 512, e.g. 1024"),
        (["attention.layout=zigzag", "data.seq_len=512"], "use a multiple of 1024"),
        (["attention.layout=diagonal"], "'contiguous', 'zigzag' or 'striped'"),
        (["model.path=/some/dir"], "set exactly one of model.path"),
        (["model.path=/some/dir", "model.config=null", "model.init=depth_scaled"], "remove model.init"),
        (["model.init=muP"], "'hf' or 'depth_scaled'"),
        (["model.config={hidden_size: 8}"], "model.config needs a model_type"),
        (["optim.warmup_steps=20"], "lower it"),
        (["checkpoint.every=5"], "set checkpoint.dir"),
        (["attention.threshold=1.5"], "attention.threshold"),
        (["attention.dense_layers=[-1]"], "layer indices >= 0"),
        (["data.sources=[{path: a, weight: 1}, b]"], "give every source a weight or none"),
        (["data.sources=[{path: a, weight: -1}]"], "data.sources[0].weight: Input should be greater than 0"),
        (["data.global_batch_tokens=1000"], "must be a multiple of the tokens of one micro-batch"),
        (["parallel.ring=flat", "parallel.inner_size=2"], "set both"),
        (
            ["parallel.context_mode=allgather", "parallel.ring=hierarchical"],
            "parallel.context_mode=allgather runs no ring",
        ),
        (["data.reset_position_ids=true"], "only exist with data.document_masking: true"),
        (["parallel.ring=hierarchical", "parallel.inner_size=3"], "use one of [1, 2, 4]"),
        (["model.rope_theta=1e6", "model.overrides={rope_theta: 2e6}"], "keep one"),
        (["log.wandb={entity: me}"], "log.wandb.project"),
        (["train.steps=0"], "train.steps"),
        (["attention.v_size=2048"], "attention.v_size (2048) exceeds data.seq_len (1024)"),
        (["attention.local_window=512", "attention.s_size=256"], "attention: local_window (512) exceeds"),
        (
            ["attention.block_size=96", "data.seq_len=1536", "parallel.context=1"],
            "attention: block_size must be a power of two",
        ),
        (["attention.sparse=false", "attention.block_size=96", "data.seq_len=1536", "parallel.context=1"], None),
        (["attention.backend=fa4"], "parallel.context is 4 (the ring steps' positions are strided by the layout)"),
        (["attention.backend=fa4", "parallel.context=1", "train.device=cpu"], "set train.device=cuda"),
        (["attention.backend=fa4", "parallel.context=1", "model.dtype=float32"], "set model.dtype=bfloat16"),
        (["attention.backend=fa4", "parallel.context=1", "attention.block_columns=8"], "set attention.block_columns=0"),
        (
            ["attention.backend=fa4", "parallel.context=1", "attention.block_size=64"],
            "block_size that is a multiple of 128 (got block_columns 0, block_size 64)",
        ),
        (["attention.backend=fa4", "parallel.context=1"], None),
    ],
)
def test_bad_configs_fail_with_the_fix(overrides, expected):
    if expected is None:  # the control: valid once the offending part is switched off
        parse_config(BASE, overrides)
        return
    with pytest.raises(ConfigError) as err:
        parse_config(BASE, overrides)
    assert expected in str(err.value) + "\n"


def test_world_size_must_be_data_times_context():
    cfg = parse_config(BASE, ["parallel.data=2"])
    cfg.check_world_size(8)
    with pytest.raises(ValueError, match=r"set parallel.data=3"):
        cfg.check_world_size(12)
    with pytest.raises(ValueError, match=r"launch 8 ranks"):
        cfg.check_world_size(6)


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="section.key=value"):
        apply_overrides({}, ["train.steps"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        apply_overrides({"train": {"steps": 1}}, ["train.steps.x=1"])


def test_a_key_given_twice_is_refused_with_its_lines(tmp_path):
    """YAML keeps the last of two equal keys: a second `train:` section silently dropped the first's keys."""
    twice = tmp_path / "twice.yaml"
    twice.write_text(yaml.safe_dump(BASE) + "train: {steps: 1}\n")
    with pytest.raises(ConfigError, match=r"twice.yaml: the key 'train' is given twice \(lines \d+ and \d+\)"):
        load_config(twice)
    nested = tmp_path / "nested.yaml"
    nested.write_text("train:\n  steps: 10\n  seed: 1\n  seed: 2\n")
    with pytest.raises(ConfigError, match=r"the key 'seed' is given twice \(lines 3 and 4\)"):
        load_config(nested)
    with pytest.raises(ConfigError, match="the key 'a' is given twice"):
        apply_overrides({}, ["train.x={a: 1, a: 2}"])


def test_cli_reports_config_errors_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**BASE, "train": {"steps": 10, "lr": 1.0}}))
    result = CliRunner().invoke(app, ["train", str(bad)])
    assert result.exit_code == 2
    assert "train.lr: unknown key" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(app, ["train", str(tmp_path / "missing.yaml")])
    assert result.exit_code == 2 and "does not exist" in result.output
    result = CliRunner().invoke(app, ["train", str(tmp_path)])
    assert result.exit_code == 2 and "is a folder, not a YAML config file" in result.output
    for nproc in ("0", "-2"):
        result = CliRunner().invoke(app, ["train", str(ROOT / "configs" / "tiny_cpu.yaml"), "--nproc", nproc])
        assert result.exit_code == 2 and "--nproc and --nnodes must be at least 1" in result.output, result.output
    result = CliRunner().invoke(app, ["train", str(ROOT / "configs" / "tiny_cpu.yaml"), "--nproc", "3"])
    assert result.exit_code == 2 and "parallel.data x parallel.context" in result.output


def test_cli_tokenize_fills_the_cache_and_writes_the_token_stream(tmp_path):
    import numpy as np

    from mtraining.train.data import load_sources

    out = tmp_path / "tokens.npy"
    args = ["tokenize", str(ROOT / "configs" / "tiny_cpu.yaml"), str(out), f"data.cache_dir={tmp_path}"]
    result = CliRunner().invoke(app, args)  # from any folder: the config's paths are relative to it
    assert result.exit_code == 0, result.output
    assert "tokenising" in result.output and "141,281 tokens" in result.output
    cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml", [f"data.cache_dir={tmp_path}"])
    expected = load_sources(cfg, tokenize=False)[0].stream.read(0, 141281)  # from the cache, not tokenised again
    saved = np.load(out)
    assert saved.dtype == np.uint16 and np.array_equal(saved, expected)
    again = CliRunner().invoke(app, args[:2] + args[3:])  # cached: nothing tokenised
    assert again.exit_code == 0 and "tokenising" not in again.output
    # an existing file (a source among them) is never written over; a .bin would be read back with the header
    for target, why in ((out, "exists; choose a new file name"), (tmp_path / "t.bin", "name it t.npy")):
        refused = CliRunner().invoke(app, [*args[:2], str(target), *args[3:]])
        assert refused.exit_code == 2 and why in refused.output, refused.output
    assert np.array_equal(np.load(out), expected) and not (tmp_path / "t.bin").exists()
    twice = CliRunner().invoke(app, [*args, str(tmp_path / "other.npy")])
    assert twice.exit_code == 2 and "tokenize takes one OUT file" in twice.output


def test_every_command_takes_overrides_as_train_does(tmp_path, monkeypatch):
    """section.key=value after the positional arguments, for train, check, export and tokenize alike; anything else
    there is named; export names a --checkpoint that does not exist (not "an interrupted save")."""
    config = str(ROOT / "configs" / "tiny_cpu.yaml")
    for args in (["train", config], ["check", config], ["export", config, str(tmp_path / "hf")]):
        result = CliRunner().invoke(app, [*args, "train.stepz=1"])
        assert result.exit_code == 2 and "did you mean train.steps?" in result.output, result.output
        result = CliRunner().invoke(app, [*args, "steps"])
        assert result.exit_code == 2 and "'steps' is not a section.key=value override" in result.output, result.output
    missing = tmp_path / "ck" / "step_00000020"
    result = CliRunner().invoke(app, ["export", config, str(tmp_path / "hf"), "--checkpoint", str(missing)])
    assert result.exit_code == 2 and f"--checkpoint {missing} does not exist" in result.output
    assert "interrupted save" not in result.output and "Traceback" not in result.output


def test_budgets_file_gives_per_layer_per_head_budgets(tmp_path):
    budgets = tmp_path / "budgets.yaml"
    budgets.write_text(
        yaml.safe_dump({"default": {"v_size": 128, "s_size": 256}, "layers": {1: {"v_size": [64, 96, 128, 160]}}})
    )
    with_file = BASE | {"attention": {"block_size": 128, "budgets": str(budgets)}}
    cfg = parse_config(with_file)
    v0, s0 = cfg.attention.pattern_config().head_budgets(0, 4, 1024)
    v1, s1 = cfg.attention.pattern_config().head_budgets(1, 4, 1024)
    assert v0.tolist() == [128] * 4 and s0.tolist() == s1.tolist() == [256] * 4 and v1.tolist() == [64, 96, 128, 160]
    assert parse_config(BASE, ["attention.sparse=false"]).attention.pattern_config() is None
    # the config is checked with the budgets it will run: a missing file, or budgets beside v_size, fail at load
    with pytest.raises(ConfigError, match="attention: budgets file .*nope.yaml does not exist"):
        parse_config(with_file, [f"attention.budgets={tmp_path / 'nope.yaml'}"])
    with pytest.raises(
        ConfigError, match="set either budgets or v_size and s_size, not both: .* remove attention.v_size"
    ):
        parse_config(BASE, [f"attention.budgets={budgets}"])
    with pytest.raises(ConfigError, match=r"attention.last_q \(2048\) exceeds data.seq_len"):
        parse_config(with_file, ["attention.last_q=2048"])


def test_block_columns_reach_the_pattern_config_on_every_backend():
    for backend in ("torch", "triton", "auto"):
        cfg = parse_config(BASE, ["attention.block_columns=8", f"attention.backend={backend}"])
        assert cfg.attention.pattern_config().block_columns == 8
    assert parse_config(BASE).attention.pattern_config().block_columns == 0
    with pytest.raises(ConfigError, match="block_columns"):
        parse_config(BASE, ["attention.block_columns=-1"])


def test_column_scorer_and_cap_reach_the_pattern_config():
    config = parse_config(BASE).attention.pattern_config()
    assert (config.column_scorer, config.column_cap) == ("sorted", 0)
    cfg = parse_config(BASE, ["attention.column_scorer=dense", "attention.column_cap=512"])
    assert (cfg.attention.pattern_config().column_scorer, cfg.attention.pattern_config().column_cap) == ("dense", 512)
    with pytest.raises(ConfigError, match="column_scorer"):
        parse_config(BASE, ["attention.column_scorer=hashed"])
    with pytest.raises(ConfigError, match="column_cap"):
        parse_config(BASE, ["attention.column_cap=-1"])

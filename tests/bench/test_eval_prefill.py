"""bench/eval_prefill.py on its tiny model: every case of both arms is recorded with its provenance, the profile
writes its table, and the sparse arm is the real-model experiment's adaptive one."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.bench.scripts import load_script


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared CPU, two threads' barriers cost this toy model a time slice per op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


CASES = ["engine", "engine_new_shape", "prefill", "cache", "forward", "aligned"]
RUNS = [
    pytest.param(["--lengths", "256", "--arms", "sparse"], [(256, "sparse")], id="one"),
    pytest.param(
        ["--lengths", "512", "1024", "--profile"],
        [(512, "dense"), (512, "sparse"), (1024, "dense"), (1024, "sparse")],
        id="both-profiled",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize("options,cells", RUNS)
def test_every_case_is_recorded(options, cells, tmp_path, capsys, monkeypatch, one_thread):
    bench = load_script("eval_prefill")
    out = tmp_path / "prefill.json"
    # as run from the shell: the records' command is the process's command line
    monkeypatch.setattr(sys, "argv", ["eval_prefill.py", "--tiny", "--repeats", "1", "--out", str(out), *options])
    bench.main()
    records = json.loads(out.read_text())
    cases = CASES + ["profile"] * ("--profile" in options)
    assert [(r["length"], r["arm"]) for r in records[:: len(cases)]] == cells
    assert [r["case"] for r in records] == cases * len(cells)
    for r in records:
        assert r["device"] == "cpu" and r["commit"] and "eval_prefill" in r["command"] and r["gpus"] == 0
        assert r["model"] == "tiny" and r["answer_tokens"] == 8 and r["repeats"] == 1
        if r["case"] == "profile":
            assert r["top"] and r["top"][0]["self_ms"] > 0 and (tmp_path / r["table"]).read_text().strip()
            continue
        seq = r["length"] - 26  # the prompt is 34 tokens short of the length, the answer 8
        tokens = {"aligned": round(seq / 32) * 32, "engine_new_shape": seq - 1}.get(r["case"], seq)
        assert r["tokens"] == tokens
        assert len(r["times"]) == 2 and r["median_s"] == r["times"][1] > 0 and r["first_s"] > 0
        assert (r["phases"] is None) != r["case"].startswith("engine")
        if r["phases"]:
            assert r["phases"]["prefills"] == 2 and r["phases"]["prefill_s"] > 0
        assert r["density"] is None if r["arm"] == "dense" else 0 < r["density"] < 1, r
    length, arm = cells[-1]
    printed = capsys.readouterr().out
    assert f"{length:>8} {arm:>6} engine           {length - 26:>7} tokens  first" in printed
    assert f"{length:>8} {arm:>6}: engine's own" in printed


def test_a_config_alone_gives_the_model_its_shape(tmp_path, one_thread):
    """``--random``: a config.json's shape with random weights, for timings that need no trained model."""
    bench = load_script("eval_prefill")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(bench.ARCHS["tiny"]))
    out = tmp_path / "prefill.json"
    bench.main(["--random", str(config), "--lengths", "256", "--arms", "dense", "--repeats", "1", "--out", str(out)])
    records = json.loads(out.read_text())
    assert [r["case"] for r in records] == CASES and {r["model"] for r in records} == {str(config)}
    assert records[-1]["tokens"] == 256  # aligned to the experiment's block of 128


def test_bad_options_exit_2(capsys):
    bench = load_script("eval_prefill")
    with pytest.raises(SystemExit) as stop:
        bench.main(["--tiny", "--lengths", "30"])
    assert stop.value.code == 2 and "--lengths must exceed" in capsys.readouterr().err


@pytest.mark.parametrize("length", [32768, 65536])
def test_the_arms_are_the_real_model_experiments(length):
    """bench/ cannot import experiments/: its adaptive pattern is checked against the experiment's here."""
    from experiments.real_extension.evaluation import spec
    from experiments.real_extension.settings import ADAPTIVE, PRESETS, arm

    bench = load_script("eval_prefill")
    gpu = PRESETS["gpu"]
    assert bench.attention_spec("sparse") == spec(ADAPTIVE, length, gpu)
    assert bench.attention_spec("dense") == spec(arm("dense"), length, gpu)

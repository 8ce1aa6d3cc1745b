"""The report's arithmetic on result folders written by the test: differences paired by seed, t bounds over seeds
(checked against scipy), no bounds under three seeds, pooling refusals, the goal, runs with their own dense arms;
and the settings' arms, RoPE and checks, and the stage estimates."""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from scipy import stats

from experiments.common.stages import Refused
from experiments.real_extension import cli, recipes, report
from experiments.real_extension.cli import check_work, settings_of
from experiments.real_extension.costs import Estimator, Shape, Timings
from experiments.real_extension.pipeline import Experiment, Sources
from experiments.real_extension.settings import ADAPTIVE, PRESETS, Arm, arm, rope_scaling

pytestmark = pytest.mark.slow

SETTINGS = replace(PRESETS["gpu"], length=4096, eval_fractions=(2, 1))
# per seed: (dense model read dense, adaptive read dense, adaptive read sparse) -> (ppl, niah, forced, ruler) at 4096
FIGURES = {
    0: ((10.0, 80.0, 70.0, 50.0), (10.1, 82.0, 70.0, 49.0), (10.3, 75.0, 60.0, 45.0)),
    1: ((11.0, 70.0, 65.0, 40.0), (11.0, 72.0, 66.0, 42.0), (11.5, 70.0, 60.0, 41.0)),
    2: ((12.0, 90.0, 85.0, 60.0), (11.9, 86.0, 80.0, 61.0), (12.4, 88.0, 80.0, 58.0)),
}
# a second run at the same seeds: its own dense arm (close to the first run's) and a fixed arm
FIXED = replace(SETTINGS, arms=(Arm("dense", False), arm("v1024s6144")), default_arm="v1024s6144")
FIGURES_FIXED = {
    0: ((10.02, 80.0, 70.0, 50.0), (10.03, 80.0, 70.0, 51.0), (10.05, 80.0, 70.0, 50.0)),
    1: ((10.99, 70.0, 65.0, 40.0), (11.0, 70.0, 66.0, 40.0), (11.02, 70.0, 65.0, 40.0)),
    2: ((12.0, 90.0, 85.0, 60.0), (12.03, 80.0, 80.0, 60.0), (12.05, 90.0, 85.0, 60.0)),
}


def cell(length: int, ppl: float, niah: float, forced: float, ruler: float) -> dict:
    return {
        "length": length,
        "ppl": {"buckets": [{"ppl": 2 * ppl}, {"ppl": ppl}]},
        "niah": {"score": niah, "forced": forced, "forced_nll": (100 - forced) / 50, "generated": 10, "prompts": 50},
        "ruler": {"average": ruler},
        "density": None,
    }


def folder(
    path: Path, seeds: list[int], settings=SETTINGS, speed: bool = True, figures=FIGURES, commit: str = "abc"
) -> Path:
    """A result folder as a machine leaves it (the fields the report reads), of the dense arm and the settings'
    other arm (``figures`` their reads, as ``FIGURES``)."""
    name = settings.arms[1].name
    for sub in ("train", "eval"):
        (path / sub).mkdir(parents=True)
    run = {"settings": json.loads(json.dumps(asdict(settings))), "sources": {"gguf": "/x/smol.gguf"}}
    run["calls"] = [{"device": "H200", "commit": commit, "command": "python -m experiments.real_extension", "exit": 0}]
    (path / "run.json").write_text(json.dumps(run))
    for seed in seeds:
        for model, tokens, density in (("dense", 1000.0, None), (name, 2500.0, 0.1)):
            summary = {"tokens_per_s_median": tokens, "density": density, "step_s": 1.0, "final_loss": 2.0}
            (path / "train" / f"seed{seed}_{model}.json").write_text(json.dumps(summary))
        reads = (("dense", "dense", "dense"), (name, "dense", "dense"), (name, "sparse", name))
        for (model, read, attention), read_figures in zip(reads, figures[seed]):
            cells = [cell(2048, 5.0, 90.0, 90.0, 50.0), cell(4096, *read_figures)]
            record = {"model": f"seed{seed}/{model}", "attention": attention, "cells": cells}
            (path / "eval" / f"seed{seed}_{model}__{read}.json").write_text(json.dumps(record))
    if speed:
        found = [{"length": n, "arms": {name: {"attention_speedup": x, "density": 0.1}}} for n, x in ((65536, 2.0), (131072, 3.5))]  # fmt: skip
        (path / "speed.json").write_text(json.dumps(found))
    return path


def test_changes_are_paired_by_seed_with_t_bounds_over_three_seeds(tmp_path):
    run = f"{folder(tmp_path / 'a', [0, 1])},{folder(tmp_path / 'b', [2], speed=False)}"  # one run, two machines
    path = report.write_report([run], tmp_path / "out")
    dense, adaptive = json.loads(path.read_text())["records"]
    assert dense["config"] == "dense" and dense["attention_speedup"] == {"65536": 1.0, "131072": 1.0}
    assert adaptive["seeds"] == [0, 1, 2] and adaptive["attention_speedup"] == {"65536": 2.0, "131072": 3.5}
    ppl = [100 * (FIGURES[s][1][0] / FIGURES[s][0][0] - 1) for s in (0, 1, 2)]
    niah = [FIGURES[s][1][1] - FIGURES[s][0][1] for s in (0, 1, 2)]
    ruler_sparse = [FIGURES[s][2][3] - FIGURES[s][0][3] for s in (0, 1, 2)]  # read sparse: against dense read dense

    def one_sided(values, sign):
        mean, se = sum(values) / 3, stats.tstd(values) / math.sqrt(3)
        return mean + sign * stats.t.ppf(0.95, 2) * se

    assert adaptive["ppl_change_pct"] == pytest.approx(sum(ppl) / 3)
    assert adaptive["ppl_change_hi"] == pytest.approx(one_sided(ppl, +1))
    assert adaptive["niah_change_lo"] == pytest.approx(one_sided(niah, -1))
    assert adaptive["sparse_read"]["ruler_change_lo"] == pytest.approx(one_sided(ruler_sparse, -1))
    nll = [(FIGURES[s][0][2] - FIGURES[s][1][2]) / 50 for s in (0, 1, 2)]  # the answers' loss: nats, not points
    at_4096 = adaptive["reads"]["dense"]["by_length"]["4096"]
    assert at_4096["niah_nll_change_hi"] == pytest.approx(one_sided(nll, +1))
    assert adaptive["reads"]["dense"]["worst"]["niah_nll_change_hi"] == pytest.approx(max(0.0, one_sided(nll, +1)))
    older = report.cell_metrics(cell(4096, *FIGURES[0][0]) | {"niah": {"score": 80.0, "forced": 70.0}})
    assert older["niah_nll"] is None and report.summarise({})["mean"] is None  # reads made before it was kept
    low, high = adaptive["reads"]["dense"]["by_length"]["4096"]["metrics"]["ppl"]["interval"]
    half = stats.t.ppf(0.975, 2) * stats.tstd(ppl) / math.sqrt(3)
    assert (low, high) == pytest.approx((sum(ppl) / 3 - half, sum(ppl) / 3 + half))
    worst = adaptive["reads"]["dense"]["worst"]  # 2048: every seed equal, so no change there
    assert worst["ppl_change_hi"] == pytest.approx(max(0.0, one_sided(ppl, +1)))
    assert adaptive["goal"]["seeds"] and adaptive["goal"]["speedup"] and adaptive["training"]["e2e_speedup"] == 2.5
    assert adaptive["goal"]["met"] is False  # NIAH's lower bound is below -3 points
    md = (tmp_path / "out" / "real_extension.md").read_text()
    assert "| adaptive | 3 | 3.50 |" in md and (tmp_path / "out" / "real_extension.png").exists()
    assert "NIAH prompts per length: 10 generated, 50 teacher-forced." in md


def test_a_speedup_of_layers_unlike_the_model_is_not_counted():
    """The speed stage's layers kept 0.165 of the pairs, the model 0.241 in training (v1024s2048 at 128K): their
    3.68x is not the model's, and the goal's speedup is not counted; within 10% it is."""
    worst = {"ppl_change_hi": 0.2, "niah_change_lo": 0.0, "ruler_change_lo": 0.0}
    record = {"length": 131072, "density": 0.241, "seeds": [0, 1, 2], "reads": {"dense": {"worst": worst}}}
    record |= {"attention_speedup": {131072: 3.68}, "attention_density": {131072: 0.165}}
    assert report.timed_unlike_model(record) and report.goal(record)["speedup"] is None
    assert not report.goal(record)["met"]
    like = record | {"attention_density": {131072: 0.23}}
    assert not report.timed_unlike_model(like) and report.goal(like) == {
        "seeds": True,
        "speedup": True,
        "ppl": True,
        "niah": True,
        "ruler": True,
        "met": True,
    }
    at_64k = record | {"length": 65536}  # timed at 128K, trained at 64K: no density of the model there to compare
    assert not report.timed_unlike_model(at_64k) and report.goal(at_64k)["speedup"] is True


def test_each_run_pairs_its_arms_with_its_own_dense_arm(tmp_path):
    adaptive_run, fixed_run = folder(tmp_path / "a", [0, 1, 2]), tmp_path / "b"
    for g, seeds in enumerate(([0, 2], [1])):  # a --parallel-gpus run: gpu<g>/ folders
        folder(fixed_run / f"gpu{g}", seeds, FIXED, speed=g == 0, figures=FIGURES_FIXED, commit="def")
    path = report.write_report([adaptive_run, fixed_run], tmp_path / "out")
    found = json.loads(path.read_text())["records"]
    assert [(r["config"], r["commit"], r["run"]) for r in found] == [
        ("dense", ["abc"], str(adaptive_run)), ("dense", ["def"], str(fixed_run)),
        ("adaptive", ["abc"], str(adaptive_run)), ("v1024s6144", ["def"], str(fixed_run)),
    ]  # fmt: skip
    adaptive, fixed = found[2:]
    own = [100 * (FIGURES_FIXED[s][1][0] / FIGURES_FIXED[s][0][0] - 1) for s in (0, 1, 2)]
    other = [100 * (FIGURES_FIXED[s][1][0] / FIGURES[s][0][0] - 1) for s in (0, 1, 2)]
    assert fixed["ppl_change_pct"] == pytest.approx(sum(own) / 3)
    assert fixed["ppl_change_pct"] != pytest.approx(sum(other) / 3)  # not against the other run's dense arm
    niah = [FIGURES_FIXED[s][2][1] - FIGURES_FIXED[s][0][1] for s in (0, 1, 2)]  # read sparse: [0, 0, 0]
    assert fixed["sparse_read"]["niah_change_lo"] == pytest.approx(sum(niah) / 3) == 0.0
    assert fixed["training"]["e2e_speedup"] == 2.5 and fixed["attention_speedup"] == {"65536": 2.0, "131072": 3.5}
    assert adaptive["ppl_change_pct"] == pytest.approx(sum(100 * (FIGURES[s][1][0] / FIGURES[s][0][0] - 1) for s in (0, 1, 2)) / 3)  # fmt: skip
    for run, record in ((adaptive_run, adaptive), (fixed_run, fixed)):  # each as its own run's report says
        alone = json.loads(report.write_report([run], tmp_path / run.name).read_text())["records"][1]
        assert alone == record
    md = (tmp_path / "out" / "real_extension.md").read_text()
    assert f"| abc | {adaptive_run} | abc | H200 | 0, 1, 2 | dense, adaptive |" in md
    assert f"| def | {fixed_run} | def | H200 | 0, 1, 2 | dense, v1024s6144 |" in md
    assert "| dense (abc) | dense | 4096 | 11.000 |" in md and "| dense (def) | dense | 4096 | 11.003 |" in md
    assert "| dense (abc) | - | 1.00 | 1000 | 1.00 |" in md and "| dense (def) | - | 1.00 | 1000 | 1.00 |" in md
    assert "| length | seed | dense (abc) | dense (def) | def vs abc % |" in md
    assert "| 4096 | 0 | 10.0000 | 10.0200 | +0.200 |" in md and "| 4096 | 1 | 11.0000 | 10.9900 | -0.091 |" in md
    assert "| 2048 | 2 | 5.0000 | 5.0000 | +0.000 |" in md
    assert "| adaptive | 3 | 3.50 |" in md and "| v1024s6144 | 3 | 3.50 |" in md


def test_an_arm_in_two_runs_is_refused(tmp_path):
    a, b = folder(tmp_path / "a", [0]), folder(tmp_path / "b", [0])
    with pytest.raises(ValueError, match=re.escape(f"arm adaptive is in {a} and {b}")):
        report.write_report([a, b], tmp_path / "out")
    with pytest.raises(ValueError, match="seed0_adaptive is in"):  # one run holds a seed once
        report.write_report([f"{a},{b}"], tmp_path / "out")
    other = folder(tmp_path / "c", [0], replace(FIXED, steps=99))
    with pytest.raises(ValueError, match=r"differ in \['steps'\]"):  # runs compare only when trained alike
        report.write_report([a, other], tmp_path / "out")


def test_one_run_names_no_runs(tmp_path):
    path = report.write_report([folder(tmp_path / "a", [0, 1, 2])], tmp_path / "out")
    md = (tmp_path / "out" / "real_extension.md").read_text()
    assert "devices ['H200']; commits ['abc']. Changes are the arm's model minus the dense arm's model read" in md
    assert "## Runs" not in md and "Dense arm across runs" not in md and "(abc)" not in md
    assert "| dense | dense | 4096 | 11.000 |" in md and "| dense | - | 1.00 | 1000 | 1.00 |" in md
    assert json.loads(path.read_text())["default"] == "adaptive"


def test_under_three_seeds_the_means_come_without_bounds(tmp_path):
    path = report.write_report([folder(tmp_path / "a", [0, 1])], tmp_path / "out")
    adaptive = json.loads(path.read_text())["records"][1]
    assert adaptive["niah_change_lo"] is None and adaptive["ppl_change_hi"] is None
    assert adaptive["ppl_change_pct"] is not None and adaptive["goal"]["met"] is False
    assert "2 seed(s): means only" in (tmp_path / "out" / "real_extension.md").read_text()


def test_a_seed_split_by_arm_over_parts_pools_as_one(tmp_path):
    """--parallel-gpus puts seed 2's arms on two GPUs (gpu0_1, gpu1_1): the report is the one of whole folders."""
    whole = report.write_report([folder(tmp_path / "whole", [0, 1, 2])], tmp_path / "a")
    run = tmp_path / "split"
    folder(run / "gpu0", [0])
    folder(run / "gpu1", [1], speed=False)
    for part, keep in (("gpu0_1", "adaptive"), ("gpu1_1", "dense")):
        folder(run / part, [2], speed=False)
        for path in [*(run / part / "train").iterdir(), *(run / part / "eval").iterdir()]:
            if path.stem.split("__")[0] != f"seed2_{keep}":
                path.unlink()
    split = report.write_report([run], tmp_path / "b")
    records = lambda path: [r | {"run": None} for r in json.loads(path.read_text())["records"]]  # noqa: E731
    assert records(split) == records(whole)


def test_folders_that_do_not_pair_are_refused(tmp_path):
    a = folder(tmp_path / "a", [0])
    with pytest.raises(ValueError, match="seed0_adaptive is in"):
        report.pool([report.load_folder(a), report.load_folder(folder(tmp_path / "b", [0]))])
    other = folder(tmp_path / "c", [1], replace(SETTINGS, steps=99))
    with pytest.raises(ValueError, match=r"differ in \['steps'\]"):
        report.pool([report.load_folder(a), report.load_folder(other)])
    more = folder(tmp_path / "d", [1], replace(SETTINGS, niah_forced_prompts=50))  # forced columns of other sizes
    with pytest.raises(ValueError, match=r"differ in \['niah_forced_prompts'\]"):
        report.pool([report.load_folder(a), report.load_folder(more)])
    with pytest.raises(ValueError, match="no run.json"):
        report.load_folder(tmp_path)


def test_arms_are_read_from_their_names():
    assert arm("adaptive") == ADAPTIVE and arm("dense") == Arm("dense", False)
    assert arm("v1024s2048c64") == Arm("v1024s2048c64", True, None, 1024, 2048, 64)
    assert arm("t90v4096s4096").threshold == 0.9
    for bad in ("v1024", "sparse", "t0v1s1"):
        with pytest.raises(ValueError, match="arm"):
            arm(bad)
    fields = ADAPTIVE.pattern(8192, PRESETS["gpu"])
    assert fields == dict(v_size=4096, s_size=4096, last_q=64, local_window=128, sink_tokens=4, threshold=0.9)
    assert ADAPTIVE.pattern(4096, PRESETS["gpu"])["v_size"] == 2048  # a prompt is shorter than its length


def test_rope_and_settings_checks_name_the_option():
    assert rope_scaling(65536, 8192) == {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192}
    with pytest.raises(ValueError, match="--length"):
        rope_scaling(8192, 8192)
    gpu = PRESETS["gpu"]
    gpu.check()
    assert gpu.forced_prompts == gpu.niah_prompts and replace(gpu, niah_forced_prompts=50).forced_prompts == 50
    for changes, option in (
        (dict(length=65536 + 128), "--length"),
        (dict(arms=(ADAPTIVE,)), "--arms"),
        (dict(default_arm="v1s1"), "--default"),
        (dict(seeds=(0, 0)), "--seeds"),
        (dict(speed_repeats=3), "--speed-repeats"),
        (dict(ruler_tasks=("qa",)), "--ruler-tasks"),
        (dict(niah_prompts=10, niah_forced_prompts=9), "--niah-forced-prompts"),
        (dict(earlier=((131072, 30),)), "--schedule"),  # longer than the last phase
        (dict(earlier=((32768, 30), (16384, 30))), "--schedule"),
        (dict(earlier=((32768 + 64, 30),)), "--schedule"),  # not whole blocks
        (dict(earlier=((32768, 0),)), "--schedule"),
        (dict(speed_arms=(ADAPTIVE,)), "--speed-arms"),  # trained already
        (dict(speed_arms=(arm("dense"),)), "--speed-arms"),
    ):
        with pytest.raises(ValueError, match=option):
            replace(gpu, **changes).check()
    replace(gpu, earlier=((32768, 30),), speed_arms=(arm("v1024s2048"),)).check()
    assert replace(gpu, earlier=((32768, 10),)).schedule == ((32768, 10), (65536, 30))


def test_the_schedule_option_sets_every_phase_and_refuses_a_conflict():
    parse = lambda *a: settings_of(cli.parser().parse_args(list(a)))  # noqa: E731
    s = parse("--schedule", "65536:30", "131072:20")
    assert (s.earlier, s.length, s.steps) == (((65536, 30),), 131072, 20)
    assert s.costs.calibration.length == 131072  # priced from the run at its last length
    with pytest.raises(ValueError, match="--length 65536 is not the last phase"):
        parse("--schedule", "65536:30", "131072:20", "--length", "65536")
    with pytest.raises(SystemExit):
        parse("--schedule", "65536-30")


def test_rope_final_scales_every_phase_for_the_last_length(tmp_path):
    parse = lambda *a: settings_of(cli.parser().parse_args(list(a)))  # noqa: E731
    for extra, factors in (((), [8.0, 16.0]), (("--rope-final",), [16.0, 16.0])):
        s = parse("--schedule", "65536:30", "131072:30", *extra)
        exp = Experiment(s, Sources(None), tmp_path / "w", tmp_path / "o")  # no model yet: native 8192
        rope = [exp.train_config(0, arm("dense"), phase)["model"]["rope_parameters"] for phase in (0, 1)]
        assert [r["factor"] for r in rope] == factors
        assert {r["original_max_position_embeddings"] for r in rope} == {8192}
    staged = {"earlier": [[65536, 30]], "length": 131072, "steps": 30}
    assert "(each phase from the one before's model)" in report.schedule(staged)  # runs made before the option
    assert "the RoPE scaled for 131072 in every phase" in report.schedule(staged | {"rope_final": True})
    check_work(tmp_path / "k", SETTINGS)
    with pytest.raises(Refused, match=r"other \['rope_final'\]"):  # a work folder keeps its RoPE
        check_work(tmp_path / "k", replace(SETTINGS, rope_final=True))


def test_rope_theta_sets_one_base_for_every_phase_in_place_of_yarn(tmp_path):
    parse = lambda *a: settings_of(cli.parser().parse_args(list(a)))  # noqa: E731
    s = parse("--schedule", "65536:30", "131072:30", "--rope-theta", "4e6")
    exp = Experiment(s, Sources(None), tmp_path / "w", tmp_path / "o")
    rope = [exp.train_config(0, arm("dense"), phase)["model"]["rope_parameters"] for phase in (0, 1)]
    assert rope == [{"rope_type": "default", "rope_theta": 4e6}] * 2
    with pytest.raises(ValueError, match="leave out --rope-final"):
        parse("--schedule", "65536:30", "131072:30", "--rope-theta", "4e6", "--rope-final")
    staged = {"earlier": [[65536, 30]], "length": 131072, "steps": 30}
    assert "the RoPE base 4e+06 unscaled in every phase" in report.schedule(staged | {"rope_theta": 4e6})
    assert report.schedule({"steps": 30, "rope_theta": 4e6}) == "30 steps, the RoPE base 4e+06 unscaled"
    check_work(tmp_path / "k", SETTINGS)
    with pytest.raises(Refused, match=r"other \['rope_theta'\]"):  # a work folder keeps its RoPE
        check_work(tmp_path / "k", replace(SETTINGS, rope_theta=4e6))


def test_a_phase_not_longer_than_the_base_is_refused_before_it_trains(tmp_path):
    staged = replace(SETTINGS, earlier=((768, 1),))  # the base's native length is 8192 until it is converted
    exp = Experiment(staged, Sources(None), tmp_path / "w", tmp_path / "o")
    with pytest.raises(Refused, match="--schedule: the phase at 768 tokens is not longer than the base's native 8192"):
        exp.train(0, arm("dense"), 0)
    assert not (tmp_path / "w" / "runs").exists()


def test_a_work_folder_keeps_its_schedule(tmp_path):
    made_before = {k: v for k, v in json.loads(json.dumps(asdict(SETTINGS))).items() if k in cli.FIXED and k not in report.ADDED}  # fmt: skip
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "settings.json").write_text(json.dumps(made_before))  # before --schedule existed
    check_work(tmp_path / "old", SETTINGS)
    with pytest.raises(Refused, match=r"other \['earlier'\]"):
        check_work(tmp_path / "old", replace(SETTINGS, earlier=((768, 1),)))
    check_work(tmp_path, SETTINGS)
    check_work(tmp_path, replace(SETTINGS, seeds=(5,), speed_lengths=(1024,)))  # free to change between calls
    with pytest.raises(Refused, match=r"other \['lr'\]"):
        check_work(tmp_path, replace(SETTINGS, lr=1.0))


def test_estimates_count_flops_else_the_calibration_until_a_stage_is_measured(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    config = dict(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    (model / "config.json").write_text(json.dumps(config | dict(intermediate_size=1536, vocab_size=49152)))
    assert Shape.of(model) == Shape()  # SmolLM2-135M's, which the estimates assume before the conversion
    timings = Timings(tmp_path / "timings.json")
    estimate = Estimator(replace(PRESETS["gpu"], costs=PRESETS["toy"].costs), Shape.of(model), timings)
    flops = 4 * Shape().forward_flops(65536)
    assert estimate.train_step(Arm("dense", False), 65536).seconds == pytest.approx(flops / 2e9)
    estimate = Estimator(PRESETS["gpu"], Shape.of(model), timings)
    assert estimate.train(ADAPTIVE, 65536, 30).source == "calibrated"
    timings.record("train:adaptive:65536:step", 0.5)
    timings.record("train:adaptive:fixed", 20.0)
    found = Estimator(PRESETS["gpu"], Shape(), Timings(tmp_path / "timings.json")).train(ADAPTIVE, 65536, 30)
    assert found.source == "here" and found.seconds == pytest.approx(35.0)


def test_niah_by_depth_is_the_forced_score_per_depth_over_seeds(tmp_path):
    run = folder(tmp_path / "a", [0, 1, 2])
    for seed, hits in ((0, (1.0, 0.0)), (1, (1.0, 1.0)), (2, (0.0, 0.0))):  # depth 0: 2 of 3; depth 100: 1 of 3
        path = run / "eval" / f"seed{seed}_dense__dense.json"
        read = json.loads(path.read_text())
        records = [{"depth": d, "forced_score": h, "generated": False} for d, h in zip((0, 100), hits)]
        read["cells"][1]["niah"]["records"] = records
        path.write_text(json.dumps(read))
    report.write_report([str(run)], tmp_path / "out")
    md = (tmp_path / "out" / "real_extension.md").read_text()
    table = md.split("## NIAH by needle depth")[1].split("##")[0]
    assert "| model | read | length | 0% | 100% |" in table and "| dense | dense | 4096 | 67 | 33 |" in table
    assert "adaptive" not in table  # reads without per-prompt records are left out


def test_recipes_sets_dense_models_of_different_recipes_side_by_side(tmp_path):
    slow = folder(tmp_path / "screen" / "lr2e5", [0], replace(SETTINGS, lr=2e-5), speed=False)
    base = folder(tmp_path / "earlier" / "gpu0", [0], speed=False)
    with pytest.raises(ValueError, match="differ in"):  # the paired report refuses them
        report.write_report([base, slow], tmp_path / "out")
    path = recipes.write_recipes([base, slow], tmp_path / "out", "screen")
    runs = {run["label"]: run for run in json.loads(path.read_text())["runs"]}
    assert set(runs) == {"earlier/gpu0", "screen/lr2e5"}
    assert runs["screen/lr2e5"]["recipe"]["lr"] == 2e-5 and runs["earlier/gpu0"]["recipe"]["lr"] == SETTINGS.lr
    assert set(runs["screen/lr2e5"]["reads"]) == {"seed0_dense__dense"}  # the other arm's model is left out
    assert runs["screen/lr2e5"]["reads"]["seed0_dense__dense"]["4096"]["niah_forced"] == FIGURES[0][0][2]
    assert runs["screen/lr2e5"]["training"] == {"final_loss": 2.0, "step_s": 1.0, "peak_mem_gb": None, "seeds": [0]}
    md = path.with_suffix(".md").read_text()
    assert "| screen/lr2e5 | abc | 0 | 30 steps | 2e-05 | 2.000 |" in md
    assert "| dense (earlier/gpu0) | dense | 4096 | 10.000 | 80.0 | 70.0 |" in md

"""Sizing the GPU calls without a GPU: read estimates calibrated from the first runs' measurements (a sparse read
never below the dense read at its length), the scheduler refusing a stage that does not fit the call, every cell
written to --out and the archive at once, partial folders reported with what is missing, seeds spread over fake
GPUs, and the session plan's calls under the limit."""

from __future__ import annotations

import json
import tarfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

from experiments.common.stages import Clock, OutOfTime
from experiments.real_extension import cli, evaluation, parallel, pipeline, report, session
from experiments.real_extension.costs import Estimate, Estimator, Shape, Timings
from experiments.real_extension.pipeline import Experiment, Sources, Stage
from experiments.real_extension.settings import ADAPTIVE, PRESETS, Arm, Calibration, Costs, H200_4aa96df, H200_95b3127

# The first GPU runs' figures (reads at 20 NIAH prompts, 7 x 2 RULER-style, 8 windows; one 64K sparse read cut at
# 150 s): a calibration with every kind of entry.
FIRST_RUNS = Calibration(
    source="test",
    device="NVIDIA H200",
    length=65536,
    read_items=(20, 14, 8),
    read_s={"dense": {8192: 53.0, 16384: 44.0, 32768: 44.0, 65536: 172.0}, "sparse": {8192: 36.0, 16384: 39.0}},
    read_at_least={"sparse": {65536: 150.0}},
    train_step_s={"dense": 1.61, "adaptive": 1.01},
    train_fixed_s=38.7,
    convert_s=40.0,
    base_s=36.0,
    base_prompts=20,
)
GPU = replace(PRESETS["gpu"], costs=Costs(calibration=FIRST_RUNS))
DENSE = Arm("dense", False)


def test_read_estimates_start_from_what_the_first_runs_measured(tmp_path):
    est = Estimator(GPU, Shape(), Timings(tmp_path / "timings.json"))
    dense = est.cell(DENSE, 65536)
    assert dense.source == "calibrated" and dense.seconds == pytest.approx(172.0)  # the measured 168-172 s
    assert est.cell(ADAPTIVE, 65536).seconds >= dense.seconds  # cut at 150 s: never below the dense read
    assert est.cell(ADAPTIVE, 8192).seconds == pytest.approx(53.0)  # measured 36 s, but the dense read took 53
    assert est.cell(DENSE, 131072).seconds > dense.seconds  # beyond the table: scaled by FLOPs, not cheaper
    half = Estimator(replace(GPU, niah_prompts=10, ruler_samples=1, ppl_windows=4), Shape(), est.timings)
    assert half.cell(DENSE, 65536).seconds == pytest.approx(172.0 / 2)  # per item: (10 + 7 + 4) of 42
    assert est.train(ADAPTIVE, 65536, 30).seconds == pytest.approx(FIRST_RUNS.train_fixed_s + 30 * 1.01)
    assert est.base(8192).seconds == pytest.approx(36.0 * GPU.base_prompts / 20)  # per base prompt, not per read


def test_the_speed_stage_starts_from_its_measured_time_scaled_by_the_arms(tmp_path):
    cal = replace(FIRST_RUNS, speed_s={131072: 4.8, 524288: 93.6})  # measured with one sparse arm on 3 layers
    three = replace(GPU, costs=Costs(calibration=cal), speed_layers=(3, 15, 27))
    one = Estimator(three, Shape(), Timings(tmp_path / "timings.json"))
    assert one.speed(524288).source == "calibrated" and one.speed(524288).seconds == pytest.approx(93.6)
    two = Estimator(replace(one.s, arms=(*one.s.arms, Arm("v1024s2048", True, v_size=1024, s_size=2048))), Shape(), one.timings)  # fmt: skip
    assert two.speed(524288).seconds == pytest.approx(93.6 * 2.0 / 1.5)  # dense + two arms at a quarter each
    every_third = Estimator(replace(three, speed_layers=None), Shape(), one.timings)  # layers 0, 3, ..., 27 of 30
    assert every_third.s.timed_layers(30) == tuple(range(0, 30, 3))
    assert every_third.speed(524288).seconds == pytest.approx(93.6 * 10 / 3)
    assert one.speed(65536).source == "flops"  # a length the calibration lacks
    one.timings.record("speed:524288", 60.0)
    assert one.speed(524288) == Estimate(60.0, "here")


def test_measured_tasks_replace_the_calibration_and_sparse_keeps_the_dense_floor(tmp_path):
    timings = Timings(tmp_path / "timings.json")
    timings.record("read:sparse:65536:niah", 1.0)
    timings.record("read:dense:65536:niah", 3.0)
    est = Estimator(GPU, Shape(), timings)
    assert est.per_item(ADAPTIVE, 65536, "niah") == Estimate(3.0, "here")
    assert est.per_item(ADAPTIVE, 65536, "ppl").source == "calibrated"
    assert est.cell(ADAPTIVE, 65536).source == "calibrated"  # the least trusted of its parts
    only_niah = est.cell(DENSE, 65536, niah_only=20)
    assert only_niah == Estimate(60.0, "here")


def test_a_longer_read_is_expected_from_a_shorter_one_measured_here(tmp_path):
    """The machine's own figure at 32K, scaled by FLOPs, wins over the calibration's 128K scaling, not over what the
    calibration measured at 64K itself (the scaling is an upper bound: it priced the staged run's 128K reads at
    146-160 s, which took 89-108 s)."""
    timings = Timings(tmp_path / "timings.json")
    timings.record("read:dense:16384:ppl", 0.5)
    timings.record("read:dense:32768:ppl", 1.0)
    est = Estimator(GPU, Shape(), timings)
    ratio = Shape().forward_flops(131072) / Shape().forward_flops(32768)
    assert est.per_item(DENSE, 131072, "ppl") == Estimate(pytest.approx(ratio), "scaled")
    assert est.per_item(DENSE, 32768, "ppl") == Estimate(1.0, "here")
    assert est.per_item(DENSE, 65536, "ppl").source == "calibrated"  # measured there by the calibration
    timings.record("read:sparse:65536:niah_forced", 2.0)
    only_dense = Estimator(replace(GPU, costs=Costs(calibration=H200_4aa96df)), Shape(), timings)
    scaled = 2.0 * Shape().forward_flops(131072) / Shape().forward_flops(65536)
    assert only_dense.per_item(ADAPTIVE, 131072, "niah_forced") == Estimate(pytest.approx(scaled), "scaled")
    assert only_dense.per_item(DENSE, 131072, "niah_forced").source == "calibrated"  # its own kind measured there
    assert est.per_item(DENSE, 8192, "ppl").source == "calibrated"  # nothing shorter measured
    assert est.per_item(ADAPTIVE, 131072, "ppl").source == "calibrated"  # no sparse read measured here yet
    assert Estimate(1.0, "scaled").margin > Estimate(1.0, "here").margin


def test_a_longer_sparse_read_grows_as_the_dense_read_measured_here(tmp_path):
    """A sparse read scaled from a shorter one grows as the dense reads measured here grew between the two lengths,
    not by FLOPs (which priced the v1024s2048 run's 128K sparse reads at up to 147 s; they took 62-69 s), and never
    below the dense read at its length."""
    timings = Timings(tmp_path / "timings.json")
    for n, dense_s in ((32768, 1.0), (65536, 1.5), (131072, 3.0)):
        timings.record(f"read:dense:{n}:niah", dense_s)
    timings.record("read:sparse:65536:niah", 2.0)
    est = Estimator(replace(GPU, costs=Costs(calibration=H200_4aa96df)), Shape(), timings)
    assert est.per_item(ADAPTIVE, 131072, "niah") == Estimate(pytest.approx(2.0 * 3.0 / 1.5), "scaled")
    cheap = Timings(tmp_path / "cheap.json")
    for key, seconds in (("dense:65536", 1.5), ("dense:131072", 3.0), ("sparse:65536", 0.5)):
        cheap.record(f"read:{key}:niah", seconds)
    floor = Estimator(est.s, Shape(), cheap).per_item(ADAPTIVE, 131072, "niah")
    assert floor == Estimate(3.0, "scaled")  # 0.5 x 2 = 1.0 grown, but the dense read there took 3.0
    timings.record("read:sparse:65536:ppl", 1.0)  # no dense ppl read measured here: by FLOPs
    flops = Shape().forward_flops(131072) / Shape().forward_flops(65536)
    assert est.per_item(ADAPTIVE, 131072, "ppl") == Estimate(pytest.approx(flops), "scaled")


def test_a_run_at_128k_is_priced_from_the_128k_run(tmp_path):
    """--length 131072 takes the calibration measured at 128K; its sparse reads, never measured, at least its dense."""
    run = ["--niah-prompts", "10", "--ruler-samples", "1", "--ppl-windows", "4"]  # that run's reads
    args = cli.parser().parse_args([*run, "--length", "131072", "--arms", "dense", "v1024s6144", "--default", "v1024s6144"])  # fmt: skip
    s = cli.settings_of(args)
    assert s.costs.calibration is H200_4aa96df
    assert cli.settings_of(cli.parser().parse_args([])).costs.calibration is H200_95b3127
    est = Estimator(s, Shape(), Timings(tmp_path / "timings.json"))
    assert est.cell(DENSE, 131072) == Estimate(pytest.approx(63.5), "calibrated")  # 21 items at 63.5 / 21 s
    sparse = Arm("v1024s6144", True, v_size=1024, s_size=6144)
    assert est.cell(sparse, 131072) == est.cell(DENSE, 131072)
    assert est.train_step(sparse, 131072) == Estimate(3.40, "calibrated")
    assert est.train_step(sparse, 65536) == Estimate(1.64, "calibrated")  # an earlier phase: the 64K run's dense


def test_the_speed_stage_runs_again_for_arms_it_has_not_timed(tmp_path):
    settings = replace(PRESETS["toy"], speed_arms=(Arm("v32s32", True, v_size=32, s_size=32),), speed_docs=2)
    exp = Experiment(settings, Sources(None), tmp_path / "w", tmp_path / "o")
    first, second = [st for st in exp.stages() if st.name.startswith("speed at 1024")]
    assert (first.name, second.name) == ("speed at 1024, document 1 of 2", "speed at 1024, document 2 of 2")
    (exp.work / "speed" / "1024").mkdir(parents=True)
    (exp.work / "speed" / "1024" / "doc0.json").write_text(json.dumps({"arms": {"t90v32s64": {}}}))
    assert not first.done()  # timed before --speed-arms named v32s32
    (exp.work / "speed" / "1024" / "doc0.json").write_text(json.dumps({"arms": {"t90v32s64": {}, "v32s32": {}}}))
    assert first.done() and not second.done()  # each document its own stage


def test_prompts_read_teacher_forced_alone_cost_a_prefill_each(tmp_path):
    """Their own term (``niah_forced``): a measured prefill per prompt where the calibration has one (a sparse read's
    at least the dense read's), else the FLOPs of one prefill (no generated tokens); measured here, it wins."""
    more = replace(PRESETS["gpu"], niah_prompts=10, niah_forced_prompts=50, ruler_samples=1, ppl_windows=4)
    timings = Timings(tmp_path / "timings.json")
    est = Estimator(more, Shape(), timings)
    assert est.items()["niah"] == 10 and est.items()["niah_forced"] == 40
    calibration = more.costs.calibration
    assert est.per_item(DENSE, 65536, "niah_forced") == Estimate(calibration.prefill_s["dense"][65536], "calibrated")
    alone = est.per_item(ADAPTIVE, 16384, "niah_forced").seconds
    assert alone == calibration.prefill_s["sparse"][16384] > calibration.prefill_s["dense"][16384]
    fewer = Estimator(replace(more, niah_forced_prompts=None), Shape(), timings)
    assert est.cell(DENSE, 65536).seconds - fewer.cell(DENSE, 65536).seconds == pytest.approx(40 * 3.671)
    uncalibrated = Estimator(replace(GPU, niah_forced_prompts=GPU.niah_prompts + 5), Shape(), timings)
    flops = uncalibrated.per_item(DENSE, 8192, "niah_forced")
    generated = uncalibrated.per_item(DENSE, 8192, "niah")
    assert flops.source == "flops" and generated.source == "calibrated"
    assert flops.seconds == pytest.approx(Shape().forward_flops(8192) / GPU.costs.flops_per_s + GPU.costs.prompt_s)
    assert uncalibrated.cell(DENSE, 8192).source == "flops"  # the least trusted of its parts
    timings.record("read:dense:8192:niah_forced", 0.2)
    assert Estimator(more, Shape(), timings).per_item(DENSE, 8192, "niah_forced") == Estimate(0.2, "here")


def experiment(tmp_path: Path, settings=GPU, tar: bool = True) -> Experiment:
    return Experiment(settings, Sources(), tmp_path / "work", tmp_path / "out", tar=tmp_path / "r.tgz" if tar else None)


def test_a_stage_that_does_not_fit_the_call_is_not_started_and_times_are_logged(tmp_path):
    exp = experiment(tmp_path)
    ran = []
    slow = Stage("slow", lambda: False, lambda: Estimate(172.0, "calibrated"), lambda: ran.append("slow"))
    quick = Stage("quick", lambda: False, lambda: Estimate(1.0, "here"), lambda: ran.append("quick"))
    Clock.deadline = time.time() + 200  # 172 x 1.3 + 10 s does not fit
    try:
        with pytest.raises(OutOfTime):
            exp.run_stage(slow)
        exp.run_stage(quick)
    finally:
        Clock.deadline = None
    assert ran == ["quick"]
    (logged,) = json.loads((tmp_path / "out" / "stage_times.json").read_text())
    assert logged["stage"] == "quick" and logged["expected_s"] == 1.0 and logged["from"] == "here"
    assert "wall_s" in logged and (tmp_path / "r.tgz").exists()  # packed after the stage


def test_every_cell_reaches_out_and_the_archive_at_once_and_a_partial_folder_reports(tmp_path, monkeypatch):
    settings = replace(GPU, seeds=(0,), length=4096, eval_fractions=(2, 1))
    exp = experiment(tmp_path, settings)
    niah = {"score": 90.0, "forced": 90.0, "generated": 4, "prompts": 4}
    figures = {"ppl": {"buckets": [{"ppl": 3.0}]}, "niah": niah, "ruler": {"average": 40.0}}

    def fake(model, inputs, arm, n):
        return {"length": n, **figures, "density": None, "seconds": {"niah": {"s": 2.0, "items": 4}}}

    monkeypatch.setattr(evaluation, "read_length", fake)
    monkeypatch.setattr(Experiment, "model", lambda self, name: None)
    monkeypatch.setattr(Experiment, "inputs", lambda self, base_only=False: None)
    (tmp_path / "out").mkdir()
    pipeline.record_call(exp.out, settings, exp.sources, None)
    read = evaluation.Read("seed0/dense", DENSE)
    (first, second) = exp._read_cells(read)
    exp.run_stage(first)  # the call is cut after the first cell
    saved = json.loads((tmp_path / "out" / "eval" / "seed0_dense__dense.json").read_text())
    assert [c["length"] for c in saved["cells"]] == [2048] and saved["missing"] == [4096]
    assert saved["cells"][0]["expected_s"] > 0 and first.done() and not second.done()
    with tarfile.open(tmp_path / "r.tgz") as tar:
        assert "out/eval/seed0_dense__dense.json" in tar.getnames()
    assert exp.timings.get("read:dense:2048:niah") == pytest.approx(0.5)
    path = report.write_report([tmp_path / "out"], tmp_path / "report")
    lacking = json.loads(path.read_text())["missing"]
    assert "seed 0 dense read dense at 4096" in lacking and "training seed 0 adaptive" in lacking
    assert "seed 0 adaptive read sparse at 2048, 4096" in lacking
    assert "**Partial" in path.with_suffix(".md").read_text()


def test_seeds_spread_over_gpus_by_their_expected_seconds():
    arm_s = {"dense": 400.0, "adaptive": 600.0}
    parts = parallel.split((0, 1, 2, 3), arm_s, 2, base_check_s=40.0, base_read_s=300.0, speed_s=200.0, speed_arms=("adaptive",))  # fmt: skip
    assert [(p.gpu, p.seeds, p.arms, p.base_check, p.base_read, p.speed) for p in parts] == [
        (0, (0, 2), None, True, False, True),
        (1, (1, 3), None, False, True, False),
    ]  # the base read on the GPU without the base check, the speed stage then on the other
    (only,) = parallel.split((5,), {"dense": 1000.0}, 4, 40.0, None, None)  # GPUs without work are left out
    assert only == parallel.Part(0, (5,), True)
    with pytest.raises(ValueError, match="--parallel-gpus"):
        parallel.split((0,), arm_s, 0, 1.0, None, None)


def test_a_seed_left_over_is_split_by_arm():
    """3 seeds on 2 GPUs: seeds 0 and 1 whole, seed 2's arms one per GPU, run after the GPU's whole seed."""
    arm_s = {"dense": 400.0, "adaptive": 600.0}
    parts = parallel.split((0, 1, 2), arm_s, 2, 40.0, None, 100.0, speed_arms=("adaptive",))
    assert [(p.name, p.seeds, p.arms) for p in parts] == [
        ("gpu0", (0,), None), ("gpu0_1", (2,), ("adaptive",)), ("gpu1", (1,), None), ("gpu1_1", (2,), ("dense",)),
    ]  # fmt: skip
    assert parts[0].base_check and [p.name for p in parts if p.speed] == ["gpu1"]  # the less loaded GPU's whole seed
    # One seed on two GPUs: the speed stage's arms stay with the part that times them.
    parts = parallel.split((0,), {"dense": 400.0, "v1s2": 100.0, "adaptive": 600.0}, 2, 40.0, None, 100.0, ("v1s2", "adaptive"))  # fmt: skip
    assert [(p.gpu, p.arms, p.speed) for p in parts] == [(0, ("v1s2", "adaptive"), True), (1, ("dense",), False)]
    argv = ["--arms", "dense", "v1s2", "adaptive", "--default", "v1s2", "--steps", "5"]
    child = parallel.child_argv(argv, parts[1], Path("w"), Path("o"), None, None, None, "v1s2")
    assert child[:2] == ["--steps", "5"] and child[-4:] == ["--arms", "dense", "--default", "dense"]
    child = parallel.child_argv(argv, parts[0], Path("w"), Path("o"), None, None, None, "v1s2")
    assert (
        child[-5:] == ["--arms", "v1s2", "adaptive", "--default", "v1s2"] and "gpu0" in child[child.index("--out") + 1]
    )


def test_the_split_is_kept_for_the_next_call(tmp_path):
    settings = replace(PRESETS["toy"], seeds=(0, 1, 2))
    exp = Experiment(settings, Sources(None), tmp_path / "w", tmp_path / "o", False, True, False)
    exp.work.mkdir(parents=True)
    parts = parallel.plan_parts(exp, 2)
    assert [p.name for p in parts] == ["gpu0", "gpu0_1", "gpu1", "gpu1_1"]
    parallel.keep_parts(exp, 2, parts)
    exp.timings.record(
        f"train:dense:{settings.length}:step", 1e6
    )  # new timings would split otherwise; the kept split stands
    assert parallel.plan_parts(exp, 2) == parts
    trainings = lambda found: [(p.gpu, p.order, p.seeds, p.arms) for p in found]  # noqa: E731
    speed_at = [p.name for p in parts if p.speed]
    for base_read, speed in ((True, True), (False, False)):  # other stages: the trainings kept, new ones placed
        other = Experiment(settings, Sources(None), exp.work, exp.out, base_read, speed, False)
        moved = parallel.plan_parts(other, 2)
        assert trainings(moved) == trainings(parts)
        assert sum(p.base_read for p in moved) == base_read and sum(p.speed for p in moved) == speed
        assert [p.name for p in moved if p.speed] == (speed_at if speed else [])  # a stage kept where it ran
    everything = Experiment(settings, Sources(None), tmp_path / "w4", exp.out, True, True, True)
    everything.work.mkdir()
    first = parallel.plan_parts(everything, 4)
    parallel.keep_parts(everything, 4, first)
    less = parallel.plan_parts(Experiment(settings, Sources(None), everything.work, exp.out, True, True, False), 4)
    stages = lambda found: [(p.name, p.base_read, p.speed) for p in found]  # noqa: E731
    assert stages(less) == stages(first) and not any(p.base_check for p in less)  # the others stay put
    three = parallel.plan_parts(exp, 3)
    assert three != parts  # made for other GPUs: split anew, and kept in its place
    parallel.keep_parts(exp, 3, three)
    assert parallel.plan_parts(exp, 3) == three
    sub = parallel.part_experiment(exp, parts[1])
    assert [a.name for a in sub.s.arms] == list(parts[1].arms) and sub.s.seeds == (2,)
    assert sub.s.default_arm in parts[1].arms and sub.out == tmp_path / "o" / parts[1].name


def test_children_run_on_their_own_gpu_with_their_own_options(tmp_path, monkeypatch):
    argv = ["--seeds", "0", "1", "2", "--parallel-gpus", "2", "--work", "w", "--lr=0.001", "--no-speed", "--steps", "5"]
    part = parallel.Part(1, (1,), False, True, True)
    child = parallel.child_argv(argv, part, tmp_path / "w", tmp_path / "o", tmp_path / "r.tgz", 8.5, 7)
    assert child[:3] == ["--lr=0.001", "--steps", "5"] and child.count("--seeds") == 1
    assert child[child.index("--seeds") + 1 :][:2] == ["1", "--work"]
    assert str(tmp_path / "o" / "gpu1") in child and str(tmp_path / "r_gpu1.tgz") in child
    assert {"--no-base-check", "--base-read", "--speed"} <= set(child) and "--no-speed" not in child
    started, threads = [], []

    class Fake:
        def __init__(self, cmd, cwd, env):
            started.append((env["CUDA_VISIBLE_DEVICES"], cmd))
            threads.append(env["OMP_NUM_THREADS"])
            self.code = 3 if env["CUDA_VISIBLE_DEVICES"] == "1" else 0

        def wait(self):
            return self.code

    monkeypatch.setattr(parallel.subprocess, "Popen", Fake)
    (tmp_path / "w" / "model").mkdir(parents=True)
    parts = [parallel.Part(0, (0, 2), True), part]
    status = parallel.launch(parts, argv, tmp_path / "w", tmp_path / "o", None, 8.5, 7)
    assert status == 3 and sorted(gpu for gpu, _ in started) == ["0", "1"]  # one still has work: call again
    assert threads == ["1", "1"]  # torchrun's default for several processes on one host
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the user's setting stands
    parallel.launch(parts, argv, tmp_path / "w", tmp_path / "o", None, 8.5, 7)
    assert threads[2:] == ["4", "4"]
    assert (tmp_path / "w" / "gpu0" / "model").resolve() == tmp_path / "w" / "model"


def test_a_gpus_parts_run_in_turn_and_a_stop_ends_its_list(tmp_path, monkeypatch):
    started = []

    class Fake:
        def __init__(self, cmd, cwd, env):
            if "--part" in cmd and env["CUDA_VISIBLE_DEVICES"] == "0":
                raise OSError("no such interpreter")
            started.append(cmd[cmd.index("--out") + 1].rsplit("/", 1)[-1])
            self.code = 3 if env["CUDA_VISIBLE_DEVICES"] == "1" else 0

        def wait(self):
            return self.code

    monkeypatch.setattr(parallel.subprocess, "Popen", Fake)
    (tmp_path / "w" / "model").mkdir(parents=True)
    parts = [
        parallel.Part(0, (0,)), parallel.Part(0, (2,), arms=("dense",), order=1),
        parallel.Part(1, (1,)), parallel.Part(1, (2,), arms=("adaptive",), order=1),
    ]  # fmt: skip
    argv = ["--seeds", "0", "1", "2", "--arms", "dense", "adaptive"]
    assert parallel.launch(parts[2:], argv, tmp_path / "w", tmp_path / "o", None, 8.5, 7) == 3
    assert started == ["gpu1"]  # gpu1 stopped (3): gpu1_1 is left for the next call
    assert parallel.launch(parts[:2], argv, tmp_path / "w", tmp_path / "o", None, 8.5, 7) == 1
    assert started[1:] == ["gpu0"]  # gpu0_1's child could not start: an error, not "call again"


def test_the_session_plan_keeps_every_call_under_its_limit():
    train = session.Planned("train", 600.0, 120.0, stops=True, restart=60.0)
    reads = [session.Planned(f"read {i}", 172.0, 234.0) for i in range(3)]
    calls = session.simulate([session.Planned("corpus", 100.0, 140.0), session.Planned("convert", 40.0, 62.0)], {0: [train, *reads]}, 540.0, True)  # fmt: skip
    last = session.GGUF_PARTS - 1  # the call that brings the GGUF's last part
    assert calls[0].ran == {"shared": ["corpus"]} and all(c.ran == {} for c in calls[1:last])
    assert calls[last].ran["shared"] == ["convert"] and calls[last].ran["GPU 0"] == ["train (part)"]
    assert all(c.seconds <= 540 for c in calls)
    assert [n for c in calls for n in c.ran.get("GPU 0", [])][-3:] == ["read 0", "read 1", "read 2"]
    with pytest.raises(ValueError, match="more than a call"):
        session.simulate([], {0: [session.Planned("huge", 600.0, 790.0)]}, 540.0, False)


def test_plan_prints_the_next_session(capsys, tmp_path):
    cli.main(["--plan", "--parallel-gpus", "2", "--max-minutes", "9", "--work", str(tmp_path / "w"), "--niah-prompts", "10"])  # fmt: skip
    printed = capsys.readouterr().out  # planned as gpu_call.sh runs it (GGUF in parts), --tokenizer given or not
    assert (
        "GPU 0: seeds [0] + base check\nGPU 0, then: seeds [2] (adaptive)\n" in printed and "nvidia-h200-x2" in printed
    )
    assert "call 1: " in printed and "--tokenizer" not in printed
    calls = [line for line in printed.splitlines() if line.startswith("call ")]
    assert all(f".gguf/smollm2.gguf.part0{i}" in line for i, line in enumerate(calls[: session.GGUF_PARTS]))
    assert not any(".gguf/smollm2.gguf.part" in line for line in calls[session.GGUF_PARTS :])
    assert [".whl" in line for line in calls] == [True] + [False] * (len(calls) - 1)  # installed once a machine
    converted_in = printed.split("  shared: 1 stage(s): convert")[0].count("\ncall ")
    assert converted_in == session.GGUF_PARTS  # the call that brings the last part
    assert "gpu_call.sh --parallel-gpus 2 --max-minutes 9 --niah-prompts 10" in printed
    seconds = [int(line.split("~")[1].split("s")[0]) for line in printed.splitlines() if line.startswith("call ")]
    assert seconds and max(seconds) <= 600 - 30
    assert not (tmp_path / "w").exists()

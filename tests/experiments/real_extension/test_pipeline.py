"""The whole experiment at toy size on the CPU: a GGUF written by the test -> convert -> corpus (a folder of packages
and a prose archive) -> base check -> extend (2 steps, 1024 tokens, dense and a sparse arm, one process) -> every
read -> the speed stage (SDPA's math path as the dense reference) -> the report, for two machines' folders (seed 0
and seed 1) pooled; a call stopped by --max-minutes exits 3 and the same command finishes it; a base that clearly
does not retrieve exits 4."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.gguf_files import write_tiny_gguf

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
ARM = "t90v32s64"  # the toy preset's sparse arm


def inputs(tmp: Path) -> list[str]:
    """The toy's sources: a tiny GGUF pretrained at 512 tokens, three packages, a prose archive of two books."""
    write_tiny_gguf(tmp / "tiny.gguf", context=512)
    for name, src in (("mtdata", "data"), ("mteval", "eval"), ("mtring", "parallel/ring")):
        shutil.copytree(ROOT / "mtraining" / src, tmp / "site" / name, ignore=shutil.ignore_patterns("__pycache__"))
    with tarfile.open(tmp / "books.tar.xz", "w:xz") as tar:
        for book, line in (
            ("tides", "The tide came in over the flats at dusk. "),
            ("hills", "Sheep graze the hills. "),
        ):
            data = (line * 150).encode()
            info = tarfile.TarInfo(f"{book}/chapter1.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return ["--gguf", str(tmp / "tiny.gguf"), "--code", str(tmp / "site"), "--prose", str(tmp / "books.tar.xz")]


def experiment(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "experiments.real_extension", *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)


def test_the_pipeline_at_toy_size_over_two_folders(tmp_path):
    work = tmp_path / "work"
    common = ["--preset", "toy", *inputs(tmp_path), "--heldout", "code/mteval", "--work", work]
    common += ["--niah-forced-prompts", "3"]  # the toy's one NIAH prompt generated, two more teacher-forced alone

    planned = experiment(*common, "--plan", "--max-minutes", "1")
    assert planned.returncode == 0, planned.stderr
    assert (
        "train seed 0 dense" in planned.stdout and "speed at 1024" in planned.stdout and "to run: ~" in planned.stdout
    )
    assert not work.exists()  # a plan runs nothing

    a = experiment(*common, "--seeds", "0", "--out", tmp_path / "a", "--tar", tmp_path / "a.tgz")
    assert a.returncode == 0, a.stdout[-3000:] + a.stderr[-3000:]
    out = tmp_path / "a"
    reads = sorted(p.stem for p in (out / "eval").glob("*.json"))
    assert reads == ["base__dense", "seed0_dense__dense", f"seed0_{ARM}__dense", f"seed0_{ARM}__sparse"]
    sparse = json.loads((out / "eval" / f"seed0_{ARM}__sparse.json").read_text())
    assert [c["length"] for c in sparse["cells"]] == [512, 1024] and all(0 < c["density"] < 1 for c in sparse["cells"])
    cell = sparse["cells"][-1]
    assert {r["task"] for r in cell["ruler"]["records"]} == {"niah_multikey", "vt"}
    assert all("forced_nll" in r for r in cell["niah"]["records"])  # teacher-forced beside generation
    assert [r["generated"] for r in cell["niah"]["records"]] == [True, False, False]
    assert (cell["niah"]["prompts"], cell["niah"]["generated"]) == (3, 1) and cell["phases"]["prefills"] > 3
    assert cell["seconds"]["niah"]["items"] == 1 and cell["seconds"]["niah_forced"]["items"] == 2
    assert "read:sparse:1024:niah_forced" in json.loads((work / "timings.json").read_text())
    trained = json.loads((out / "train" / f"seed0_{ARM}.json").read_text())
    assert trained["steps"] == 2 and 0 < trained["density"] < 1 and trained["step_s"] > 0
    assert trained["config"]["model"]["rope_parameters"] == {
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512,
    }  # fmt: skip
    (speed,) = json.loads((out / "speed.json").read_text())
    assert speed["length"] == 1024 and speed["arms"][ARM]["attention_speedup"] > 0
    assert set(speed["layers"]) == {"0"}  # every third layer of the toy's two: the first
    with tarfile.open(tmp_path / "a.tgz") as tar:
        assert "a/speed.json" in tar.getnames() and "a/run.json" in tar.getnames()

    # machine B: seed 1 only; its first call stops at the deadline (exit 3), the same command finishes it
    b = [*common, "--seeds", "1", "--out", tmp_path / "b", "--no-speed", "--no-base-read"]
    stopped = experiment(*b, "--max-minutes", "0.02")
    assert stopped.returncode == 3, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    assert "run the same command again" in stopped.stdout
    finished = experiment(*b)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    calls = json.loads((tmp_path / "b" / "run.json").read_text())["calls"]
    assert [c["exit"] for c in calls] == [3, 0]

    pooled = experiment("--report-from", f"{tmp_path / 'a'},{tmp_path / 'b'}", "--report-out", tmp_path / "report")
    assert pooled.returncode == 0, pooled.stderr
    records = json.loads((tmp_path / "report" / "real_extension.json").read_text())["records"]
    dense, arm = records
    assert dense["config"] == "dense" and dense["ppl_change_pct"] == 0.0 and dense["attention_speedup"] == {"1024": 1.0}
    assert arm["config"] == ARM and arm["seeds"] == [0, 1] and arm["length"] == 1024 and arm["gpus"] == 1
    assert arm["ppl_change_pct"] is not None and arm["ppl_change_hi"] is None  # 2 seeds: means, no bounds
    assert "no interval over seeds" in arm["reads"]["dense"]["by_length"]["1024"]["metrics"]["ppl"]["note"]
    assert arm["sparse_read"]["ppl_change_pct"] is not None and arm["attention_speedup"]["1024"] > 0
    md = (tmp_path / "report" / "real_extension.md").read_text()
    assert "2 seed(s): means only" in md and "NIAH prompts per length: 1 generated, 3 teacher-forced." in md
    assert (tmp_path / "report" / "real_extension.png").stat().st_size > 0

    again = experiment(*common, "--seeds", "0", "--out", tmp_path / "a", "--steps", "3")
    assert again.returncode == 2 and "other ['steps']" in again.stdout  # a work folder keeps its schedule

    gated = experiment(*common, "--seeds", "0", "--out", tmp_path / "c", "--base-gate", "50", "--base-prompts", "8")
    assert gated.returncode == 4 and "clearly below 50%" in gated.stdout, gated.stdout[-3000:]


def test_the_arms_train_through_the_striped_ring_on_two_ranks(tmp_path):
    out = tmp_path / "ring"
    common = ["--preset", "toy", *inputs(tmp_path), "--heldout", "code/mteval", "--work", tmp_path / "work"]
    done = experiment(*common, "--gpus", "2", "--seeds", "0", "--out", out, "--no-speed", "--no-base-read")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2 steps at 1024 tokens on 2 rank(s)" in done.stdout
    for name in ("dense", ARM):
        trained = json.loads((out / "train" / f"seed0_{name}.json").read_text())
        assert trained["config"]["parallel"]["context"] == 2 and trained["config"]["attention"]["layout"] == "striped"
    assert 0 < json.loads((out / "train" / f"seed0_{ARM}.json").read_text())["density"] < 1
    reported = experiment("--report-from", out, "--report-out", tmp_path / "report")
    assert reported.returncode == 0, reported.stderr
    records = json.loads((tmp_path / "report" / "real_extension.json").read_text())["records"]
    assert [r["gpus"] for r in records] == [2, 2]


def test_a_staged_schedule_trains_each_phase_from_the_one_before_and_times_candidates(tmp_path):
    """--schedule 768:1 1024:2: each arm trains 1 step at 768 tokens (YaRN x1.5), then 2 at 1024 from that export
    (YaRN x2); the last phase's model is read, and with --read-earlier the first phase's too, up to 768 tokens.
    --speed-arms times a candidate it does not train, on each of --speed-backends."""
    out, work = tmp_path / "staged", tmp_path / "work"
    common = ["--preset", "toy", *inputs(tmp_path), "--heldout", "code/mteval", "--work", work, "--seeds", "0"]
    common += ["--schedule", "768:1", "1024:2", "--speed-arms", "v32s32", "--no-base-read", "--no-sparse-reads"]
    done = experiment(*common, "--read-earlier", "--speed-backends", "auto", "torch", "--out", out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for name in ("dense", ARM):
        first = json.loads((out / "train" / "earlier" / f"seed0_{name}_at_768.json").read_text())
        last = json.loads((out / "train" / f"seed0_{name}.json").read_text())
        assert (first["steps"], first["length"], last["steps"], last["length"]) == (1, 768, 2, 1024)
        assert first["config"]["model"]["rope_parameters"]["factor"] == 1.5
        assert last["config"]["model"]["rope_parameters"]["factor"] == 2.0
        assert last["config"]["model"]["path"] == str(work / "runs" / "seed0" / f"{name}_at_768" / "export")
    reads = {p.stem: json.loads(p.read_text()) for p in (out / "eval").glob("*.json")}
    earlier = ["seed0_dense_at_768__dense", f"seed0_{ARM}_at_768__dense"]
    assert sorted(reads) == sorted(["seed0_dense__dense", f"seed0_{ARM}__dense", *earlier])
    assert [[c["length"] for c in reads[name]["cells"]] for name in earlier] == [[512], [512]]  # up to its 768
    assert all(not reads[name]["missing"] for name in earlier)
    speeds = json.loads((out / "speed.json").read_text())  # one record per backend, on the same Q/K
    assert [(r["length"], r["backend"]) for r in speeds] == [(1024, "auto"), (1024, "torch")]
    for speed in speeds:
        assert set(speed["arms"]) == {ARM, "v32s32"} and speed["model"] == f"seed0/{ARM}"
    reported = experiment("--report-from", out, "--report-out", tmp_path / "report")
    assert reported.returncode == 0, reported.stderr
    md = (tmp_path / "report" / "real_extension.md").read_text()
    assert "1 steps at 768, then 2 at 1024 tokens" in md and "| v32s32 on torch (timed only) |" in md
    assert f"| {ARM} on auto |" in md and f"| {ARM} on torch |" in md
    assert "| dense_at_768 | dense | 512 |" in md  # the earlier phase's model among the figures read
    (timed,) = json.loads((tmp_path / "report" / "real_extension.json").read_text())["timed_only"]
    assert timed["config"] == "v32s32" and timed["attention_speedup"]["1024"] > 0
    unstaged = experiment(*common[:-7], "--no-base-read", "--out", tmp_path / "other")
    assert unstaged.returncode == 2 and "other ['earlier']" in unstaged.stdout  # a work folder keeps its schedule


def test_three_seeds_on_two_gpus_split_the_last_seed_by_arm(tmp_path):
    """--parallel-gpus 2 with seeds 0-2: seeds 0 and 1 whole, seed 2's arms one per GPU after them; the report of
    the parts pairs every seed. With --no-sparse-reads every model is read dense only, and nothing is missing."""
    work = tmp_path / "work"
    common = ["--preset", "toy", *inputs(tmp_path), "--heldout", "code/mteval", "--work", work, "--no-base-read"]
    done = experiment(*common, "--seeds", "0", "1", "2", "--parallel-gpus", "2", "--no-base-check", "--no-sparse-reads")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    split = {line.split("s] ", 1)[-1] for line in done.stdout.splitlines() if ": seeds [2] (" in line}
    assert split == {"GPU 0: seeds [2] (t90v32s64)", "GPU 1: seeds [2] (dense)"} or split == {
        "GPU 0: seeds [2] (dense)", "GPU 1: seeds [2] (t90v32s64)",
    }  # fmt: skip
    parts = sorted(p.parent.name for p in (work / "out").glob("gpu*/run.json"))
    assert parts == ["gpu0", "gpu0_1", "gpu1", "gpu1_1"]
    assert not (work / "out" / "gpu0" / "base_check.json").exists()  # --no-base-check holds for the parts
    reported = experiment("--report-from", work / "out", "--report-out", tmp_path / "report", "--report-name", "split")
    assert reported.returncode == 0, reported.stderr
    assert not list((work / "out").glob("gpu*/eval/*__sparse.json"))
    md = (tmp_path / "report" / "split.md").read_text()
    assert "(split.png)" in md and "No model was read this way (`--no-sparse-reads`)." in md
    reported = json.loads((tmp_path / "report" / "split.json").read_text())
    dense, arm = reported["records"]
    assert arm["seeds"] == [0, 1, 2] and arm["ppl_change_hi"] is not None  # three pairs: a bound
    assert reported["missing"] == []


def test_variants_run_side_by_side_on_the_shared_corpus_each_reported_alone(tmp_path):
    """--variants: two dense-only recipes (the RoPE base raised, YaRN) on two GPUs, each its own folders with the
    parent's converted base and corpus linked in; each reports alone, with its RoPE in the heading."""
    work = tmp_path / "work"
    common = ["--preset", "toy", *inputs(tmp_path), "--heldout", "code/mteval", "--work", work, "--no-base-read"]
    common += ["--arms", "dense", "--default", "dense", "--no-base-check", "--no-speed", "--parallel-gpus", "2"]
    done = experiment(*common, "--variants", "theta=--rope-theta 40000", "yarn=--lr 5e-4")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "GPU 0: variant theta (--rope-theta 40000): seeds [0]" in done.stdout
    for name in ("theta", "yarn"):
        assert (work / name / "corpus").is_symlink() and (work / "out" / name / "eval").is_dir()
    trained = json.loads((work / "theta" / "runs" / "seed0" / "dense" / "export" / "config.json").read_text())
    assert trained["rope_parameters"]["rope_theta"] == 40000
    reported = experiment("--report-from", work / "out" / "theta", "--report-out", tmp_path / "r", "--report-name", "t")
    assert reported.returncode == 0, reported.stderr
    assert "the RoPE base 40000 unscaled" in (tmp_path / "r" / "t.md").read_text()
    refused = experiment(*common, "--variants", "long=--length 2048")
    assert refused.returncode == 2 and "a variant may change only the training recipe" in refused.stderr

"""``mtraining train`` as a stage: a subprocess (under torchrun for several ranks) that resumes from its checkpoint
when called again, gets SIGTERM at the call's deadline (it saves a checkpoint and stops), and leaves
``summary.json`` once finished: losses, density, step time, tokens per second and peak memory read from its
metrics, wall and CPU time summed over the calls it took."""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

from bench.common import commit

from .stages import Clock, OutOfTime, Refused, say, write_json

ROOT = Path(__file__).resolve().parents[2]


def read_metrics(run: Path) -> list[dict]:
    """The run's metrics.jsonl, one record per step (a resumed run's repeated steps: the last one; no event rows)."""
    path = run / "log" / "metrics.jsonl"
    by_step = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip().endswith("}"):
                record = json.loads(line)
                if "event" not in record:  # start / resume markers
                    by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def train(run: Path, config: dict, keep_checkpoints: bool = False) -> dict:
    """``mtraining train`` of ``config`` in ``run`` unless ``run/summary.json`` exists; returns the summary.

    Past the ``Clock.deadline`` the run gets SIGTERM (it saves a checkpoint and exits 143) and ``OutOfTime`` is
    raised; the next call resumes it from that checkpoint. Wall and CPU time add up over the calls
    (``segments.jsonl``: one line per call). A run folder trained with another seed is refused. The checkpoints
    are deleted once the export is written unless ``keep_checkpoints``."""
    summary_path, written_config = run / "summary.json", run / "train.yaml"
    if written_config.exists():  # a finished or interrupted run: its data order must be this one's
        before, now = yaml.safe_load(written_config.read_text())["train"]["seed"], config["train"]["seed"]
        if before != now:
            raise Refused(
                f"{run} was trained with seed {before}, this run asks for {now}: a run of another seed needs its "
                f"own --work (or delete {run})"
            )
    if summary_path.exists():
        return json.loads(summary_path.read_text())
    run.mkdir(parents=True, exist_ok=True)
    (run / "train.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    nproc = config["parallel"]["data"] * config["parallel"]["context"]
    cmd = [sys.executable, "-m", "mtraining.cli", "train", str(run / "train.yaml")]
    cmd += ["--nproc", str(nproc)] if nproc > 1 else []
    steps, seq = config["train"]["steps"], config["data"]["seq_len"]
    say(f"train {run.parent.name}/{run.name}: {steps} steps at {seq} tokens on {nproc} rank(s)")
    with Clock(children_only=True) as clock, open(run / "train.log", "a") as log:  # the training's CPU time
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        stopped = _wait(proc)
    with open(run / "segments.jsonl", "a") as f:
        f.write(json.dumps({"wall_s": clock.wall_s, "cpu_s": clock.cpu_s, "stopped": stopped}) + "\n")
    if stopped:
        say(f"  stopped at the deadline after {clock.wall_s:.0f}s wall (exit {proc.returncode}); resumes next call")
        raise OutOfTime("a training reached the deadline; it resumes from its checkpoint")
    if proc.returncode != 0:
        tail = "\n".join((run / "train.log").read_text().splitlines()[-15:])
        raise RuntimeError(f"training {run} failed (exit {proc.returncode}); the end of its train.log:\n{tail}")
    summary = summarise(run, config)
    if not keep_checkpoints:
        shutil.rmtree(run / "checkpoints", ignore_errors=True)  # the export is what later stages read
    write_json(summary_path, summary)
    extra = f", density {summary['density']:.3f}" if "density" in summary else ""
    extra += f", recall {summary['recall']:.3f}" if summary.get("recall") is not None else ""
    say(f"  loss {summary['final_loss']:.3f}, {summary['wall_s']:.0f}s wall, {summary['cpu_s']:.0f}s cpu{extra}")
    return summary


def summarise(run: Path, config: dict) -> dict:
    """A finished run's record from its metrics and segments: the loss curve, ``final_loss`` and ``tokens_per_s``
    (means of the last 10 steps), ``step_s`` and ``tokens_per_s_median`` (medians of the steps after the first,
    which pays for compilation), ``peak_mem_gb`` (the largest step's), and the means of ``density`` and ``recall``
    over the steps that logged them."""
    metrics = read_metrics(run)
    last = metrics[-10:]
    later = metrics[1:] or metrics
    segments = [json.loads(line) for line in (run / "segments.jsonl").read_text().splitlines()]
    summary = dict(
        run=f"{run.parent.name}/{run.name}",
        commit=commit(),
        config=config,
        wall_s=round(sum(seg["wall_s"] for seg in segments), 1),
        cpu_s=round(sum(seg["cpu_s"] for seg in segments), 1),
        calls=len(segments),
        steps=len(metrics),
        curve=[{k: m[k] for k in ("step", "loss", "density", "recall") if k in m} for m in metrics],
        final_loss=sum(m["loss"] for m in last) / len(last),
        tokens_per_s=sum(m["tokens_per_s"] for m in last) / len(last),
    )
    if all("step_s" in m for m in later):
        summary["step_s"] = statistics.median(m["step_s"] for m in later)
        summary["tokens_per_s_median"] = statistics.median(m["tokens_per_s"] for m in later)
    memory = [m["peak_mem_gb"] for m in metrics if m.get("peak_mem_gb") is not None]
    if memory:
        summary["peak_mem_gb"] = max(memory)
    densities = [m["density"] for m in metrics if "density" in m]
    recalls = [m["recall"] for m in metrics if "recall" in m]
    if densities:
        summary["density"] = sum(densities) / len(densities)
        summary["recall"] = sum(recalls) / len(recalls) if recalls else None
    return summary


def _wait(proc: subprocess.Popen) -> bool:
    """Wait for ``proc``; past ``Clock.deadline`` send it SIGTERM and wait for its exit. True if stopped so."""
    left = Clock.left()
    try:
        proc.wait(timeout=None if left is None else max(0.0, left))
        return False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        proc.wait()
        return True

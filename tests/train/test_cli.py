"""The README's main job, shrunk: `mtraining train CONFIG --nproc 2` under torchrun, checkpoint and export; and
a multi-node launch (two "nodes" of 2 ranks on this host) on the hierarchical ring."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TRAIN = [sys.executable, "-m", "mtraining.cli", "train", "configs/tiny_cpu.yaml"]


def _rows(log_dir: Path) -> tuple[list[dict], list[dict]]:
    """(events, step rows) of a metrics.jsonl."""
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "event" in r], [r for r in rows if "event" not in r]


@pytest.mark.slow
def test_train_with_torchrun_two_ranks_writes_metrics_checkpoint_and_export(tmp_path):
    overrides = [
        "parallel.context=2",
        "data.seq_len=256",
        "train.steps=3",
        "optim.warmup_steps=1",
        f"checkpoint.dir={tmp_path / 'ck'}",
        f"checkpoint.export_dir={tmp_path / 'hf'}",
        f"log.dir={tmp_path}",
        "log.every=1",
    ]
    run = subprocess.run([*TRAIN, "--nproc", "2", *overrides], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    events, rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3] and [e["event"] for e in events] == ["start"]
    assert all(0 < r["density"] <= 1 and 0 < r["recall"] <= 1 and r["tokens_per_s"] > 0 for r in rows)
    assert (tmp_path / "ck" / "step_00000003" / ".metadata").is_file()
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "tokenizer.json").is_file()
    world = "world: 2 ranks = data 1 x context 2 (flat ring; parallel.ring=auto: one node)"
    for line in (world, "attention: layer 0 dense; layers 1-3 sparse"):
        assert line in run.stdout, run.stdout
    assert run.stdout.count("model: qwen2") == 1  # one summary (rank 0), no progress bar off a terminal
    assert "train:" not in run.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_on_one_host_train_the_hierarchical_ring_like_the_flat_ring(tmp_path):
    """Two launches of `mtraining train --nproc 2 --nnodes 2 --node-rank N --rdzv-endpoint HOST:PORT` (gloo, a
    localhost rendezvous) form one job of 4 ranks; parallel.ring=hierarchical takes the ranks per node (2) as its
    inner rings. Its losses equal those of the flat ring over 4 ranks of one launch, to float32 rounding."""
    common = [
        "parallel.context=4",
        "data.seq_len=256",
        "train.steps=3",
        "optim.warmup_steps=1",
        "checkpoint.dir=null",
        "checkpoint.every=null",
        "checkpoint.export_dir=null",
        "log.every=1",
        "log.tensorboard=false",
    ]
    flat = subprocess.Popen(
        [*TRAIN, "--nproc", "4", *common, f"log.dir={tmp_path / 'flat'}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [
        subprocess.Popen(
            [*TRAIN, "--nproc", "2", "--nnodes", "2", "--node-rank", str(n), "--rdzv-endpoint", endpoint, *common]
            + ["parallel.ring=hierarchical", f"log.dir={tmp_path / 'nodes'}"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in (0, 1)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in (flat, *nodes)]
    for p, out in zip((flat, *nodes), outputs):
        assert p.returncode == 0, out[-4000:]
    hierarchical = "(hierarchical ring: 2 nodes x inner rings of 2; parallel.ring=hierarchical)"
    assert f"world: 4 ranks = data 1 x context 4 {hierarchical}" in outputs[1]
    assert "world: 4 ranks = data 1 x context 4 (flat ring; parallel.ring=auto: one node)" in outputs[0]
    assert "model: qwen2" not in outputs[2]  # node 1 holds ranks 2 and 3: no summary, no metrics
    (_, hierarchical), (_, reference) = _rows(tmp_path / "nodes"), _rows(tmp_path / "flat")
    assert [r["step"] for r in hierarchical] == [1, 2, 3]
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in hierarchical]), torch.tensor([r["loss"] for r in reference]), rtol=2e-5, atol=0
    )


def test_torchrun_command_for_one_node_and_several():
    import pytest

    from mtraining.train.torchrun import torchrun_command

    assert torchrun_command(4)[-2:] == ["--nproc-per-node=4", "--standalone"]
    assert torchrun_command(8, 4, 3, "node-0:29500")[-4:] == [
        "--nproc-per-node=8",
        "--nnodes=4",
        "--node-rank=3",
        "--rdzv-endpoint=node-0:29500",
    ]
    for args, expected in (
        ((8, 4, None, "node-0:29500"), "needs, on every node, --node-rank"),
        ((8, 4, 4, "node-0:29500"), "needs, on every node, --node-rank"),
        ((8, 4, 0, None), "--rdzv-endpoint HOST:PORT"),
        ((8, 4, 0, "node-0"), "must look like HOST:PORT"),
        ((8, 1, 1, None), "add --nnodes N"),
        ((8, 2, 0, "node-0:99999"), "port 99999 is not a port: give one of 1 .. 65535"),
        ((8, 2, 1, "node-0:0"), "port 0 is not a port"),
    ):
        with pytest.raises(ValueError, match=expected):
            torchrun_command(*args)

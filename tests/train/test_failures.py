"""Bad inputs and faults: each ends in one clear message that names the fix, with a documented exit
code, and nothing lost, hanging or silently wrong (issue 15; issue 14 item 8).

Grouped as in the issue: 1 divergence, 2 signals, 3 checkpoint integrity, 4 a stuck peer,
8 ordinary mistakes, and resume that changes the run. The runs are the tiny Qwen2 of
test_trainer.py (1 or 2 gloo ranks); the signal tests start the real launcher with torchrun.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from mtraining.cli import app
from mtraining.train.checkpoint import (
    MANIFEST,
    newest_verified,
    pick_checkpoint,
    read_manifest,
    save_checkpoint,
    verify_checkpoint,
)
from mtraining.train.config import ConfigError, load_config, parse_config
from mtraining.train.errors import Diverged, RankStalled, SaveFailed
from mtraining.train.launch import run_local
from tests.train.trainer_runs import RAW, SMALL_BUDGET, make_config, run_trainer

ROOT = Path(__file__).resolve().parents[2]
SHARD = "__0_0.distcp"  # the shard a one-rank run writes


def _message(fn, *args) -> str:
    """The message of the ValueError/RuntimeError that ``fn(*args)`` raises."""
    with pytest.raises((ValueError, RuntimeError)) as err:
        fn(*args)
    return str(err.value)


def _write_config(path: Path, *overrides: str) -> Path:
    """The test config with overrides as a YAML file (for the CLI)."""
    cfg = make_config(*SMALL_BUDGET, *overrides)
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path


def _invoke(args: list[str]) -> tuple[int, str]:
    """``mtraining ARGS`` in this process (run it in a run_local rank: the trainer joins its group)."""
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


# ---------------------------------------------------------------------------------------------- config table
# (issue group, overrides, what the message must say); every case must fail at load, naming the key
BAD_CONFIGS = [
    ("1 divergence", ["optim.lr=.nan"], "optim.lr: Input should be a finite number"),
    ("1 divergence", ["optim.lr=.inf"], "optim.lr: Input should be a finite number"),
    ("1 divergence", ["optim.lr=0"], "optim.lr: Input should be greater than 0"),
    ("1 divergence", ["optim.eps=.inf"], "optim.eps: Input should be a finite number"),
    ("1 divergence", ["optim.grad_clip=.inf"], "optim.grad_clip: Input should be a finite number"),
    ("1 divergence", ["optim.betas=[0.9, 1.5]"], "optim.betas[1]: Input should be less than 1"),
    ("1 divergence", ["optim.weight_decay=.nan"], "optim.weight_decay: Input should be a finite number"),
    ("1 divergence", ["train.seed=-1"], "train.seed: Input should be greater than or equal to 0"),
    ("1 divergence", ["model.config.vocab_size=-5"], "model.config.vocab_size must be a positive integer, got -5"),
    ("1 divergence", ["model.config.hidden_size=0"], "model.config.hidden_size must be a positive integer"),
    ("1 divergence", ["model.config.num_hidden_layers=2.5"], "model.config.num_hidden_layers must be a positive"),
    ("1 divergence", ["model.config.num_attention_heads=3"], "must be a multiple of num_key_value_heads (2)"),
    ("1 divergence", ["model.config.rope_theta=.nan"], "model.config.rope_theta must be a finite number > 0"),
    ("1 divergence", ["model.rope_theta=.inf"], "model.rope_theta: Input should be a finite number"),
    ("1 divergence", ["attention.threshold=.nan"], "attention.threshold: Input should be a finite number"),
    ("1 divergence", ["log.peak_tflops=.inf"], "log.peak_tflops: Input should be a finite number"),
    ("4 stuck peer", ["parallel.timeout_minutes=0"], "parallel.timeout_minutes: Input should be greater than 0"),
    ("4 stuck peer", ["parallel.timeout_minutes=.inf"], "parallel.timeout_minutes: Input should be a finite"),
    ("8 mistakes", ["attention.dense_layers=[0, 5]"], "attention.dense_layers names layers [5] but the model has 2"),
    ("8 mistakes", ["train.steps=[3"], "the value is not valid YAML (expected ',' or ']'"),
]


@pytest.mark.parametrize("group, overrides, expected", BAD_CONFIGS, ids=lambda v: str(v))
def test_bad_config_fails_at_load_naming_the_key(group, overrides, expected):
    with pytest.raises(ConfigError) as err:
        parse_config(RAW, [*SMALL_BUDGET, *overrides])
    assert expected in str(err.value)


# ---------------------------------------------------------------------------------------------- 1 divergence
def test_check_finite_names_the_step_the_quantity_and_the_last_checkpoint():
    from mtraining.train.divergence import check_finite

    check_finite(5, 2.0, 1.0, None)
    msg = _message(check_finite, 7, float("nan"), float("inf"), Path("ck/step_00000005"))
    assert "step 7 diverged: the loss is nan and the gradient norm is inf" in msg
    assert "the last good checkpoint is ck/step_00000005" in msg and "Lower optim.lr" in msg
    msg = _message(check_finite, 2, 3.0, float("nan"), None)
    assert "the gradient norm is nan" in msg and "loss is" not in msg and "no checkpoint was saved yet" in msg


def _diverge(tmp_path: Path, *overrides: str) -> tuple[Path, Path, Path, str]:
    """(checkpoint.dir, export_dir, config, output) of a run with ``overrides`` that must stop with exit 3."""
    ck, hf = tmp_path / "ck", tmp_path / "hf"
    settings = ["optim.warmup_steps=0", f"checkpoint.dir={ck}", f"checkpoint.export_dir={hf}", *overrides]
    config = _write_config(tmp_path / "diverge.yaml", *settings)
    code, out = run_local(_invoke, 1, ["train", config])[0]
    assert code == Diverged.exit_code and "Traceback" not in out, out
    return ck, hf, config, out


def test_a_diverging_run_stops_with_exit_code_3_and_writes_no_nan(tmp_path):
    """lr=1e6 without clipping: the gradient norm turns NaN at step 3; the step is not applied, the run
    exits 3 naming step 3 and the last good checkpoint, and neither step_3 nor the export is written."""
    ck, hf, config, out = _diverge(
        tmp_path, "optim.lr=1e6", "optim.grad_clip=null", "train.steps=6", "checkpoint.every=1"
    )
    assert "step 3 diverged: the gradient norm is nan" in out and f"{ck / 'step_00000002'}" in out
    assert sorted(p.name for p in ck.iterdir()) == ["step_00000001", "step_00000002"]
    assert not (hf / "model.safetensors").exists()
    from mtraining.train.export import load_trained_model

    model, _ = load_trained_model(load_config(config), ck, report=print)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_weights_blown_up_by_the_last_update_are_neither_saved_nor_exported(tmp_path):
    """lr=1e35: step 1's loss and gradients are finite, and its update makes weights of about 1e35, which the
    check before an update never sees when it is the last one (the run exported them with exit 0)."""
    ck, hf, _, out = _diverge(tmp_path, "optim.lr=1e35", "train.steps=1")
    assert "step 1 diverged: its update made the weights' norm inf" in out and "no checkpoint was saved yet" in out
    assert not list(ck.iterdir()) and not (hf / "model.safetensors").exists()


def _finite_checks(cfg) -> tuple[list[tuple[int, float]], list[dict]]:
    import mtraining.train.trainer as trainer

    checked, check = [], trainer.check_finite

    def spy(step, loss, grad_norm, last_checkpoint):
        checked.append((step, loss))
        check(step, loss, grad_norm, last_checkpoint)

    trainer.check_finite = spy  # in this forked rank only
    return checked, run_trainer(cfg)


def test_with_accumulation_the_divergence_check_runs_once_per_optimizer_step():
    """Three micro-batches a step: one check per step, after all of them, on the loss of the whole step."""
    checked, history = run_local(_finite_checks, 1, make_config(*SMALL_BUDGET, "train.steps=2", "train.grad_accum=3"))[
        0
    ]
    assert [step for step, _ in checked] == [1, 2]
    assert [loss for _, loss in checked] == [m["loss"] for m in history]


# ---------------------------------------------------------------------------------------------- 2 signals
def _tagged(tag: str) -> list[int]:
    """Processes whose environment carries ``tag`` (the launcher, torchrun and every rank inherit it)."""
    pids = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"MTRAINING_TEST_TAG={tag}".encode() in environ.read_bytes():
                pids.append(int(environ.parent.name))
        except OSError:
            continue
    return pids


def _step_rows(metrics: Path) -> list[dict]:
    """The step rows of a metrics.jsonl (not its start/resume event rows)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    return [r for r in rows if "event" not in r]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks through /proc")
@pytest.mark.parametrize("sig, ranks", [(signal.SIGTERM, 4), (signal.SIGINT, 2)], ids=["SIGTERM-4", "SIGINT-2"])
def test_a_signal_to_the_launcher_stops_every_rank(tmp_path, sig, ranks):
    """``mtraining train --nproc N``: SIGTERM makes the ranks finish the step, agree, save it and exit 143;
    SIGINT stops them (130). Either way no process of the job is left."""
    tag = uuid.uuid4().hex
    ck = tmp_path / "ck"
    cmd = [sys.executable, "-m", "mtraining.cli", "train", "configs/tiny_cpu.yaml", "--nproc", str(ranks)]
    cmd += [f"parallel.context={ranks}", "data.seq_len=256", "train.steps=100000", f"checkpoint.dir={ck}"]
    cmd += ["checkpoint.every=null", "checkpoint.export_dir=null", f"log.dir={tmp_path}", "log.progress=false"]
    cmd += ["log.tensorboard=false", "log.recall=false", "log.every=1000"]
    with open(tmp_path / "out.txt", "w") as log:
        env = {**os.environ, "MTRAINING_TEST_TAG": tag}
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            metrics = tmp_path / "metrics.jsonl"
            deadline = time.monotonic() + 240
            while not _step_rows(metrics) and time.monotonic() < deadline:  # the first step is done
                assert proc.poll() is None, (tmp_path / "out.txt").read_text()
                time.sleep(0.5)
            proc.send_signal(sig)
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    out = (tmp_path / "out.txt").read_text()
    deadline = time.monotonic() + 10
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _tagged(tag), f"left behind: {_tagged(tag)}"
    if sig == signal.SIGINT:
        assert code == 130 and "stopped: interrupted after step" in out, out[-3000:]
        return
    assert code == 143, out[-3000:]
    last = _step_rows(metrics)[-1]["step"]
    assert f"stopped: SIGTERM: stopped after step {last}, saved {ck / f'step_{last:08d}'}" in out
    assert verify_checkpoint(ck / f"step_{last:08d}") is None


def _agree(signalled: int) -> bool:
    from mtraining.train.signals import StopSignal

    stop = StopSignal(torch.device("cpu"))
    stop.received = torch.distributed.get_rank() == signalled
    return stop.agreed()


def test_ranks_agree_to_stop_when_one_of_them_got_sigterm():
    assert run_local(_agree, 4, 2) == [True] * 4
    assert run_local(_agree, 4, -1) == [False] * 4
    assert run_local(_agree, 1, 0) == [True] and run_local(_agree, 1, -1) == [False]  # a world of one asks nobody


# ---------------------------------------------------------------------------------------------- 3 checkpoints
@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """Checkpoints step_1 and step_2 of a one-rank run (train.steps=2)."""
    ck = tmp_path_factory.mktemp("trained") / "ck"
    run_local(run_trainer, 1, make_config(*SMALL_BUDGET, "train.steps=2", "checkpoint.every=1", f"checkpoint.dir={ck}"))
    return ck


def _flip(folder: Path) -> None:
    data = bytearray((folder / SHARD).read_bytes())
    data[1000:9192] = bytes(b ^ 0xFF for b in data[1000:9192])  # 8 KB overwritten
    (folder / SHARD).write_bytes(bytes(data))


def _truncate(folder: Path) -> None:
    data = (folder / SHARD).read_bytes()
    (folder / SHARD).write_bytes(data[: len(data) // 2])


def _shard_of_another_save(folder: Path) -> None:
    shutil.copyfile(folder.parent / "step_00000001" / SHARD, folder / SHARD)


def _no_manifest(folder: Path) -> None:
    (folder / MANIFEST).unlink()


def _no_metadata(folder: Path) -> None:
    (folder / ".metadata").unlink()


def _garbled_manifest(folder: Path) -> None:
    (folder / MANIFEST).write_text("{not json")


def _leftovers(folder: Path) -> None:
    """An interrupted save of step 3 and an unfinished replacement: neither counts."""
    shutil.copytree(folder, folder.parent / "step_00000003.partial")
    shutil.copytree(folder, folder.parent / "step_00000003.old")
    (folder.parent / "step_00000004").mkdir()  # a step folder with nothing in it


def _no_shard(folder: Path) -> None:
    (folder / SHARD).unlink()


def _other_format(folder: Path) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**manifest, "format": 2}))


# (damage to the newest checkpoint, what the message says, refused): a corrupt one is skipped for the one
# before; one that may be whole but cannot be verified here is refused with the fix, never skipped (a run
# that skipped one restarted from an older step and its first save overwrote it)
DAMAGES = [
    (_flip, "__0_0.distcp does not match its SHA-256", False),
    (_truncate, "__0_0.distcp has", False),
    (_shard_of_another_save, "__0_0.distcp does not match its SHA-256", False),
    (_garbled_manifest, "manifest.json is unreadable", False),
    (_no_manifest, "step_00000002 has no manifest.json (an older format: a checkpoint of an earlier version", True),
    (_other_format, "step_00000002 has manifest format 2, this version reads 1: it was written by another", True),
    (_no_shard, "step_00000002 lacks __0_0.distcp, listed in its manifest.json", True),
    (_no_metadata, "step_00000002 lacks .metadata, listed in its manifest.json", True),
]


@pytest.mark.parametrize("damage, why, refused", DAMAGES, ids=lambda v: getattr(v, "__name__", ""))
def test_a_damaged_newest_checkpoint_is_skipped_or_refused(trained, tmp_path, damage, why, refused):
    ck = shutil.copytree(trained, tmp_path / "ck")
    damage(ck / "step_00000002")
    if refused:
        for pick in (newest_verified, pick_checkpoint):  # resume's, and the export's and evaluation's
            with pytest.raises(ValueError, match=re.escape(why)):
                pick(ck, print)
        return
    notes: list[str] = []
    path, manifest = newest_verified(ck, notes.append)
    assert path.name == "step_00000001" and manifest["step"] == 1
    assert len(notes) == 1 and notes[0].startswith(f"skipping checkpoint {ck / 'step_00000002'}: ") and why in notes[0]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_an_older_format_checkpoint_is_kept_and_can_be_adopted(trained, tmp_path):
    """The run refuses it, naming the fix, and writes nothing; once adopted it is the one resumed from."""
    ck = shutil.copytree(trained, tmp_path / "ck")
    _no_manifest(ck / "step_00000002")
    before = _files(ck)
    cfg = make_config(*SMALL_BUDGET, "train.steps=3", "checkpoint.every=1", f"checkpoint.dir={ck}")
    msg = str(pytest.raises(RuntimeError, run_local, run_trainer, 1, cfg).value)
    assert "It is neither loaded nor replaced: move it out of" in msg and "mtraining.train.checkpoint adopt" in msg
    assert _files(ck) == before
    from mtraining.train.checkpoint import main as checkpoint_main

    assert checkpoint_main(["adopt", str(ck / "step_00000002")]) == 0
    assert checkpoint_main(["adopt", str(ck / "step_00000002")]) == 2  # it has a manifest now
    assert run_local(_resume_step, 1, cfg)[0] == (2, "step_00000002")


def test_a_save_keeps_the_corrupt_checkpoint_it_replaces(trained, tmp_path, capfd):
    """Resumed from step_1 past a corrupt step_2, the save of step 2 keeps the corrupt one aside."""
    ck = shutil.copytree(trained, tmp_path / "ck")
    _flip(ck / "step_00000002")
    corrupt = (ck / "step_00000002" / SHARD).read_bytes()
    run_local(run_trainer, 1, make_config(*SMALL_BUDGET, "train.steps=2", "checkpoint.every=1", f"checkpoint.dir={ck}"))
    assert (ck / "step_00000002.unverified" / SHARD).read_bytes() == corrupt
    assert verify_checkpoint(ck / "step_00000002") is None
    assert "kept step_00000002, which did not verify, as step_00000002.unverified" in capfd.readouterr().out


def test_leftovers_of_interrupted_saves_are_ignored(trained, tmp_path):
    ck = shutil.copytree(trained, tmp_path / "ck")
    _leftovers(ck / "step_00000002")
    notes: list[str] = []
    assert newest_verified(ck, notes.append)[0].name == "step_00000002"
    assert notes == [f"skipping checkpoint {ck / 'step_00000004'}: step_00000004 has no manifest.json (no .metadata "
                     "either: an interrupted save), so it cannot be verified"]  # fmt: skip


def _resume_step(cfg) -> tuple[int, str | None]:
    from mtraining.train.trainer import Trainer

    trainer = Trainer(cfg)
    trainer.close()
    return trainer.step, trainer.last_checkpoint and trainer.last_checkpoint.name


def test_resume_falls_back_past_a_truncated_checkpoint(trained, tmp_path, capfd):
    """The trainer resumes from step_1 (a truncated newest checkpoint crashed resume before) and says why."""
    ck = shutil.copytree(trained, tmp_path / "ck")
    _truncate(ck / "step_00000002")
    cfg = make_config(*SMALL_BUDGET, "train.steps=2", f"checkpoint.dir={ck}")
    assert run_local(_resume_step, 1, cfg)[0] == (1, "step_00000001")
    out = capfd.readouterr().out
    assert "skipping checkpoint" in out and "truncated" in out and "resumed from" in out


def _killed_while_saving(cfg) -> None:
    """A checkpoint.resume=false run killed at the commit of its first save (step 1)."""
    import mtraining.train.checkpoint as checkpoint

    checkpoint._commit = lambda *args: os._exit(9)
    run_trainer(cfg)


def test_a_run_killed_while_overwriting_a_step_leaves_the_old_one_whole(trained, tmp_path):
    ck = shutil.copytree(trained, tmp_path / "ck")
    before = read_manifest(ck / "step_00000001")
    cfg = make_config(
        *SMALL_BUDGET, "train.steps=2", "checkpoint.every=1", "checkpoint.resume=false", f"checkpoint.dir={ck}"
    )
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 0 died without answering \(exit code 9\)"):
        run_local(_killed_while_saving, 1, cfg)
    assert time.monotonic() - start < 60  # the harness noticed the dead rank (its group timeout is 120 s)
    assert (ck / "step_00000001.partial" / SHARD).is_file()  # the new shards never replaced the old ones
    assert verify_checkpoint(ck / "step_00000001") is None and read_manifest(ck / "step_00000001") == before
    assert newest_verified(ck, print)[0].name == "step_00000002"


def test_a_checkpoint_of_another_model_is_refused(trained, tmp_path):
    """3 layers against a 2-layer checkpoint (and 1 layer): refused at start, nothing overwritten."""
    ck = shutil.copytree(trained, tmp_path / "ck")
    for layers, where in ((3, "only in this model (e.g. model.model.layers.2."), (1, "only in the checkpoint")):
        cfg = make_config(
            *SMALL_BUDGET, f"model.config.num_hidden_layers={layers}", "train.steps=3", f"checkpoint.dir={ck}"
        )
        msg = str(pytest.raises(RuntimeError, run_local, _resume_step, 1, cfg).value)
        assert "step_00000002 belongs to another model (" in msg and f"num_hidden_layers 2 -> {layers}" in msg
        assert where in msg
        assert "point checkpoint.dir at this model's checkpoints" in msg
    assert sorted(p.name for p in ck.iterdir()) == ["step_00000001", "step_00000002"]


def test_export_and_eval_verify_the_checkpoint(trained, tmp_path):
    ck = shutil.copytree(trained, tmp_path / "ck")
    _flip(ck / "step_00000002")
    config = _write_config(tmp_path / "train.yaml", "train.steps=2", f"checkpoint.dir={ck}")
    result = CliRunner().invoke(app, ["export", str(config), str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    assert "skipping checkpoint" in result.output and f"exported {ck / 'step_00000001'}" in result.output
    result = CliRunner().invoke(app, ["export", str(config), str(tmp_path / "hf2"), "--checkpoint", str(ck / "step_00000002")])  # fmt: skip
    assert result.exit_code == 2 and "does not verify" in result.output and "Traceback" not in result.output
    from mtraining.eval.loading import load

    with pytest.raises(ValueError, match="does not verify: __0_0.distcp does not match its SHA-256"):
        load(ck / "step_00000002", config=load_config(config))


# ---------------------------------------------------------------------------------------------- multi-node launches
def _check_same(values: list[dict]) -> None:
    from mtraining.train.agree import check_same

    check_same(values[torch.distributed.get_rank()], "configs", "start every node with the same config")


def test_ranks_with_different_values_are_refused_naming_each_key_and_its_ranks():
    same = {"optim.lr": 0.1, "data.seq_len": 128, "train.seed": 0}
    values = [same, same, same, {**same, "train.seed": 1, "data.seq_len": 64}]
    msg = str(pytest.raises(RuntimeError, run_local, _check_same, 4, values).value)
    assert "the ranks run with different configs (data.seq_len: 128 on ranks 0-2; 64 on ranks 3 | train.seed: " in msg
    assert "0 on ranks 0-2; 1 on ranks 3); start every node with the same config" in msg
    run_local(_check_same, 2, [same, dict(reversed(same.items()))])  # the same values in another order


def _train_with_the_rank_as_seed(overrides: list[str]) -> list[dict]:
    return run_trainer(make_config(*overrides, f"train.seed={torch.distributed.get_rank()}"))


def test_a_trainer_refuses_ranks_of_different_configs():
    """Two ranks of another train.seed drew different samples into one step (exit 0 on spliced data)."""
    overrides = [*SMALL_BUDGET, "parallel.context=2", "train.steps=1"]
    msg = str(pytest.raises(RuntimeError, run_local, _train_with_the_rank_as_seed, 2, overrides).value)
    assert "SharedError: the ranks run with different configs (train.seed: 0 on ranks 0; 1 on ranks 1)" in msg


def _shared(folders: list[str]) -> None:
    from mtraining.train.outputs import check_shared_dir

    check_shared_dir(folders[torch.distributed.get_rank()], "checkpoint.dir")


@pytest.mark.slow
def test_a_checkpoint_dir_that_is_not_shared_is_refused(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    run_local(_shared, 2, [str(tmp_path / "a")] * 2)
    msg = str(pytest.raises(RuntimeError, run_local, _shared, 2, [str(tmp_path / "a"), str(tmp_path / "b")]).value)
    assert f"checkpoint.dir={tmp_path / 'a'} is not one folder for every rank: ranks 1 do not see" in msg
    assert "set checkpoint.dir to a folder on storage every node mounts" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"] and not list((tmp_path / "a").iterdir())


def _newest(roots: list[str]) -> str:
    return newest_verified(roots[torch.distributed.get_rank()], print)[0].name


def test_a_checkpoint_whose_shards_lie_on_another_disk_names_them(trained, tmp_path):
    """Rank 1 lists no checkpoint in its own folder: every rank walks rank 0's list (the walks once paired
    different collectives and crashed with a TypeError) and the files rank 1 lacks are named."""
    (tmp_path / "elsewhere").mkdir()
    msg = str(pytest.raises(RuntimeError, run_local, _newest, 2, [str(trained), str(tmp_path / "elsewhere")]).value)
    assert "step_00000002 lacks __0_0.distcp, listed in its manifest.json" in msg and "TypeError" not in msg


def _meet(port: int, nnodes: int, node: int, timeout_s: float) -> str:
    """meet_nodes in a thread: "met", or the error's type and message."""
    from mtraining.train.rendezvous import meet_nodes

    try:
        meet_nodes(f"localhost:{port}", nnodes, node, timeout_s, say=lambda _: None)
        return "met"
    except (ValueError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"


def test_nodes_meet_once_each_and_free_the_port():
    """A second launcher claiming node 1 is refused, the three nodes meet; node 0 frees the port when the
    meeting ends (torchrun hosts its own store there next). A node 1 without node 0 times out (exit 4)."""
    from concurrent.futures import ThreadPoolExecutor

    port = _free_port()
    with ThreadPoolExecutor(4) as pool:
        host, first = pool.submit(_meet, port, 3, 0, 60), pool.submit(_meet, port, 3, 1, 60)
        time.sleep(2.0)  # both in the meeting, which waits for node 2
        second = pool.submit(_meet, port, 3, 1, 60)
        refused = second.result()
        last = pool.submit(_meet, port, 3, 2, 60)
        assert [host.result(), first.result(), last.result()] == ["met"] * 3
    assert refused.startswith("ValueError: --node-rank 1 is taken by the launcher on ") and "(pid " in refused
    torch.distributed.TCPStore("localhost", port, is_master=True, wait_for_workers=False)  # the port is free
    alone = _meet(_free_port(), 2, 1, 1.0)
    assert alone.startswith("NodesMissing: node 0 did not open the rendezvous at localhost:") and "within 1 s" in alone


def test_a_rendezvous_that_cannot_be_reached_is_named_at_once(monkeypatch):
    """A host name that does not resolve, and a port where another program listens (a store client waits
    there forever, deaf to Ctrl-C), are refused in seconds instead of waiting out the time-out."""
    from mtraining.train import rendezvous
    from mtraining.train.rendezvous import meet_nodes

    start = time.monotonic()
    with pytest.raises(ValueError, match="cannot resolve the host no-such-host.invalid of --rdzv-endpoint"):
        meet_nodes("no-such-host.invalid:29500", 2, 1, 60, say=lambda _: None)
    monkeypatch.setattr(rendezvous, "_ANSWER_S", 1.0)
    with socket.socket() as other:  # listens, never answers
        other.bind(("localhost", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(ValueError, match=f"localhost:{port} accepts connections but does not answer as"):
            meet_nodes(f"localhost:{port}", 2, 1, 60, say=lambda _: None)
    assert time.monotonic() - start < 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _node(tmp_path: Path, node: int, port: int, *overrides: str) -> subprocess.Popen:
    """``mtraining train --nproc 1 --nnodes 2`` as node ``node`` of a job whose rendezvous is localhost:PORT."""
    cmd = [
        sys.executable,
        "-m",
        "mtraining.cli",
        "train",
        str(_write_config(tmp_path / "nodes.yaml", "parallel.context=2")),
    ]
    cmd += ["--nproc", "1", "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", f"localhost:{port}"]
    out = open(tmp_path / f"node{node}.txt", "w")  # closed with the test's folder
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731 (a test harness may ignore it)
    return subprocess.Popen(
        [*cmd, *overrides], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, preexec_fn=default_sigint
    )


def _finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[int]:
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["another seed", "own checkpoint dirs"])
def test_two_nodes_that_differ_are_refused_before_training(tmp_path, case):
    """Two launchers as two nodes, each with its own checkpoint.dir (a folder on each node's disk): they meet,
    torchrun starts one rank each, and the ranks refuse: another train.seed on node 1 is named first; with the
    same config, the unshared checkpoint.dir (both saved "whole" checkpoints missing each other's shards)."""
    port = _free_port()
    seed = ["train.seed=1"] if case == "another seed" else []
    procs = [_node(tmp_path, n, port, f"checkpoint.dir={tmp_path / f'ck{n}'}", *(seed if n else [])) for n in (0, 1)]
    codes = _finish(procs)
    out = (tmp_path / "node0.txt").read_text()
    assert codes == [2, 2], out + (tmp_path / "node1.txt").read_text()
    if case == "another seed":
        assert "the ranks run with different configs (train.seed: 0 on ranks 0 (node 0); 1 on ranks 1 (node 1))" in out
    else:
        assert f"checkpoint.dir={tmp_path / 'ck0'} is not one folder for every rank: ranks 1 (node 1) do not see" in out
    assert not list((tmp_path / "ck0").iterdir()) and not list((tmp_path / "ck1").iterdir())


@pytest.mark.slow
def test_a_node_that_never_comes_stops_the_other_with_exit_4(tmp_path):
    """parallel.timeout_minutes=0.05 (3 s): node 0 says whom it waits for, then exits 4 naming node 1."""
    start = time.monotonic()
    code = _finish([_node(tmp_path, 0, _free_port(), "parallel.timeout_minutes=0.05")])[0]
    out = (tmp_path / "node0.txt").read_text()
    assert code == 4, out
    assert "1 of 2 nodes arrived; missing node(s) 1" in out
    assert "node(s) 1 did not reach the rendezvous at localhost:" in out and "within 3 s" in out
    assert time.monotonic() - start < 120 and "Traceback" not in out


@pytest.mark.slow
@pytest.mark.parametrize("node", [0, 1])
def test_ctrl_c_stops_a_node_waiting_for_the_others(tmp_path, node):
    """Node 0 waits for node 1, node 1 for node 0 to open the rendezvous: the first Ctrl-C ends either (130)."""
    proc = _node(tmp_path, node, _free_port())
    log = tmp_path / f"node{node}.txt"
    deadline = time.monotonic() + 180
    while "waiting" not in log.read_text() and time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    start = time.monotonic()
    code = _finish([proc], timeout=30)[0]
    assert code == 130 and time.monotonic() - start < 10, log.read_text()
    assert "stopped: interrupted before the ranks started" in log.read_text()


# ---------------------------------------------------------------------------------------------- 4 a stuck peer
def _pause_rank1_at_step3(cfg) -> list[dict]:
    import torch.distributed as dist

    from mtraining.train.trainer import Trainer

    trainer = Trainer(cfg)
    step = trainer.train_step

    def paused():
        if dist.get_rank() == 1 and trainer.step == 2:
            os.kill(os.getpid(), signal.SIGSTOP)  # paused, as by `kill -STOP`
        return step()

    trainer.train_step = paused
    try:
        return trainer.run()
    finally:
        trainer.close()


@pytest.mark.slow
def test_a_paused_rank_is_named_and_the_run_stops_after_the_timeout(capfd):
    """parallel.timeout_minutes=0.1 (6 s): the watchdog names rank 1 while rank 0 waits, then the timed-out
    collective becomes RankStalled naming step 3; the harness kills the paused rank."""
    cfg = make_config(*SMALL_BUDGET, "parallel.context=2", "train.steps=6", "parallel.timeout_minutes=0.1")
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        run_local(_pause_rank1_at_step3, 2, cfg, group_timeout_s=6, grace_s=2)
    assert time.monotonic() - start < 90
    msg = str(err.value)
    assert "RankStalled: step 3 stalled: a collective did not complete" in msg
    assert "rank 1 stopped responding (no heartbeat: paused or dead)" in msg
    assert "parallel.timeout_minutes=0.1" in msg and "rank 1 did not answer" in msg
    assert "[rank 0] step 3 has run" in capfd.readouterr().err


def test_the_timeout_setting_reaches_the_process_group(monkeypatch):
    from mtraining.train import trainer

    seen = []

    def join_group(device, timeout_s):
        seen.append(timeout_s)
        raise ValueError("stop here")

    monkeypatch.setattr(trainer, "join_group", join_group)
    with pytest.raises(ValueError, match="stop here"):
        trainer.Trainer(make_config(*SMALL_BUDGET, "parallel.timeout_minutes=2.5"))
    assert seen == [150.0]


def test_the_watchdog_never_flags_the_first_step_and_flags_a_slow_later_one():
    """Warm-up has no baseline; later, a step 10x its predecessors (floor 0 here) is reported once."""
    import torch.distributed as dist

    from mtraining.train.watchdog import StepWatchdog

    store, lines = dist.HashStore(), []
    watchdog = StepWatchdog(0, 2, timeout_s=6.0, store=store, report=lines.append, floor_s=0.0)
    store.add("mtraining/watchdog/done/1", 0)
    try:
        watchdog.step_started(1)
        time.sleep(3 * watchdog.poll_s)  # a long first step: never flagged
        watchdog.step_finished()
        assert lines == []
        watchdog._durations = [0.01]  # steps take 10 ms from now on
        watchdog.step_started(2)
        time.sleep(0.5 + 8 * watchdog.poll_s)  # ranks 1 never ticks: it is named
        assert (
            len(lines) == 1
            and lines[0].startswith("[rank 0] step 2 has run")
            and "rank 1 stopped responding" in lines[0]
        )
    finally:
        watchdog.close()
    assert isinstance(watchdog.stalled(2, RuntimeError("Timed out waiting 6000ms")), RankStalled)


def _rank1_dies(group) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()  # waits for rank 1, which is gone


def _rank(group) -> int:
    import torch.distributed as dist

    return dist.get_rank()


@pytest.mark.slow
def test_the_harness_notices_a_dead_rank_at_once():
    """run_local and the tests' ProcessPool: a rank that dies is reported at once, not after the
    group's timeout (120 and 60 s), and the pool is closed so the next run starts a fresh one."""
    from tests.distributed import ProcessPool

    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 died without answering \(exit code 3\)"):
        run_local(_rank1_dies, 2, None, grace_s=2)
    assert time.monotonic() - start < 30
    fresh = ProcessPool(grace_s=2)
    try:
        assert fresh.run(_rank, 4) == [0, 1, 2, 3]  # started
        start = time.monotonic()
        with pytest.raises(AssertionError, match=r"rank 1 died without answering \(exit code 3\)"):
            fresh.run(_rank1_dies, 4)
        assert time.monotonic() - start < 30 and fresh._ranks is None
    finally:
        fresh.close()


# ---------------------------------------------------------------------------------------------- 8 mistakes
def test_yaml_syntax_error_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  config: {model_type: qwen2\ntrain:\n  steps: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml is not valid YAML: line 3, column 6: expected "):
        load_config(bad)
    result = CliRunner().invoke(app, ["train", str(bad)])
    assert result.exit_code == 2 and "line 3" in result.output and "Traceback" not in result.output


def test_output_folders_are_checked_at_start(tmp_path):
    """A file or a read-only folder as checkpoint.dir fails before torchrun starts (not at the first save)."""
    (tmp_path / "file").write_text("")
    read_only = _read_only(tmp_path)
    for folder, expected in ((tmp_path / "file", "is a file, not a folder"), (read_only, "is not writable")):
        config = _write_config(tmp_path / "c.yaml", f"checkpoint.dir={folder}", "parallel.context=2")
        result = CliRunner().invoke(app, ["train", str(config), "--nproc", "2"])
        assert result.exit_code == 2 and f"checkpoint.dir={folder} {expected}" in result.output, result.output


def _read_only(tmp_path: Path) -> Path:
    """A folder nobody can write into: sysfs for root (who writes through permission bits), else a 0o500 one."""
    if os.geteuid() == 0:
        return Path("/sys")
    (tmp_path / "ro").mkdir(mode=0o500)
    return tmp_path / "ro"


def test_files_that_are_not_utf8_are_named(tmp_path):
    """A config or budgets file with invalid UTF-8 names the file (the message was the codec's alone)."""
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"train:\n  steps: \xff\xfe\n")
    result = CliRunner().invoke(app, ["train", str(bad)])
    assert result.exit_code == 2 and f"{bad} is not UTF-8 text" in result.output, result.output
    budgets = tmp_path / "budgets.yaml"
    budgets.write_bytes(b"default: {v_size: 4, s_size: \xff}\n")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**RAW, "attention": {**RAW["attention"], "budgets": str(budgets)}}))
    result = CliRunner().invoke(app, ["train", str(config)])
    assert result.exit_code == 2 and f"budgets file {budgets} cannot be read as UTF-8 text" in result.output
    assert "Traceback" not in result.output, result.output


@pytest.mark.parametrize(
    "content, expected",
    [
        ('{"model_type": "qwen2", broken', "is not a Hugging Face config (a JSON object): unreadable"),
        ("[1, 2]", "is not a Hugging Face config (a JSON object): [1, 2]"),
        ('{"model_type": "qwen2", "hidden_size": "big"}', "config.json: hidden_size must be a positive integer"),
        (
            '{"model_type": "qwen2", "rope_scaling": 5}',
            "config.json (with model.overrides) does not make a qwen2 config",
        ),
    ],
)
def test_a_corrupt_config_json_names_the_file(tmp_path, content, expected):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(content)
    config = _write_config(tmp_path / "c.yaml", "model.config=null", f"model.path={tmp_path / 'model'}")
    code, out = run_local(_invoke, 1, ["train", config])[0]
    assert code == 2 and expected in out and "Traceback" not in out, out


def test_export_and_tokenize_into_a_folder_that_cannot_be_written_exit_5(trained, tmp_path):
    read_only = _read_only(tmp_path)
    config = _write_config(tmp_path / "c.yaml", "train.steps=2", f"checkpoint.dir={trained}")
    for command in (["export", config, read_only / "out"], ["tokenize", config, read_only / "out.npy"]):
        result = CliRunner().invoke(app, [str(a) for a in command])
        assert result.exit_code == 5, result.output
        assert "fix its permissions or choose another folder" in result.output, result.output
        assert "Traceback" not in result.output


def test_a_full_disk_at_save_says_so(tmp_path, monkeypatch):
    """What torch reports as "unexpected pos 704 vs 598" when the disk fills becomes "no space left"."""
    from collections import namedtuple

    import mtraining.train.checkpoint as checkpoint

    def full(*args, **kwargs):
        (tmp_path / "ck" / "step_00000001.partial").mkdir(parents=True)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(checkpoint.dcp, "save", full)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage(10 << 30, 10 << 30, 12288))
    model = torch.nn.Linear(4, 4)
    with pytest.raises(SaveFailed, match=r"no space left on the disk of .*ck \(12 KB free\); free space"):
        save_checkpoint(tmp_path / "ck", 1, model, torch.optim.AdamW(model.parameters()))
    assert list((tmp_path / "ck").iterdir()) == []  # the partial save is removed
    from mtraining.train.outputs import check_free_space  # the same shutil.disk_usage, patched

    with pytest.raises(ValueError, match=r"has 0.00 GB free but one checkpoint takes about 1.20 GB"):
        check_free_space(str(tmp_path), 12 * 10**8, "checkpoint.dir")


def test_non_finite_softmax_scale_is_refused():
    from mtraining.ops import sparse_attention

    q = torch.randn(1, 32, 2, 16)
    for scale in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="softmax_scale must be a finite number > 0"):
            sparse_attention(q, q, q, None, softmax_scale=scale, backend="torch")


# ---------------------------------------------------------------------------------------------- changed runs
def _current(overrides: list[str], trained: Path, model: dict | None = None) -> tuple:
    """describe_run of the test config with overrides (the model part taken from the checkpoint)."""
    from mtraining.train.resume import describe_run

    cfg = make_config(*SMALL_BUDGET, "train.steps=2", *overrides)
    saved = read_manifest(trained / "step_00000002")["run"]
    return cfg, describe_run(cfg, model or saved["model"], 1, 1), saved


# (overrides, key that forces it or None when only said, what the message says)
CHANGED_RUNS = [
    (["train.steps=8"], "allow_changed_schedule", "train.steps 2 -> 8: the learning rate of step 3 becomes"),
    (["optim.lr=0.001"], "allow_changed_schedule", "optim.lr 0.01 -> 0.001"),
    (["optim.weight_decay=0.0"], "allow_changed_schedule", "optim.weight_decay 0.1 -> 0.0"),
    (["train.grad_accum=2"], "allow_changed_schedule", "train.grad_accum 1 -> 2"),  # tokens per step double
    (["data.global_batch_tokens=256"], "allow_changed_schedule", "data.global_batch_tokens null -> 256"),
    (["data.tokenizer=null"], None, "data settings changed since step_00000002: data.tokenizer"),
    (["data.seq_len=256"], None, "data.seq_len 128 -> 256; the data order differs"),
    (["train.seed=3"], None, "train.seed 0 -> 3"),
]


@pytest.mark.parametrize("overrides, key, expected", CHANGED_RUNS, ids=lambda v: str(v))
def test_a_resume_that_changes_the_run_is_refused_or_said(trained, overrides, key, expected):
    from mtraining.train.resume import check_resume

    cfg, current, saved = _current(overrides, trained)
    if key is None:
        notes = check_resume(saved, current, 2, cfg, "step_00000002")
        assert any(expected in n for n in notes), notes
        return
    msg = _message(check_resume, saved, current, 2, cfg, "step_00000002")
    assert expected in msg and f"checkpoint.{key}=true" in msg
    allowed = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={key: True})})
    assert any(expected in n for n in check_resume(saved, current, 2, allowed, "step_00000002"))


def test_settings_that_change_neither_gradients_nor_data_resume_silently(trained):
    """Reducing gradients once per step, the ring's shape and the token cache's folder are not a changed run;
    a record written before train.grad_accum and data.global_batch_tokens existed reads as their defaults."""
    from mtraining.train.resume import check_resume

    cfg, current, saved = _current(
        ["train.defer_grad_sync=true", "parallel.ring=hierarchical", "parallel.inner_size=1", "data.cache_dir=/x"],
        trained,
    )
    assert check_resume(saved, current, 2, cfg, "step_00000002") == []
    older = {**saved, "schedule": {k: v for k, v in saved["schedule"].items() if k.startswith(("optim.", "train.st"))}}
    assert check_resume(older, current, 2, cfg, "step_00000002") == []


def test_a_changed_model_config_or_world_shape(trained):
    from mtraining.train.resume import check_resume

    cfg, _, saved = _current([], trained)
    model = json.loads(json.dumps(saved["model"]))
    model["config"]["rope_parameters"]["rope_theta"] = 5e5  # same shapes, another RoPE
    cfg, current, saved = _current([], trained, model)
    msg = _message(check_resume, saved, current, 2, cfg, "step_00000002")
    assert "was trained with another model config (rope_parameters" in msg
    assert "checkpoint.allow_changed_model=true" in msg
    current = {**current, "model": saved["model"], "world": {"parallel.data": 2, "parallel.context": 4}}
    notes = check_resume(saved, current, 2, cfg, "step_00000002")
    assert notes == ["world shape changed since step_00000002: parallel.data 1 -> 2, parallel.context 1 -> 4"]
    current = {**current, "tokenizer": "0" * 64}
    assert "was trained with another tokenizer" in _message(check_resume, saved, current, 2, cfg, "step_00000002")


def test_resuming_with_train_steps_below_the_checkpoint_is_refused(trained):
    from mtraining.train.resume import check_resume

    cfg, current, saved = _current(["train.steps=1", "checkpoint.allow_changed_schedule=true"], trained)
    msg = _message(check_resume, saved, current, 2, cfg, "step_00000002")
    assert "step_00000002 is at step 2, past train.steps=1: raise train.steps to more than 2" in msg


def _resume_and_report(cfg) -> tuple[int, float, float]:
    from mtraining.train.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        metrics = trainer.train_step()
        return trainer.step, metrics["lr"], trainer.optimizer.param_groups[0]["weight_decay"]
    finally:
        trainer.close()


def test_the_readme_resume_with_more_steps_needs_the_key(trained, tmp_path):
    """README's "run it again with train.steps=60": refused at start (the learning rate would jump), then
    continued with the key, taking the new schedule and the new optimizer settings."""
    ck = shutil.copytree(trained, tmp_path / "ck")
    more = ["train.steps=8", f"checkpoint.dir={ck}", "optim.weight_decay=0.0"]
    msg = str(pytest.raises(RuntimeError, run_local, _resume_and_report, 1, make_config(*SMALL_BUDGET, *more)).value)
    assert "resuming step_00000002 with another schedule (optim.weight_decay 0.1 -> 0.0, train.steps 2 -> 8" in msg
    cfg = make_config(*SMALL_BUDGET, *more, "checkpoint.allow_changed_schedule=true")
    step, lr, weight_decay = run_local(_resume_and_report, 1, cfg)[0]
    from mtraining.train.optim import lr_at

    assert step == 3 and lr == lr_at(2, 1e-2, 1, 8, 0.1) and weight_decay == 0.0

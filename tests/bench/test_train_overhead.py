"""bench/train_overhead.py end to end at a toy size: both loops run, the record says what was measured."""

from __future__ import annotations

import json
import sys

from tests.bench.scripts import load_script


def test_trainer_and_plain_loop_are_timed_and_recorded(tmp_path, monkeypatch):
    bench = load_script("train_overhead")
    monkeypatch.setitem(sys.modules, "train_overhead", bench)  # the ranks unpickle its functions by name
    out, profile = tmp_path / "overhead.json", tmp_path / "profile.txt"
    args = ["--hidden", "32", "--seq-len", "128", "--batch", "1", "--steps", "2", "--warmup", "1", "--ranks", "1", "2"]
    monkeypatch.setattr(sys, "argv", ["train_overhead.py", *args, "--profile", str(profile), "--out", str(out)])
    bench.main()
    (record,) = json.loads(out.read_text())
    assert record["device"] == "cpu" and record["commit"] and "train_overhead.py" in record["command"]
    assert len(record["plain"]["losses"]) == 3 and record["plain"]["cpu_s"] > 0
    one, two = record["trainer"]
    assert (one["ranks"], two["ranks"]) == (1, 2) and len(one["wall_steps"]) == 2
    assert one["wall_ratio"] == one["wall_s"] / record["plain"]["wall_s"] > 0
    assert abs(one["losses"][0] - two["losses"][0]) < 1e-4  # one and two context ranks train alike
    assert all("train_step" in (tmp_path / f"profile_{n}rank.txt").read_text() for n in (1, 2))


def test_bfloat16_rounds_compare_fsdp_groups(tmp_path, monkeypatch):
    """--dtype bfloat16 with --fsdp-groups layers auto: one record per round, each wrapping trains alike."""
    bench = load_script("train_overhead")
    monkeypatch.setitem(sys.modules, "train_overhead", bench)
    out = tmp_path / "overhead.json"
    args = ["--hidden", "32", "--seq-len", "64", "--batch", "1", "--steps", "2", "--warmup", "1", "--ranks", "1"]
    args += [
        "--dtype",
        "bfloat16",
        "--fsdp-groups",
        "layers",
        "auto",
        "--rounds",
        "2",
        "--set",
        "attention.sparse=false",
    ]
    monkeypatch.setattr(sys, "argv", ["train_overhead.py", *args, "--out", str(out)])
    bench.main()
    records = json.loads(out.read_text())
    assert [r["round"] for r in records] == [0, 1] and {r["dtype"] for r in records} == {"bfloat16"}
    runs = [t for r in records for t in r["trainer"]]
    assert [t["fsdp_groups"] for t in runs] == ["layers", "auto"] * 2
    assert all(t["losses"] == runs[0]["losses"] for t in runs)  # the same steps, however FSDP wraps the model
    assert len(records[0]["plain"]["losses"]) == 3

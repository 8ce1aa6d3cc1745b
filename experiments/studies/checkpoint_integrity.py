"""What checkpoint integrity costs: a save with its manifest (SHA-256 of every file, atomic commit)
against plain DCP, and the verification before a resume or an export.

One process (no process group) holds a float32 Qwen2-architecture model with AdamW state (one step
on zero gradients), so the checkpoint takes 12 bytes per parameter, like one rank's shard of a
larger model (Qwen2.5-3B over 8 ranks: about 4.5 GB each). ``--repeats`` times, alternating, wall
and CPU seconds (medians, and every run): ``dcp.save`` alone, ``save_checkpoint`` (the same save,
then hashing, manifest and rename), ``verify_checkpoint``, ``load_checkpoint``, and hashing the
files alone; ``os.sync()`` before each. The hashing reads the files right after they were written,
usually from the page cache.

    python -m experiments.studies.checkpoint_integrity                    # about 3.8 GB, writes bench/results/checkpoint_integrity.json
    python -m experiments.studies.checkpoint_integrity --layers 2 --dir /tmp/ck --out /tmp/ck.json   # a quick check
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from bench.common import provenance, write_results
from mtraining.models import build_model
from mtraining.train.checkpoint import file_digest, load_checkpoint, save_checkpoint, verify_checkpoint
from mtraining.train.loss import CausalLMLoss


def _timed(fn) -> tuple[float, float]:
    os.sync()  # the previous write's dirty pages are not this one's cost
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--intermediate", type=int, default=4864)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    config = dict(
        model_type="qwen2",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = CausalLMLoss(build_model(config=config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates both moments
    optimizer.zero_grad(set_to_none=True)
    params = sum(p.numel() for p in model.parameters())
    root = args.dir or Path(tempfile.mkdtemp(prefix="ck-integrity-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        def plain() -> None:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(1)}, checkpoint_id=root / "plain")

        record: dict = {**provenance(), "model": config}
        record["parameters"] = params
        step = root / "step_00000001"
        runs: dict[str, list[tuple[float, float]]] = {}
        for repeat in range(args.repeats):
            shutil.rmtree(root / "plain", ignore_errors=True)
            shutil.rmtree(step, ignore_errors=True)
            saves = {"plain_dcp_save": plain, "save_checkpoint": lambda: save_checkpoint(root, 1, model, optimizer)}
            for name in sorted(saves, reverse=repeat % 2 == 1):  # alternate which save goes first
                runs.setdefault(name, []).append(_timed(saves[name]))
            files = sorted(step.iterdir())
            runs.setdefault("sha256_all_files", []).append(_timed(lambda files=files: [file_digest(p) for p in files]))
            runs.setdefault("verify_checkpoint", []).append(_timed(lambda: verify_checkpoint(step)))
            runs.setdefault("load_checkpoint", []).append(_timed(lambda: load_checkpoint(step, model, optimizer)))
        record["checkpoint_bytes"] = sum(p.stat().st_size for p in files)
        record["files"] = len(files)
        for name, timings in runs.items():
            record[f"{name}_s"] = statistics.median(w for w, _ in timings)
            record[f"{name}_cpu_s"] = statistics.median(c for _, c in timings)
            record[f"{name}_runs_wall_cpu_s"] = timings
        gb = record["checkpoint_bytes"] / 1e9
        record["sha256_gb_per_wall_s"] = gb / record["sha256_all_files_s"]
        record["sha256_gb_per_cpu_s"] = gb / record["sha256_all_files_cpu_s"]
        record["save_overhead_s"] = record["save_checkpoint_s"] - record["plain_dcp_save_s"]
        record["save_overhead_fraction"] = record["save_checkpoint_s"] / record["plain_dcp_save_s"] - 1
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    for key, value in record.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    print(f"wrote {write_results('checkpoint_integrity', [record], args.out)}")


if __name__ == "__main__":
    main()

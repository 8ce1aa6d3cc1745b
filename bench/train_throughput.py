"""End-to-end training throughput: dense vs mtraining sparse attention (launches ``mtraining train``).

For each sequence length and attention mode it writes a config (Qwen2.5-3B architecture with random
weights by default, context parallel over all GPUs, bf16, activation checkpointing), trains a few
steps on random token ids through torchrun, and reads the trainer's metrics.jsonl as it is written:
each step's figures are printed and the output JSON is rewritten after every step (a run cut short
keeps what it measured; ``complete`` says whether it finished). ``--time-limit-s`` bounds the whole script:
a run whose next step would end past it is stopped after its last step, its processes killed. A record holds every step and the
median over steps after warm-up of step time and tokens/s, the peak memory (rank 0's) and MFU.
Options that change the step (``--compile``, ``--context-mode``, ``--fused-kernels``, ...) apply to
dense and sparse alike, so their ratio compares the attention alone.

    python bench/train_throughput.py --gpus 4 --seq-lens 131072 262144 524288
    python bench/train_throughput.py --arch tiny --device cpu --gpus 2 --seq-lens 2048 --steps 4   # plumbing check
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench.* modules
from common import provenance, write_results  # noqa: E402

ARCHS = {
    "qwen2.5-3b": dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        max_position_embeddings=1048576,
        tie_word_embeddings=True,
        rope_theta=1.0e6,
    ),
    "tiny": dict(
        model_type="qwen2",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1048576,
        tie_word_embeddings=True,
    ),
}
MODES = {  # attention section per mode
    "dense": dict(sparse=False, layout="zigzag"),
    "sparse": dict(sparse=True, layout="striped", v_size=1024, s_size=6144, local_window=128),
}


def structured_checkpoint(folder: Path, arch: dict, seq_len: int, device: str, local_logit: float = 14.0) -> Path:
    """Random weights, except that each layer's q and k biases carry its KV head's local-band RoPE
    direction (``local_band_directions``), saved as a Hugging Face directory.

    With plain random weights every query attends almost uniformly, the estimated patterns come out
    dense (measured: density 1.000 at 128K) and the sparse run measures nothing. The shared biases
    give every head the local-heavy logits of real attention (``local_logit`` at distance 0, as in
    the structured synthetic inputs), so patterns have realistic density. Qwen2 has q/k biases.
    """
    from bench.synthetic import local_band_directions
    from mtraining.models import build_model

    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(config=arch)
    hq, hkv = arch["num_attention_heads"], arch["num_key_value_heads"]
    d = arch["hidden_size"] // hq
    u = local_band_directions(hkv, d, seq_len, arch.get("rope_theta", 1e6)).to(device)
    bias = u * math.sqrt(local_logit * math.sqrt(d))  # (a u).(a u) / sqrt(d) = local_logit
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.bias.copy_(bias.flatten())
            layer.self_attn.q_proj.bias.copy_(bias.repeat_interleave(hq // hkv, dim=0).flatten())
    path = folder / f"structured_{seq_len}"
    model.to(torch.bfloat16 if device == "cuda" else torch.float32).save_pretrained(path)
    return path


SAVED_OUTPUTS = {"false": False, "true": True, "auto": "auto"}
# How late a step's row may be read here after the step ends (the trainer's log line, then metrics.jsonl, on a busy
# host): a run is stopped when its next step, so late, would end past --time-limit-s. Without it, steps shorter than
# that delay (a tiny CPU run's 0.2 s) could let the limit strike mid-step instead.
ROW_DELAY_S = 2.0
# A run starts only with more than this left of --time-limit-s: launching one (torchrun, imports, the model) takes
# longer, so less could measure nothing.
MIN_RUN_S = 10.0


def write_config(folder: Path, args, seq_len: int, mode: str, tokens: Path, checkpoint: Path | None) -> Path:
    arch = ARCHS[args.arch]
    attention = dict(MODES[mode], block_size=128, backend="auto")
    if args.arch == "tiny":  # budgets and stripes that fit the short sequences of a plumbing check
        attention["block_size"] = 32
        if mode == "sparse":
            attention.update(v_size=64, s_size=256, local_window=32)
    model = dict(path=str(checkpoint)) if checkpoint is not None else dict(config=arch)
    cfg = dict(
        model=dict(model, dtype="bfloat16" if args.device == "cuda" else "float32"),
        attention=attention,
        parallel=dict(data=1, context=args.gpus, context_mode=args.context_mode, ring=args.ring),
        data=dict(sources=[str(tokens)], seq_len=seq_len, batch_size=1, shuffle=False),
        optim=dict(lr=1.0e-5, warmup_steps=1),
        train=dict(
            steps=args.steps,
            device=args.device,
            seed=0,
            activation_checkpointing=True,
            fused_kernels=args.fused_kernels,
            save_attention_outputs=SAVED_OUTPUTS[args.save_attention_outputs],
            loss_impl=args.loss_impl,
            compile=args.compile is not None,
            compile_backend=args.compile or "inductor",
        ),
        checkpoint=dict(dir=None),
        log=dict(
            dir=str(folder / "log"),
            every=1,
            recall=False,  # every step's time, without recall passes
            profile_step=args.steps if args.profile_dir else None,
        ),
    )
    path = folder / f"{mode}_{seq_len}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class StepRows:
    """The step rows of a run's metrics.jsonl as they are written (event rows such as the start marker left out)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def new(self) -> list[dict]:
        """Rows of whole lines written since the last call."""
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        whole = data[: data.rfind(b"\n") + 1]
        self._offset += len(whole)
        rows = [json.loads(line) for line in whole.decode().splitlines() if line.strip()]
        return [r for r in rows if "event" not in r]


STEP_FIELDS = ("step", "step_s", "tokens_per_s", "peak_mem_gb", "mfu", "density", "loss", "saved_attention_outputs")


def summarize(steps: list[dict], warmup: int, profiled: bool) -> dict:
    """Medians over the steps after ``warmup`` (and before a profiled last step; all steps when that leaves
    none), the largest peak memory (rank 0's), whether the timed steps kept the attention outputs
    (``train.save_attention_outputs``: a run that keeps them peaks higher and recomputes less, so peaks compare only
    between runs that agree), and every step's own figures."""
    if not steps:
        return dict(steps=[])
    timed = steps[warmup : len(steps) - profiled] or steps

    def median(key: str) -> float | None:
        return statistics.median(s[key] for s in timed) if all(key in s for s in timed) else None

    return dict(
        step_s=median("step_s"),
        tokens_per_s=median("tokens_per_s"),
        peak_mem_gb=max(s["peak_mem_gb"] for s in steps),
        mfu=median("mfu"),
        density=median("density"),
        saved_attention_outputs=_saved_outputs(timed),
        losses=[s["loss"] for s in steps],
        timed_steps=len(timed),
        steps=[{k: s.get(k) for k in STEP_FIELDS} for s in steps],
    )


def _saved_outputs(timed: list[dict]) -> bool | str | None:
    """True or False when every timed step agrees, "mixed" when not, None when the trainer does not say."""
    found = {s.get("saved_attention_outputs") for s in timed}
    if found == {None}:
        return None
    return bool(found.pop()) if len(found) == 1 else "mixed"


def run_one(
    path: Path,
    gpus: int,
    log_dir: Path,
    warmup: int,
    profiled: bool,
    on_step: Callable[[dict], None],
    time_limit_s: float | None = None,
) -> dict:
    """Train as configured through torchrun, streaming: the trainer's output is echoed as it comes and each
    finished step's row goes to ``on_step`` at once, so a run cut short keeps the steps it measured.

    ``time_limit_s``: the run is stopped (its processes killed: the trainer would finish its step first) once that
    long has passed, or at once when its next step, taken as long as its last (and read ``ROW_DELAY_S`` late),
    would end later. A SIGTERM to this
    process (``timeout``) kills the run too. Returns ``summarize`` of the steps, with ``error`` (the output's
    tail) when the run failed or was stopped.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={gpus}",
        "-m",
        "mtraining.cli",
        "train",
        str(path),
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env, start_new_session=True
    )
    why_stopped: list[str] = []

    def stop(why: str) -> None:
        why_stopped.append(why)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks: their own process group

    limit = f"the time limit ({time_limit_s:.0f} s)" if time_limit_s else ""
    timer = threading.Timer(time_limit_s, stop, [f"stopped at {limit}"]) if time_limit_s else None
    last_step = yaml.safe_load(path.read_text())["train"]["steps"]
    rows, steps, tail = StepRows(log_dir / "metrics.jsonl"), [], collections.deque(maxlen=40)

    def collect() -> None:
        for row in rows.new():
            steps.append(row)
            on_step(row)
            ends = time.monotonic() - started + row.get("step_s", 0) + ROW_DELAY_S  # the next step's end, at the latest
            late = time_limit_s and ends > time_limit_s
            if late and row["step"] < last_step and not why_stopped:
                stop(f"stopped after step {row['step']}: the next would end past {limit}")

    try:
        if timer is not None:
            timer.start()
        for line in proc.stdout:
            print(f"    | {line}", end="", flush=True)
            tail.append(line)
            collect()
        proc.wait()
    finally:
        if timer is not None:
            timer.cancel()
        if proc.poll() is None:
            stop("interrupted")
    collect()
    result = summarize(steps, warmup, profiled)
    if proc.returncode != 0:
        why = why_stopped[0] if why_stopped else f"exit status {proc.returncode}"
        result["error"] = f"{why}: " + "".join(tail)[-2000:]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=list(ARCHS), default="qwen2.5-3b")
    p.add_argument("--gpus", type=int, default=4, help="context-parallel ranks (GPUs, or gloo ranks on the CPU)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[131072, 262144, 524288])
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians (compilation)")
    p.add_argument(
        "--init",
        choices=["structured", "random"],
        default="structured",
        help="structured: random weights whose q/k biases give attention the local-heavy structure of "
        "trained heads (structured_checkpoint); random: plain random init (dense patterns)",
    )
    p.add_argument(
        "--fused-kernels",
        choices=["none", "liger"],
        default="none",
        help="train.fused_kernels: liger-kernel's fused RMSNorm/SwiGLU/RoPE (CUDA, needs liger-kernel)",
    )
    p.add_argument(
        "--save-attention-outputs",
        nargs="?",
        choices=["false", "true", "auto"],
        const="true",
        default="false",
        help="train.save_attention_outputs: the checkpoint recompute reuses each layer's attention output "
        "(bare flag: true; auto: from step 2 if step 1's memory allows). Default false: the "
        "trainer's own default is auto",
    )
    p.add_argument(
        "--loss-impl",
        choices=["chunked", "liger"],
        default="chunked",
        help="train.loss_impl: our chunked loss or liger-kernel's fused linear cross-entropy",
    )
    p.add_argument(
        "--profile-dir",
        type=Path,
        default=None,
        help="profile the last step (torch.profiler, left out of the medians) and copy rank 0's table "
        "of the costliest kernels here as profile_<mode>_<seq>_<fused kernels>.txt",
    )
    p.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        choices=["inductor", "aot_eager", "eager"],
        help="train.compile with this backend (bare flag: inductor): torch.compile each decoder layer, the "
        "attention call eager; dense and sparse alike",
    )
    p.add_argument(
        "--context-mode",
        choices=["ring", "allgather"],
        default="ring",
        help="parallel.context_mode of both modes: K/V around a ring, or all-gathered once per layer",
    )
    p.add_argument(
        "--ring", choices=["auto", "flat", "hierarchical"], default="auto", help="parallel.ring of both modes"
    )
    p.add_argument(
        "--time-limit-s",
        type=float,
        default=None,
        help="end within this many seconds of the start: a run still going then is stopped, or at once when its "
        f"next step would end later (the steps it finished are kept); a run left under {MIN_RUN_S:g} s is recorded as not run",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the JSON (default bench/results/train_throughput.json), rewritten after every step",
    )
    args = p.parse_args()
    started = time.monotonic()
    vocab = ARCHS[args.arch]["vocab_size"]
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokens = tmp / "tokens.npy"
        rng = np.random.default_rng(0)
        np.save(tokens, rng.integers(0, vocab, size=max(args.seq_lens) * (args.steps + 2), dtype=np.int64))
        for seq_len in args.seq_lens:
            checkpoint = (
                structured_checkpoint(tmp, ARCHS[args.arch], seq_len, args.device)
                if args.init == "structured"
                else None
            )
            for mode in args.modes:
                folder = tmp / f"{mode}_{seq_len}"
                folder.mkdir()
                path = write_config(folder, args, seq_len, mode, tokens, checkpoint)
                cfg = yaml.safe_load(path.read_text())
                rec = dict(
                    **provenance(on_gpu=args.device == "cuda"),
                    gpus=args.gpus,
                    model=args.arch,
                    seq_len=seq_len,
                    attention="mtraining sparse" if mode == "sparse" else "dense (cuDNN; zigzag ring if CP)",
                    layout=MODES[mode]["layout"],
                    context_mode=args.context_mode,
                    ring=args.ring,
                    init=args.init,
                    fused_kernels=args.fused_kernels,
                    compile=args.compile or "none",
                    save_attention_outputs=SAVED_OUTPUTS[args.save_attention_outputs],
                    loss_impl=args.loss_impl,
                    config=cfg,
                    complete=False,
                )
                records.append(rec)
                rows: list[dict] = []

                def on_step(row: dict, rec: dict = rec, rows: list = rows, mode: str = mode) -> None:
                    rows.append(row)
                    rec.update(summarize(rows, args.warmup, profiled))
                    write_results("train_throughput", records, args.out)
                    shown = " ".join(f"{k}={row[k]:.4g}" for k in STEP_FIELDS[1:] if row.get(k) is not None)
                    print(f"{seq_len:>8} {mode:>6} step {row['step']}: {shown}", flush=True)

                profiled = args.profile_dir is not None
                left = None if args.time_limit_s is None else args.time_limit_s - (time.monotonic() - started)
                if left is not None and left <= MIN_RUN_S:
                    rec["error"] = f"not run: --time-limit-s {args.time_limit_s:g} was spent"
                    write_results("train_throughput", records, args.out)
                    print(f"{seq_len:>8} {mode:>6} {rec['error']}", flush=True)
                    continue
                result = run_one(path, args.gpus, folder / "log", args.warmup, profiled, on_step, left)
                rec.update(result, complete="error" not in result)
                write_results("train_throughput", records, args.out)
                if profiled and "error" not in result:
                    args.profile_dir.mkdir(parents=True, exist_ok=True)
                    table = folder / "log" / f"profile_step{args.steps}_rank0.txt"
                    shutil.copy(table, args.profile_dir / f"profile_{mode}_{seq_len}_{args.fused_kernels}.txt")
                shown = {
                    k: rec.get(k)
                    for k in (
                        "step_s",
                        "tokens_per_s",
                        "peak_mem_gb",
                        "saved_attention_outputs",
                        "mfu",
                        "density",
                        "error",
                    )
                }
                print(f"{seq_len:>8} {mode:>6} {shown}", flush=True)
    print(f"wrote {write_results('train_throughput', records, args.out)}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # run_one kills the run on the way out
    main()

"""End-to-end training throughput: dense vs mtraining sparse attention (launches ``mtraining train``).

For each sequence length and attention mode it writes a config (Qwen2.5-3B architecture with random
weights by default, context parallel over all GPUs, bf16, activation checkpointing), trains a few
steps on random token ids through torchrun, and reads the trainer's metrics.jsonl: the median over
steps after warm-up of step time and tokens/s, the peak memory and MFU.

    python bench/train_throughput.py --gpus 4 --seq-lens 131072 262144 524288
    python bench/train_throughput.py --arch tiny --device cpu --gpus 2 --seq-lens 2048 --steps 4   # plumbing check
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
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
        parallel=dict(data=1, context=args.gpus),
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


def run_one(path: Path, gpus: int, log_dir: Path, warmup: int, profiled: bool) -> dict:
    """Train as configured; medians over the steps after ``warmup`` (and before a profiled last step)."""
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
    proc = subprocess.run(cmd, capture_output=True, text=True)
    metrics = log_dir / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.exists():
        return dict(error=(proc.stderr or proc.stdout)[-2000:])
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    timed = steps[warmup : len(steps) - profiled] or steps
    return dict(
        step_s=statistics.median(s["step_s"] for s in timed),
        tokens_per_s=statistics.median(s["tokens_per_s"] for s in timed),
        peak_mem_gb=max(s["peak_mem_gb"] for s in steps),
        mfu=statistics.median(s["mfu"] for s in timed) if all("mfu" in s for s in timed) else None,
        density=statistics.median(s["density"] for s in timed) if all("density" in s for s in timed) else None,
        losses=[s["loss"] for s in steps],
    )


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
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
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
                result = run_one(path, args.gpus, folder / "log", args.warmup, args.profile_dir is not None)
                if args.profile_dir is not None and "error" not in result:
                    args.profile_dir.mkdir(parents=True, exist_ok=True)
                    table = folder / "log" / f"profile_step{args.steps}_rank0.txt"
                    shutil.copy(table, args.profile_dir / f"profile_{mode}_{seq_len}_{args.fused_kernels}.txt")
                rec = dict(
                    **provenance(on_gpu=args.device == "cuda"),
                    gpus=args.gpus,
                    model=args.arch,
                    seq_len=seq_len,
                    attention="mtraining sparse" if mode == "sparse" else "dense (cuDNN; zigzag ring if CP)",
                    layout=MODES[mode]["layout"],
                    ring="flat",
                    init=args.init,
                    fused_kernels=args.fused_kernels,
                    save_attention_outputs=SAVED_OUTPUTS[args.save_attention_outputs],
                    loss_impl=args.loss_impl,
                    config=yaml.safe_load(path.read_text()),
                    **result,
                )
                records.append(rec)
                shown = {k: rec.get(k) for k in ("step_s", "tokens_per_s", "peak_mem_gb", "mfu", "density", "error")}
                print(f"{seq_len:>8} {mode:>6} {shown}", flush=True)
    print(f"wrote {write_results('train_throughput', records, args.out)}")


if __name__ == "__main__":
    main()

"""How soon does a Qwen2 model trained from scratch learn to copy from context, by size, init and training path?

Retrieval needs induction heads (find the earlier occurrence of the current token, predict what followed it).
Each run trains a fresh model (seed 0) on spans of 8-24 random token ids repeated (loss near ln(vocab) until
the model copies, near 1 nat once it does), AdamW lr 1e-3, 20 warm-up steps then constant, 64 x 128 tokens per step,
and records the loss every 50 steps. A run is ``hidden x layers``, ``init`` (``hf``: transformers' N(0, 0.02)
everywhere; ``depth_scaled``: mtraining's ``model.init``; ``zero``: residual output projections zero), and
how it trains:
- ``plain``: a plain PyTorch loop, bf16 autocast (float32 residual stream), one document per row;
- ``plain-stream``: the same loop on the samples of pipeline.py's token-copy stage file (EOS-separated
  documents, as the trainer reads them);
- ``plain-bf16``: one document per row, but forward and backward on a bfloat16 copy of the float32 weights
  (as FSDP's param_dtype=bfloat16 does: the residual stream is bfloat16 too);
- ``trainer`` / ``trainer-fp32``: ``mtraining train`` on that stage file (bf16 / float32 compute).

    python -m experiments.extension.induction_init --out bench/results/induction_init.json                  # the first six
    python -m experiments.extension.induction_init --runs paths --out bench/results/induction_paths.json   # trainer vs loop
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from bench.common import provenance
from mtraining.models import RESIDUAL_OUTPUTS, build_model, depth_scaled_init

from . import pipeline
from .settings import SCALES, Stage, qwen2

VOCAB, LENGTH = 2048, 128
Run = tuple[int, int, int, int, str, str]  # hidden, layers, heads, kv heads, init, path
PATHS = ("plain-stream", "plain-bf16", "trainer", "trainer-fp32")
RUN_SETS: dict[str, tuple[Run, ...]] = {
    # the GPU scale's 105M model first, then the 2-layer ones
    "inits": (
        (768, 12, 12, 4, "zero", "plain"),
        (768, 2, 12, 4, "zero", "plain"),
        (256, 2, 4, 2, "hf", "plain"),
        (768, 12, 12, 4, "depth_scaled", "plain"),
        (2048, 2, 32, 8, "zero", "plain"),
        (768, 2, 12, 4, "hf", "plain"),
    ),
    # the depth-scaled 105M model copies in the plain loop by step ~850, not in the trainer: which difference?
    "paths": tuple((768, 12, 12, 4, "depth_scaled", path) for path in PATHS),
    "smoke": tuple((64, 2, 1, 1, "depth_scaled", path) for path in ("plain", *PATHS)),  # the test's, on the CPU
}


def batch(step: int, size: int, device: str, stream: np.ndarray | None) -> torch.Tensor:
    """``size`` rows of LENGTH + 1 token ids: a random span (ids 1 .. VOCAB - 1) repeated, or a random sample of
    ``stream``."""
    rows = []
    for i in range(size):
        rng = random.Random(f"{step}-{i}")
        if stream is None:
            span = [rng.randrange(1, VOCAB) for _ in range(rng.randint(8, 24))]
            rows.append((span * (LENGTH // len(span) + 2))[: LENGTH + 1])
        else:
            start = rng.randrange(len(stream) // LENGTH - 1) * LENGTH  # sample i starts at i x LENGTH, as the trainer's
            rows.append(stream[start : start + LENGTH + 1].astype(np.int64).tolist())
    return torch.tensor(rows, device=device)


def model_config(hidden: int, layers: int, heads: int, kv: int) -> dict:
    """The run's Qwen2 config fields (tied embeddings, MLP 4x wide from 512 on, 3x below)."""
    return qwen2(hidden, layers, heads, kv, VOCAB, 4096)


def train(run: Run, steps: int, size: int, lr: float, device: str, stream: np.ndarray | None) -> list[float]:
    """A plain loop (``plain*`` paths); the loss every 50 steps."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, heads, kv, init, path = run
    torch.manual_seed(0)
    fields = model_config(hidden, layers, heads, kv)
    del fields["model_type"]
    config = Qwen2Config(**fields, rope_theta=10000.0)
    config._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(config).to(device)
    if init == "depth_scaled":
        depth_scaled_init(model)
    elif init == "zero":
        for name, param in model.named_parameters():
            if name.endswith(RESIDUAL_OUTPUTS):
                torch.nn.init.zeros_(param)
    work = copy.deepcopy(model).to(torch.bfloat16) if path == "plain-bf16" else None  # the compute copy
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    curve = []
    for step in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr * min(1, step / 20)
        x = batch(step, size, device, stream if path == "plain-stream" else None)
        if work is None:
            with torch.autocast(device, torch.bfloat16, enabled=device == "cuda"):  # the CPU's: float32
                logits = model(x[:, :-1]).logits
        else:
            with torch.no_grad():
                for low, master in zip(work.parameters(), model.parameters(), strict=True):
                    low.copy_(master)
            logits = work(x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        loss.backward()
        if work is not None:
            for low, master in zip(work.parameters(), model.parameters(), strict=True):
                master.grad, low.grad = low.grad.float(), None
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if step % 50 == 0:
            curve.append(round(loss.item(), 2))
    return curve


def token_stage(steps: int, size: int, lr: float, work: Path, device: str) -> tuple[dict, Stage, object]:
    """pipeline.py's token-copy stage file (its corpus) for ``steps`` steps at a constant lr."""
    stage = Stage(LENGTH, steps, size, lr, kinds=("tokens",), min_lr_ratio=1.0)
    scale = replace(SCALES["gpu"], curriculum=(stage,), extension=Stage(1024, 1, 1, 1e-3), eval_docs=1)
    if device != "cuda":
        scale = replace(scale, device="cpu", dtype="float32", backend="torch")
    return pipeline.corpus(scale, work, seed=0), stage, scale


def train_with_trainer(run: Run, data: dict, stage: Stage, scale, work: Path) -> list[float]:
    """``mtraining train`` on the token-copy stage file; the loss every 50 steps."""
    hidden, layers, heads, kv, init, path = run
    scale = replace(scale, model=model_config(hidden, layers, heads, kv), init=init)
    source = dict(config=scale.model, rope_theta=scale.base_theta)
    config = pipeline.train_config(scale, stage, work / path, data, "stage0", source, None, 0)
    if path == "trainer-fp32":
        config["model"]["dtype"] = "float32"
    by_step = {m["step"]: m["loss"] for m in pipeline.train(work / path, config)["curve"]}
    return [round(by_step[s], 2) for s in range(50, stage.steps + 1, 50)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", choices=sorted(RUN_SETS), default="inits")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=64, help="sequences of 128 tokens per step")
    p.add_argument("--work", type=Path, default=pipeline.ROOT / "runs" / "induction")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runs, stage_file = [], None
    result = dict(name="induction_init", **provenance(on_gpu=device == "cuda"), gpu_count=int(device == "cuda"))
    for run in RUN_SETS[args.runs]:
        hidden, layers, heads, kv, init, path = run
        started = time.time()
        if path != "plain" and stage_file is None:
            stage_file = token_stage(args.steps, args.batch, args.lr, args.work.resolve(), device)
        if path.startswith("trainer"):
            curve = train_with_trainer(run, *stage_file, args.work.resolve())
        else:
            stream = np.load(stage_file[0]["stage0"]["path"]) if path == "plain-stream" else None
            curve = train(run, args.steps, args.batch, args.lr, device, stream)
        with torch.device("meta"):
            parameters = sum(
                p.numel() for p in build_model(config=model_config(hidden, layers, heads, kv)).parameters()
            )
        runs.append(
            dict(hidden=hidden, layers=layers, heads=heads, kv_heads=kv, init=init, path=path, parameters=parameters,
                 lr=args.lr, steps=args.steps, loss_every_50_steps=curve, wall_s=round(time.time() - started))
        )  # fmt: skip
        print(json.dumps(runs[-1]), flush=True)
        result.update(vocab=VOCAB, length=LENGTH, batch=args.batch, runs=runs)
        args.out.write_text(json.dumps(result, indent=1) + "\n")  # after every run: a cut call keeps the others


if __name__ == "__main__":
    main()

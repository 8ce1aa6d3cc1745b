"""How soon does a Qwen2 model trained from scratch learn to copy from context, by size and initialisation?

Retrieval needs induction heads (find the earlier occurrence of the current token, predict what followed it).
Each run trains a fresh model on spans of 8-24 random token ids repeated to 128 tokens (loss near
ln(vocab) until the model copies, near 1 nat once it does) in a plain PyTorch loop (AdamW lr 1e-3,
20 warm-up steps then constant, bf16 autocast), and records the loss every 50 steps. ``init``: ``hf``
(transformers' N(0, 0.02) everywhere), ``depth_scaled`` (mtraining's ``model.init``: attention and MLP
output projections at 0.02 / sqrt(2 x layers)), ``zero`` (those projections zero).

    python bench/induction_init.py --out bench/results/induction_init.json     # one GPU, about 4 minutes
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import provenance  # noqa: E402

from mtraining.models.loader import depth_scaled_init  # noqa: E402

VOCAB, LENGTH, BATCH = 2048, 128, 64
# (hidden, layers, heads, kv heads, init): the GPU scale's 105M model first, then the 2-layer ones
RUNS = (
    (768, 12, 12, 4, "zero"),
    (768, 2, 12, 4, "zero"),
    (256, 2, 4, 2, "hf"),
    (768, 12, 12, 4, "depth_scaled"),
    (2048, 2, 32, 8, "zero"),
    (768, 2, 12, 4, "hf"),
)


def batch(step: int, device: str) -> torch.Tensor:
    """BATCH documents of LENGTH + 1 token ids: a random span (ids 1 .. VOCAB - 1) repeated."""
    rows = []
    for i in range(BATCH):
        rng = random.Random(f"{step}-{i}")
        span = [rng.randrange(1, VOCAB) for _ in range(rng.randint(8, 24))]
        rows.append((span * (LENGTH // len(span) + 2))[: LENGTH + 1])
    return torch.tensor(rows, device=device)


def train(hidden: int, layers: int, heads: int, kv: int, init: str, steps: int, lr: float, device: str) -> dict:
    """Train one model from seed 0; its loss every 50 steps."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=(4 if hidden >= 512 else 3) * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    config._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(config).to(device)
    if init == "depth_scaled":
        depth_scaled_init(model)
    elif init == "zero":
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                torch.nn.init.zeros_(param)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    curve, started = [], time.time()
    for step in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr * min(1, step / 20)
        x = batch(step, device)
        with torch.autocast(device, torch.bfloat16):
            logits = model(x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if step % 50 == 0:
            curve.append(round(loss.item(), 2))
    parameters = sum(p.numel() for p in model.parameters())
    return dict(
        hidden=hidden, layers=layers, heads=heads, kv_heads=kv, init=init, parameters=parameters, lr=lr,
        steps=steps, loss_every_50_steps=curve, wall_s=round(time.time() - started),
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runs = []
    for spec in RUNS:
        runs.append(train(*spec, steps=args.steps, lr=args.lr, device=device))
        print(json.dumps(runs[-1]), flush=True)
    result = dict(name="induction_init", **provenance(on_gpu=device == "cuda"), gpu_count=int(device == "cuda"))
    result.update(vocab=VOCAB, length=LENGTH, batch=BATCH, runs=runs)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

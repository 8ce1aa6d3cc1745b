"""The trainer's per-step overhead on a small model: ``Trainer.run`` against a plain PyTorch loop.

Both sides train the same Qwen2 config (``model.config``; float32 weights, computing in ``--dtype``) on
the same batches (the shipped corpus, drawn as the trainer draws them), one thread per process on the CPU:
- the trainer: ``Trainer(cfg).run()`` on gloo ranks (``run_local``: 1 rank, then context-parallel
  ranks), every step of its loop timed from one ``monitor.log`` to the next (data, step, metrics,
  logging; no checkpoints unless ``--set checkpoint...`` asks); ``--fsdp-groups layers`` forces FSDP2 on
  every decoder layer (what a world of one did before it wrapped the root only) for an A/B in one call;
- the plain loop: the Hugging Face model with its own attention (``--plain-attention``, SDPA by
  default), cross-entropy of its full logits, ``clip_grad_norm_`` and ``torch.optim.AdamW``; in bfloat16
  forward and backward run on a bfloat16 copy of the float32 weights (as FSDP's param_dtype does), whose
  gradients are cast back for the update.

Seconds per step are the median after ``--warmup`` steps, wall and CPU (user + sys of the process,
every thread; for several ranks the CPU of all ranks together, wall the slowest rank's); on CUDA each
mark first waits for the device. CPU time is the figure to trust on a loaded machine. ``--rounds``
repeats every run in alternation, one record per round.

    python bench/train_overhead.py --label after --out train_overhead.json   # appended under bench/results/
    python bench/train_overhead.py --ranks 1 --set attention.sparse=false   # one variant
    python bench/train_overhead.py --profile step.txt   # where rank 0's steps go: step_1rank.txt, ...
    python bench/train_overhead.py --dtype bfloat16 --ranks 1 --fsdp-groups layers auto --rounds 3
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, provenance  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data"


def raw_config(args: argparse.Namespace) -> dict:
    """The trainer config: a Qwen2 (2 layers by default), the README's CPU attention settings, logs
    (metrics.jsonl, TensorBoard when installed) in a temporary folder, no checkpoints."""
    return {
        "model": {
            "config": dict(
                model_type="qwen2",
                vocab_size=args.vocab,
                hidden_size=args.hidden,
                intermediate_size=args.intermediate or 2 * args.hidden,
                num_hidden_layers=args.layers,
                num_attention_heads=args.heads,
                num_key_value_heads=args.kv_heads,
                max_position_embeddings=4096,
                tie_word_embeddings=True,
            ),
            "dtype": args.dtype,
        },
        "attention": {
            "sparse": True,
            "layout": "striped",
            "block_size": 32,
            "backend": "torch",
            "v_size": 32,
            "s_size": 64,
            "last_q": 64,
            "local_window": 32,
            "dense_layers": [0],
        },
        "data": {
            "sources": [str(DATA / "tiny_corpus.jsonl")],
            "tokenizer": str(DATA / "tokenizer.json"),
            "seq_len": args.seq_len,
            "batch_size": args.batch,
        },
        "optim": {"lr": 1e-3, "warmup_steps": 2},
        "train": {
            "steps": args.warmup + args.steps,
            "seed": 0,
            "device": args.device,
            "activation_checkpointing": False,
        },
        "log": {"dir": args.log_dir, "progress": False, "every": 1},
    }


def _clock(device: str) -> tuple[float, float]:
    """Wall and CPU seconds now, once the device has finished what was queued."""
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter(), time.process_time()


def _per_step(marks: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds between consecutive marks."""
    return [b[0] - a[0] for a, b in zip(marks, marks[1:])], [b[1] - a[1] for a, b in zip(marks, marks[1:])]


def trainer_steps(cfg, warmup: int, profile: str | None = None, fsdp_groups: str = "auto") -> dict:
    """On each rank: train, marking the clocks when the loop starts and at each step's ``monitor.log``;
    with ``profile`` rank 0 writes a cProfile table (cumulative time) of the steps after the warm-up there.
    ``fsdp_groups``: "auto" (the trainer's ``fsdp_groups``), else the wrapping to force ("layers", "root")."""
    import torch.distributed as dist

    from mtraining.train import trainer as trainer_module

    if fsdp_groups != "auto":
        trainer_module.fsdp_groups = lambda world_size, dtype: fsdp_groups
    main_rank = dist.get_rank() == 0
    if dist.get_world_size() == 1:  # a world of one forms its own group, as `mtraining train` does (NCCL on CUDA)
        dist.destroy_process_group()
    trainer = trainer_module.Trainer(cfg)
    device = cfg.train.device
    marks = [_clock(device)]
    log = trainer.monitor.log
    profiler = cProfile.Profile() if profile is not None and main_rank else None

    def timed_log(step: int, metrics: dict) -> None:
        log(step, metrics)
        marks.append(_clock(device))
        if profiler is not None and step == warmup:
            profiler.enable()

    trainer.monitor.log = timed_log
    try:
        history = trainer.run()
    finally:
        trainer.close()
    if profiler is not None:
        profiler.disable()
        with open(profile, "w") as f:
            pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(60)
    wall, cpu = _per_step(marks)
    return {"wall": wall, "cpu": cpu, "losses": [m["loss"] for m in history]}


def batches(cfg, device: str) -> list[torch.Tensor]:
    """The samples [batch, seq_len + 1] of every step, as the trainer on one data rank draws them."""
    from mtraining.train.data import open_sources
    from mtraining.train.packing import PackedSamples, first_draw

    sources = open_sources(cfg, log=lambda line: None)
    d = cfg.data
    data = PackedSamples([s.stream for s in sources], d.seq_len, seed=cfg.train.seed, shuffle=d.shuffle)
    draws = [data.batch(first_draw(step, 0, 1, 0, 1, d.batch_size), d.batch_size) for step in range(cfg.train.steps)]
    return [samples.to(device) for samples in draws]


def plain_steps(cfg, attention: str) -> dict:
    """A plain loop: HF model and loss, AdamW (the trainer's hyperparameters), gradient clipping; below float32
    the forward and backward run on a copy of the weights in the model's dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mtraining.train.export import DTYPES

    device, dtype = cfg.train.device, DTYPES[cfg.model.dtype]
    steps = batches(cfg, device)
    torch.manual_seed(cfg.train.seed)
    hf_config = AutoConfig.for_model(**cfg.model.config)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=attention, dtype=torch.float32)
    model.to(device)
    work = copy.deepcopy(model).to(dtype) if dtype != torch.float32 else model  # the compute copy
    master, low = list(model.parameters()), list(work.parameters())
    o = cfg.optim
    optimizer = torch.optim.AdamW(master, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    marks, losses = [_clock(device)], []
    for samples in steps:
        inputs, labels = samples[:, :-1], samples[:, 1:]
        if work is not model:
            with torch.no_grad():
                torch._foreach_copy_(low, master)
        logits = work(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        if work is not model:
            for weight, copied in zip(master, low, strict=True):
                weight.grad, copied.grad = copied.grad.float(), None
        torch.nn.utils.clip_grad_norm_(master, o.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        marks.append(_clock(device))
    wall, cpu = _per_step(marks)
    return {"wall": wall, "cpu": cpu, "losses": losses}


def summarise(ranks: list[dict], warmup: int) -> dict:
    """Median seconds per step after warm-up: wall of the slowest rank, CPU of all ranks together."""
    wall = [max(r["wall"][i] for r in ranks) for i in range(warmup, len(ranks[0]["wall"]))]
    cpu = [sum(r["cpu"][i] for r in ranks) for i in range(warmup, len(ranks[0]["cpu"]))]
    return {
        "wall_s": statistics.median(wall),
        "cpu_s": statistics.median(cpu),
        "wall_steps": wall,
        "cpu_steps": cpu,
        "losses": ranks[0]["losses"],
    }


def measure(args: argparse.Namespace, round_: int = 0) -> dict:
    """The plain loop, then the trainer on each ``args.ranks`` and ``args.fsdp_groups``: the record of one round."""
    from mtraining.train.config import parse_config
    from mtraining.train.launch import run_local

    raw = raw_config(args)
    record = {**provenance(on_gpu=args.device == "cuda"), "label": args.label, "model": raw["model"]["config"]}
    record.update(seq_len=args.seq_len, batch=args.batch, steps=args.steps, warmup=args.warmup, overrides=args.set)
    record.update(dtype=args.dtype, round=round_)
    start = "spawn" if args.device == "cuda" else "fork"  # a forked rank cannot use CUDA the parent has started
    plain_cfg = parse_config(raw, args.set)
    plain = run_local(plain_steps, 1, plain_cfg, args.plain_attention, timeout=3600, start_method=start)
    plain = summarise(plain, args.warmup)
    record["plain"] = {"attention": args.plain_attention, **plain}
    print(f"plain loop: {plain['wall_s']:.4f} s/step wall, {plain['cpu_s']:.4f} s CPU", flush=True)
    record["trainer"] = []
    for world in args.ranks:
        cfg = parse_config(raw, [f"parallel.context={world}", *args.set])
        for groups in args.fsdp_groups:
            profile = None
            if args.profile is not None:
                suffix = "" if groups == "auto" else f"_{groups}"
                profile = str(args.profile.with_stem(f"{args.profile.stem}_{world}rank{suffix}"))
            ranks = run_local(trainer_steps, world, cfg, args.warmup, profile, groups, timeout=3600, start_method=start)
            run = summarise(ranks, args.warmup)
            run.update(ranks=world, fsdp_groups=groups)
            run.update(wall_ratio=run["wall_s"] / plain["wall_s"], cpu_ratio=run["cpu_s"] / plain["cpu_s"])
            record["trainer"].append(run)
            print(
                f"trainer, {world} rank(s), FSDP groups {groups}: {run['wall_s']:.4f} s/step wall "
                f"({run['wall_ratio']:.2f}x), {run['cpu_s']:.4f} s CPU ({run['cpu_ratio']:.2f}x)",
                flush=True,
            )
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default: 2 x hidden)")
    p.add_argument("--vocab", type=int, default=512, help="the model's vocabulary (the corpus uses ids below 512)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype (model.dtype)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="timed steps after the warm-up")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="context-parallel gloo ranks per run")
    p.add_argument(
        "--fsdp-groups",
        nargs="+",
        choices=["auto", "layers", "root"],
        default=["auto"],
        help="the trainer's FSDP2 wrapping per run: auto (the trainer's choice), layers (every decoder layer), root",
    )
    p.add_argument("--rounds", type=int, default=1, help="repeat every run this often, alternated; a record per round")
    p.add_argument("--plain-attention", default="sdpa", help="the plain loop's attn_implementation (sdpa, eager)")
    p.add_argument("--set", nargs="*", default=[], help="trainer config overrides (section.key=value)")
    p.add_argument(
        "--profile", type=Path, default=None, help="PATH: rank 0 writes a cProfile table of the steps (PATH_<N>rank)"
    )
    p.add_argument("--label", default="", help="a name for this measurement (e.g. before / after)")
    p.add_argument("--out", type=Path, default=None, help="append each round's record to this JSON list")
    args = p.parse_args()
    if args.device == "cuda" and args.ranks != [1]:
        p.error("--device cuda measures one GPU: use --ranks 1")
    out = None
    if args.out is not None:
        out = args.out if args.out.is_absolute() or args.out.parent != Path() else RESULTS_DIR / args.out
    for round_ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="train-overhead-") as log_dir:
            args.log_dir = log_dir
            record = measure(args, round_)
        if out is not None:  # after every round: a cut call keeps the rounds it finished
            records = json.loads(out.read_text()) if out.exists() else []
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(records + [record], indent=1) + "\n")
            print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()

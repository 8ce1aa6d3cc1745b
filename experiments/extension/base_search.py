"""Search for a base recipe that retrieves at the GPU scale of pipeline.py.

Named recipes (a model and a curriculum of ``Stage``s on the text corpus) are trained at the same time
on one GPU, each a chain of ``mtraining train`` runs as in pipeline.py, and each finished base is
checked on NIAH at several lengths (``evaluation.check_base``: held-out prompts, dense attention,
with what it generated), and on held-out copy documents (``copy_losses``: has the induction circuit formed?).
The JSON keeps every recipe, its loss curves and its checks; a recipe that passes goes into
``SCALES["gpu"].curriculum``.

    python -m experiments.extension.base_search --recipes mix1024,facts256,small --minutes 7 --out $OUT/search.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
import time
from dataclasses import replace
from pathlib import Path

from bench.common import provenance

from . import evaluation, pipeline, text_corpus
from .settings import RETRIEVAL_KINDS, SCALES, Scale, Stage, qwen2

REPEAT = Stage(256, 600, 64, 1e-3, repeat=True)  # induction first, as the GPU curriculum starts
TOKENS = Stage(128, 1000, 64, 1e-3, kinds=("tokens",))  # induction from random token ids repeated
COPY = Stage(128, 400, 128, 1e-3, kinds=("copy",))  # induction from random words repeated (no grammar to lean on)
COPY600 = Stage(128, 600, 128, 1e-3, kinds=("copy",))
NIAH256 = Stage(256, 800, 64, 1e-3, kinds=("niah",))
SMALL = qwen2(512, 6, 8, 4, 2048, 65536)  # 25M
TWO_LAYER = qwen2(256, 2, 4, 2, 2048, 65536)  # 2.1M
WIDE2 = qwen2(2048, 2, 32, 8, 2048, 65536)  # 126M
WIDE4 = qwen2(1536, 4, 24, 8, 2048, 65536)  # 142M
SHALLOW = qwen2(768, 2, 12, 4, 2048, 65536)  # 2 layers of the GPU scale's 105M model (19M)
Recipe = tuple[dict | None, tuple[Stage, ...]]
RECIPES: dict[str, Recipe] = {  # name: (model, None for the GPU scale's; stages)
    "mix1024": (None, (REPEAT, Stage(1024, 300, 64, 1e-3))),
    "facts512": (None, (REPEAT, Stage(512, 600, 64, 1e-3, kinds=("facts",)))),
    "facts256": (None, (REPEAT, Stage(256, 1000, 128, 1e-3, kinds=("facts",)))),
    "facts256-lr3e-4": (None, (REPEAT, Stage(256, 1000, 128, 3e-4, kinds=("facts",)))),
    "wide": (WIDE4, (REPEAT, Stage(1024, 300, 64, 1e-3))),
    "small": (SMALL, (REPEAT, Stage(256, 1000, 128, 1e-3, kinds=("facts",)))),
    "niah256": (None, (Stage(256, 1200, 64, 1e-3, kinds=("niah",)),)),
    "copy-niah256": (None, (COPY, NIAH256)),
    "repeat-niah256": (None, (REPEAT, NIAH256)),
    "small-copy-niah256": (SMALL, (COPY, NIAH256)),
    "copy-mix256": (None, (COPY, Stage(256, 800, 64, 1e-3))),
    "tokens-copy-niah256": (None, (TOKENS, COPY600, NIAH256)),
    # the same on a 2-layer model (a 2 x 128 one learns NIAH at 256 this way on the CPU), a 6 x 512 one, lr 3e-4
    "two-layer": (TWO_LAYER, (TOKENS, COPY600, NIAH256)),
    "small-tokens-copy-niah256": (SMALL, (TOKENS, COPY600, NIAH256)),
    # shallow and wide, over 100M parameters: 2 x 2048 (125M) and 4 x 1536 (150M); the 2-layer one on to 1024
    "wide2": (WIDE2, (TOKENS, COPY600, NIAH256)),
    "wide4": (WIDE4, (TOKENS, COPY600, NIAH256)),
    # does a lower lr let the big models' induction form? (the token-copy stage alone; its loss curve says)
    "wide2-tokens-lr2.5e-4": (WIDE2, (replace(TOKENS, lr=2.5e-4),)),
    "wide2-tokens-lr1e-4": (WIDE2, (replace(TOKENS, lr=1e-4),)),
    "gpu-tokens-lr2.5e-4": (None, (replace(TOKENS, lr=2.5e-4),)),
    # does the 105M model leave the plateau given more steps? (~8 minutes alone on one H200)
    "gpu-tokens-long": (None, (replace(TOKENS, steps=3500),)),
    "gpu-long-copy-niah256": (None, (replace(TOKENS, steps=3500), COPY600, NIAH256)),
    # the GPU scale's model with depth_scaled init: its token copying forms near step 850 at a constant lr
    # (bench/results/induction_init.json), not under a cosine decay over 1500 steps
    "gpu-constant-copy-niah256": (None, (replace(TOKENS, steps=1500, min_lr_ratio=1.0), COPY600, NIAH256)),
    # does a 2-layer model of the 105M's width form the circuit? (a base to grow in depth)
    "shallow-tokens": (SHALLOW, (TOKENS,)),
    "two-layer-1024": (TWO_LAYER, (TOKENS, COPY600, NIAH256, Stage(1024, 400, 32, 1e-3, kinds=RETRIEVAL_KINDS))),
    "tokens-copy-niah256-lr3e-4": (None, tuple(replace(st, lr=3e-4) for st in (TOKENS, COPY600, NIAH256))),
}
_LOADING = threading.Lock()  # Hugging Face's meta-device model construction is not thread-safe


def search(scale: Scale, recipes: dict[str, Recipe], lengths: list[int], work: Path, samples: int) -> dict:
    """Train every recipe (one thread each, its runs are subprocesses), then check each base at ``lengths``."""
    stages = list(dict.fromkeys(st for _, curriculum in recipes.values() for st in curriculum))  # one file each
    union = replace(scale, curriculum=tuple(stages), extension=Stage(scale.long, 1, 1, 1e-3), eval_docs=1)
    digest = hashlib.sha1(json.dumps([vars(st) for st in stages], sort_keys=True).encode()).hexdigest()[:8]
    data = pipeline.corpus(union, work / f"data-{digest}", seed=0)  # one corpus per set of stages
    results: dict[str, dict] = {}

    def run(name: str) -> None:
        model, curriculum = recipes[name]
        recipe = replace(scale, model=model or scale.model)
        source, runs = dict(config=recipe.model, rope_theta=recipe.base_theta), []
        out = results[name] = {"model": recipe.model, "init": recipe.init, "stages": [vars(st) for st in curriculum]}
        out["runs"] = runs
        try:
            for i, st in enumerate(curriculum):
                run_dir = work / name / f"stage{i}"
                config = pipeline.train_config(recipe, st, run_dir, data, f"stage{stages.index(st)}", source, None, 0)
                summary = pipeline.train(run_dir, config)
                runs.append({k: summary[k] for k in ("run", "steps", "final_loss", "wall_s", "curve")})
                source = dict(path=str(run_dir / "export"))
        except pipeline.OutOfTime:
            out["stopped"] = "out of time before the base was trained"
            return
        with _LOADING:
            out["induction"] = copy_losses(source["path"], recipe)
            pipeline.say(f"{name}: copy documents' loss {out['induction']}")
            out["checks"] = {}
            for n in lengths:
                checked = evaluation.check_base(source["path"], replace(recipe, l0=n, base_check=samples), 0)
                found = checked["accuracy"]
                out["checks"][str(n)] = {"accuracy": found, "examples": checked["examples"]}
                pipeline.say(f"{name} at {n}: NIAH {found['percent']:.0f}% {[round(x) for x in found['interval']]}")

    threads = [threading.Thread(target=run, args=(name,)) for name in recipes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def copy_losses(export: str, scale: Scale, documents: int = 20, length: int = 256) -> dict:
    """Mean loss (nats) on held-out copy documents (a span of random words repeated): ``first`` over the first
    quarter of each document, ``copied`` over its second half. A model that copies (an induction circuit, which
    retrieval needs) has ``copied`` far below ``first``; without one the two are about equal."""
    import torch

    loaded = evaluation.load_export(export, scale)
    first, copied = [], []
    for seed in range(documents):
        ids = loaded.tokenizer.encode([text_corpus.copy_document(-1 - seed, length // 4)])[0][:length]
        x = torch.tensor([ids], device=next(loaded.model.parameters()).device)
        with torch.no_grad():
            losses = torch.nn.functional.cross_entropy(
                loaded.model(x).logits[0, :-1].float(), x[0, 1:], reduction="none"
            )
        first.append(losses[: len(losses) // 4].mean().item())
        copied.append(losses[len(losses) // 2 :].mean().item())
    return {"first": round(sum(first) / documents, 3), "copied": round(sum(copied) / documents, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default="mix1024,facts256,small", help=f"comma-separated, of {sorted(RECIPES)}")
    p.add_argument("--scale", default="gpu", choices=["gpu", "toy-text"], help="toy-text: the CPU test's miniature")
    p.add_argument("--lengths", default="256,512,1024,4096", help="NIAH lengths of the checks")
    p.add_argument("--samples", type=int, default=20, help="NIAH prompts per check")
    p.add_argument("--minutes", type=float, default=None, help="stop trainings at this time (checks still run)")
    p.add_argument("--work", type=Path, default=pipeline.ROOT / "runs" / "base_search")
    p.add_argument("--out", type=Path, required=True, help="the JSON to write")
    args = p.parse_args()
    names = [n.strip() for n in args.recipes.split(",") if n.strip()]
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        p.error(f"unknown recipes {unknown}; use some of {sorted(RECIPES)}")
    scale = SCALES[args.scale]
    recipes = {name: RECIPES[name] for name in names}
    if args.scale != "gpu":  # the miniature: the scale's model, every stage 2 steps of 2 sequences at its L0
        tiny = {
            name: tuple(replace(st, steps=2, batch=2, seq_len=scale.l0) for st in c) for name, (_, c) in recipes.items()
        }
        recipes = {name: (None, curriculum) for name, curriculum in tiny.items()}
    if args.minutes is not None:
        pipeline.Clock.deadline = time.time() + 60 * args.minutes
    args.work = args.work.resolve()  # training configs resolve their paths from their own folder
    args.work.mkdir(parents=True, exist_ok=True)
    pipeline.LOG.append(args.work / "search.log")
    started = time.time()
    lengths = [int(n) for n in args.lengths.split(",")]
    results = search(scale, recipes, lengths, args.work, args.samples)
    result = dict(name="base_search", **provenance(on_gpu=scale.device == "cuda"), wall_s=round(time.time() - started))
    result.update(scale=scale.name, lengths=lengths, samples=args.samples, recipes=results)
    pipeline.write_json(args.out, result)
    pipeline.say(f"wrote {args.out}")


if __name__ == "__main__":
    main()

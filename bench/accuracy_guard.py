"""Accuracy guard: a ~100M-parameter Qwen2 model trained with dense and with sparse attention from the
same seed and the same data order ends within 2% of the dense loss; then both checkpoints are
evaluated (``mtraining eval ppl / niah / ruler / report``).

One script, meant for one GPU (an H200: about 6-8 minutes with the defaults):

1. Corpus (seconds, deterministic from ``--seed``): long synthetic documents with long-range
   structure, tokenised with the shipped byte-level BPE (``data/tokenizer.json``, vocab 512) into
   one ``.npy`` token file of about ``steps x seq_len`` tokens (no sample repeats). The mixture:
   needle documents in the exact format of ``mtraining eval niah/ruler`` (a haystack of the
   built-in filler grammar with "The secret number of KEY is N." needles, then "Question: ...
   Answer: ..."; single/multi-key/multi-value/multi-query), variable-tracking chains (RULER ``vt``
   format), "recall logs" (filler with facts stated and asked again thousands of tokens later) and
   the inventory logs of ``data/make_tiny_corpus.py``. Training seeds are disjoint from the eval's
   prompt seeds, so the eval asks for needles the model never saw -- but the *formats* are in
   distribution (a 100M model trained for a few hundred steps cannot be expected to follow
   instructions it never saw). ``cwe``/``fwe`` (counting tasks) are not in the training mixture.
2. Two configs that differ only in ``attention`` (dense vs dynamic sparse: striped layout,
   block 128, v_size 512, s_size 2048, local window 128, layer 0 dense), same seed and data order,
   seq_len 16384, batch 1, one rank (context parallel 1), bf16 on CUDA, activation checkpointing,
   AdamW with linear warm-up and cosine decay.
3. Each trains through the real CLI (``torchrun --standalone --nproc_per_node=1 -m mtraining.cli
   train``) and exports a Hugging Face directory. Time control: the dense run is watched; if after
   ``--probe-steps`` steps its projected time exceeds ``--max-minutes``, it is stopped and restarted
   once with as many steps as fit (the sparse run then uses the same number of steps).
4. ``accuracy_guard.json`` (device, commit, command, both configs, loss curves per step, tokens/s,
   density, recall, final loss = mean of the last 20 steps, relative gap, pass/fail against 2%) and
   ``accuracy_guard.png`` (both curves; the sparse pattern's density and recall).
5. ``mtraining eval ppl`` (held-out generated documents), ``niah`` (built-in filler) and ``ruler``
   (all tasks) on the dense-trained and the sparse-trained export, each with dense and with sparse
   attention (4 labels, run concurrently: on the GPU they are small; sparse evaluation keeps layer 0
   dense as training did), then ``mtraining eval report``.

Outputs (at most 8 files, flat, so the device tool returns them all):
    accuracy_guard.json, accuracy_guard.png, accuracy_guard.log (this script's console),
    eval_accuracy_guard.json (every eval JSON: {label: {ppl, niah, ruler}} plus report.md's text),
    eval_report.md, eval_ppl_by_position.png, eval_niah_heatmaps.png, eval_ruler_by_length.png
into ``--out DIR`` (default: bench/results/, where the bundle is also split into
``eval_<label>_<task>.json``; ``--unbundle FILE`` splits a bundle fetched from the device).

    # on one GPU (see configs/README.md for the device command with the pydantic wheels)
    python bench/accuracy_guard.py --out $OUT
    # CPU plumbing check (gloo, torch backend; a 2-layer model, seconds per step)
    python bench/accuracy_guard.py --device cpu --arch tiny --seq-len 1024 --steps 6 --out /tmp/guard
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from common import RESULTS_DIR, command_line, commit, device_name  # noqa: E402

from mtraining.data.tokenizer import TextTokenizer  # noqa: E402
from mtraining.eval.documents import Haystack, filler_sentences  # noqa: E402
from mtraining.eval.tasks import _build_niah, _build_vt, _keys, _numbers, _render  # noqa: E402  (same format as the eval)

TOKENIZER = ROOT / "data" / "tokenizer.json"
GOAL = 0.02  # sparse final loss within 2% of dense
ARCHS = {
    # ~104M parameters: 12 x (attention 1.38M + MLP 7.08M) + 0.4M tied embedding (vocab 512)
    "small": dict(
        model_type="qwen2",
        vocab_size=512,
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        model_type="qwen2",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
}
SPARSE = {  # attention budgets per arch (tiny: fit a 1K-token plumbing check)
    "small": dict(block_size=128, v_size=512, s_size=2048, local_window=128, last_q=64),
    "tiny": dict(block_size=32, v_size=64, s_size=256, local_window=32, last_q=64),
}
DENSE_LAYERS = [0]  # layers that stay dense in the sparse configuration (training and sparse evaluation)
LOG: list[Path] = []  # the console is also appended here (set in main), so a killed run leaves its log


def say(*parts) -> None:
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    for path in LOG:
        with open(path, "a") as f:
            f.write(line + "\n")


# ---------------------------------------------------------------------------------------------- corpus
def _load_tiny_corpus_module():
    spec = importlib.util.spec_from_file_location("make_tiny_corpus", ROOT / "data" / "make_tiny_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _listing(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + f" and {items[-1]}"


def recall_log(seed: int, sentences: int) -> str:
    """Filler with facts stated at random points and asked again later (any distance back)."""
    rng = random.Random(f"guard-recall-{seed}")
    keys = _keys(rng, 120)
    values = _numbers(rng, 120)
    facts: list[int] = []
    out = []
    for sentence in filler_sentences(sentences, seed):
        out.append(sentence)
        r = rng.random()
        if r < 0.05 and len(facts) < len(keys):
            i = len(facts)
            facts.append(i)
            out.append(f"The secret number of {keys[i]} is {values[i]}.")
        elif r < 0.10 and facts:
            i = rng.choice(facts)
            out.append(
                f"Question: What is the secret number of {keys[i]}? Answer: The secret number of {keys[i]} is {values[i]}."
            )
    return " ".join(out)


def make_document(kind: str, seed: int, max_sentences: int, inventory) -> str:
    """One training/held-out document of ``kind`` from ``seed`` (pure function of its arguments)."""
    rng = random.Random(f"guard-{kind}-{seed}")
    knob = int(math.exp(rng.uniform(math.log(8), math.log(max_sentences))))
    if kind == "niah":
        task = rng.choice(["niah_single", "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"])
        parts = _build_niah(task, seed, knob, Haystack(seed=seed), None)
        return _render(parts) + " " + _listing(parts.answers) + "."
    if kind == "vt":
        parts = _build_vt(seed, knob, Haystack(seed=seed))
        return _render(parts) + " " + _listing(parts.answers) + "."
    if kind == "recall":
        return recall_log(seed, knob)
    return " ".join(inventory.make_document(rng) for _ in range(rng.randint(1, 20)))


KINDS = ("niah", "niah", "niah", "niah", "vt", "recall", "recall", "recall", "inventory", "inventory")


def build_corpus(path: Path, tokens_needed: int, seq_len: int, seed: int) -> dict:
    """Token file of at least ``tokens_needed`` tokens of mixed documents, EOS after each."""
    started = time.time()
    tok = TextTokenizer(TOKENIZER)
    eos = tok.separator_id(None)
    inventory = _load_tiny_corpus_module()
    max_sentences = max(16, int(seq_len / 35 * 1.5))  # ~35 tokens per filler sentence; some documents span samples
    parts, total, n_docs, counts = [], 0, 0, {}
    doc_seed = 1_000_000 + 10_000 * seed  # eval prompts use seeds 0.. : disjoint
    while total < tokens_needed:
        kinds = [KINDS[random.Random(f"guard-kind-{doc_seed + i}").randrange(len(KINDS))] for i in range(128)]
        docs = [make_document(k, doc_seed + i, max_sentences, inventory) for i, k in enumerate(kinds)]
        for kind, ids in zip(kinds, tok.encode(docs)):
            parts.append(np.asarray(ids + [eos], dtype=np.uint16))
            total += len(ids) + 1
            counts[kind] = counts.get(kind, 0) + len(ids) + 1
        doc_seed += 128
        n_docs += 128
    stream = np.concatenate(parts)
    np.save(path, stream)
    return dict(
        tokens=int(stream.size),
        documents=n_docs,
        tokens_by_kind=counts,
        sha256=hashlib.sha256(stream.tobytes()).hexdigest()[:16],
        seconds=round(time.time() - started, 2),
    )


def build_heldout(path: Path, min_tokens: int, count: int, seq_len: int, seed: int) -> dict:
    """JSONL of ``count`` held-out recall logs of at least ``min_tokens`` tokens (seeds unused in training)."""
    tok = TextTokenizer(TOKENIZER)
    docs, s = [], 0
    sentences = int(min_tokens / 35 * 1.3) + 8
    while len(docs) < count:
        doc = recall_log(9_000_000 + 10_000 * seed + s, sentences)
        s += 1
        if len(tok.encode([doc])[0]) >= min_tokens + 8:
            docs.append(doc)
        else:
            sentences = int(sentences * 1.2)
    with open(path, "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    return dict(documents=len(docs), min_tokens=min_tokens)


# ---------------------------------------------------------------------------------------------- training
def write_config(folder: Path, args, mode: str, tokens: Path, steps: int) -> Path:
    attention = dict(
        SPARSE[args.arch],
        layout="striped",
        backend="auto",
        sparse=mode == "sparse",
        dense_layers=DENSE_LAYERS,
        max_density=None,
    )  # every sparse step stays sparse: this guards sparse accuracy
    if args.v_size:
        attention["v_size"] = args.v_size
    if args.s_size:
        attention["s_size"] = args.s_size
    cfg = dict(
        model=dict(
            config=ARCHS[args.arch],
            dtype="bfloat16" if args.device == "cuda" else "float32",
            rope_theta=args.rope_theta,
        ),
        attention=attention,
        parallel=dict(data=1, context=1),
        data=dict(sources=[str(tokens)], tokenizer=str(TOKENIZER), seq_len=args.seq_len, batch_size=1, shuffle=True),
        optim=dict(lr=args.lr, warmup_steps=max(1, steps // 10), min_lr_ratio=0.1, weight_decay=0.1, grad_clip=1.0),
        train=dict(steps=steps, device=args.device, seed=args.seed, activation_checkpointing=True),
        checkpoint=dict(dir=None, export_dir=str(folder / "export")),
        log=dict(dir=str(folder / "log"), every=1, tensorboard=False, progress=False),
    )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "train.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def read_metrics(folder: Path) -> list[dict]:
    path = folder / "log" / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
    return [r for r in rows if "event" not in r]  # step rows (start / resume markers left out)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def train_once(folder: Path, cfg: Path, steps: int, args, probe: bool, deadline: float) -> dict:
    """Run one training; returns {status: done|retry|failed|timeout, metrics, wall_s, new_steps?}."""
    if folder.joinpath("log").exists():
        shutil.rmtree(folder / "log")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        "-m",
        "mtraining.cli",
        "train",
        str(cfg),
    ]
    log = open(folder / "train.log", "w")
    started = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    budget = args.max_minutes * 60
    hard_limit = min(2.0 * budget + 180, deadline - 60 - started)  # startup and compilation included
    shown = 0
    try:
        while proc.poll() is None:
            time.sleep(1.0)
            rows = read_metrics(folder)
            if rows and (len(rows) - shown >= max(1, steps // 12)):
                shown = len(rows)
                r = rows[-1]
                extra = (
                    f" density={r['density']:.3f} recall={r.get('recall', float('nan')):.3f}" if "density" in r else ""
                )
                say(f"    step {r['step']}/{steps} loss={r['loss']:.4f} step_s={r['step_s']:.3f}{extra}")
            if probe and len(rows) >= args.probe_steps and steps > args.probe_steps:
                probe = False
                step_s = statistics.median(
                    r["step_s"] for r in rows[args.probe_steps // 2 : args.probe_steps]
                )  # past compilation
                projected = step_s * steps
                if projected > budget:
                    new_steps = max(args.probe_steps + 1, int(0.92 * budget / step_s))
                    say(
                        f"    projected {projected:.0f}s for {steps} steps > --max-minutes {args.max_minutes}: "
                        f"restarting with {new_steps} steps ({step_s:.3f} s/step)"
                    )
                    _kill(proc)
                    return dict(status="retry", new_steps=new_steps, wall_s=time.time() - started)
            if time.time() - started > hard_limit:
                say(f"    run exceeded {hard_limit:.0f}s: stopped")
                _kill(proc)
                return dict(status="timeout", metrics=read_metrics(folder), wall_s=time.time() - started)
    finally:
        log.close()
    rows = read_metrics(folder)
    status = (
        "done"
        if proc.returncode == 0 and len(rows) == steps and (folder / "export" / "config.json").exists()
        else "failed"
    )
    if status == "failed":
        say(f"    training failed (exit {proc.returncode}); last lines of {folder / 'train.log'}:")
        for line in (folder / "train.log").read_text().splitlines()[-25:]:
            say("      " + line)
    return dict(status=status, metrics=rows, wall_s=time.time() - started)


def summarise(mode: str, cfg_path: Path, run: dict, last: int) -> dict:
    rows = run.get("metrics") or []
    timed = rows[2:] or rows
    rec = dict(
        mode=mode,
        status=run["status"],
        wall_s=round(run["wall_s"], 1),
        config=yaml.safe_load(cfg_path.read_text()),
        steps=len(rows),
    )
    if not rows:
        return rec
    tail = rows[-last:]
    rec.update(
        final_loss=statistics.fmean(r["loss"] for r in tail),
        final_loss_steps=len(tail),
        tokens_per_s=statistics.median(r["tokens_per_s"] for r in timed),
        step_s=statistics.median(r["step_s"] for r in timed),
        peak_mem_gb=max(r["peak_mem_gb"] for r in rows),
        mfu=statistics.median(r["mfu"] for r in timed) if all("mfu" in r for r in timed) else None,
        density=statistics.fmean(r["density"] for r in timed) if all("density" in r for r in timed) else None,
        recall=statistics.fmean(r["recall"] for r in timed if "recall" in r)
        if any("recall" in r for r in timed)
        else None,
        curve=[
            dict(
                step=r["step"],
                **{k: r[k] for k in ("loss", "lr", "grad_norm", "step_s", "density", "recall") if k in r},
            )
            for r in rows
        ],
    )
    return rec


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(records: dict, path: Path, title: str) -> Path:
    """Loss curves (raw and a moving average), the relative gap per step, the sparse pattern's density and recall."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_gap, ax2) = plt.subplots(1, 3, figsize=(15, 4.5), gridspec_kw=dict(width_ratios=[2, 1.2, 1]))
    colours = dict(dense="tab:blue", sparse="tab:orange")
    curves = {m: r["curve"] for m, r in records.items() if r.get("curve")}
    window = max(1, max((len(c) for c in curves.values()), default=1) // 25)
    for mode, curve in curves.items():
        steps, loss = [c["step"] for c in curve], [c["loss"] for c in curve]
        ax.plot(steps, loss, color=colours[mode], alpha=0.25, lw=0.8)
        ax.plot(
            steps,
            _moving_average(loss, window),
            color=colours[mode],
            lw=2,
            label=f"{mode} (final {records[mode]['final_loss']:.4f})",
        )
        if mode == "sparse" and "density" in curve[0]:
            ax2.plot(steps, [c.get("density") for c in curve], label="density (kept / causal pairs)")
            ax2.plot(steps, [c.get("recall") for c in curve], label="recall (attention mass kept)")
    if len(curves) == 2:
        n = min(len(curves["dense"]), len(curves["sparse"]))
        gap = [100 * (s["loss"] - d["loss"]) / d["loss"] for d, s in zip(curves["dense"][:n], curves["sparse"][:n])]
        steps = [c["step"] for c in curves["dense"][:n]]
        ax_gap.plot(steps, gap, color="grey", alpha=0.3, lw=0.8)
        ax_gap.plot(
            steps, _moving_average(gap, window), color="black", lw=1.5, label=f"moving average ({window} steps)"
        )
        ax_gap.axhline(100 * GOAL, color="red", ls="--", lw=1, label=f"goal: +{GOAL:.0%}")
        ax_gap.axhline(0, color="grey", lw=0.8)
        ax_gap.legend(fontsize=8)
    ax.set(xlabel="step", ylabel="training loss (nats/token)", title=title)
    ax.legend()
    ax.grid(alpha=0.3)
    ax_gap.set(xlabel="step", ylabel="%", title="sparse vs dense loss, same step")
    ax_gap.grid(alpha=0.3)
    ax2.set(xlabel="step", title="sparse pattern (sparse layers)", ylim=(0, 1.05))
    ax2.legend(loc="lower right", fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------- evaluation
def eval_jobs(args, exports: dict[str, Path], heldout: Path, work: Path) -> list[tuple[str, list[list[str]]]]:
    """Per label (trained-attention): the eval commands to run one after the other."""
    sp = SPARSE[args.arch]
    sparse_flags = [
        "--attention",
        "sparse",
        "--v-size",
        str(args.v_size or sp["v_size"]),
        "--s-size",
        str(args.s_size or sp["s_size"]),
        "--local-window",
        str(sp["local_window"]),
        "--last-q",
        str(sp["last_q"]),
        "--dense-layers",
        ",".join(map(str, DENSE_LAYERS)),
    ]
    base = [sys.executable, "-m", "mtraining.cli", "eval"]
    jobs = []
    for trained, export in exports.items():
        for attention in ("dense", "sparse"):
            label = f"{trained}-trained_{attention}-attn"
            common = ["--block-size", str(sp["block_size"]), "--label", label, "--out-dir", str(work / "eval" / label)]
            # generation: prefill all but the last partial block through the attention under test (default granule 2048
            # would leave up to 2047 prompt tokens to the dense tail)
            granule = ["--prefill-granule", str(sp["block_size"])]
            common += sparse_flags if attention == "sparse" else ["--attention", "dense"]
            if args.device == "cpu":
                common += ["--device", "cpu"]
            cmds = [
                base
                + [
                    "ppl",
                    str(export),
                    "--data",
                    str(heldout),
                    "--lengths",
                    args.eval_lengths,
                    "--samples",
                    str(args.ppl_samples),
                    "--first-bucket",
                    str(args.first_bucket),
                ]
                + common,
                base
                + [
                    "niah",
                    str(export),
                    "--lengths",
                    args.eval_lengths,
                    "--depths",
                    "0,25,50,75,100",
                    "--samples",
                    str(args.niah_samples),
                ]
                + granule
                + common,
                base
                + [
                    "ruler",
                    str(export),
                    "--lengths",
                    args.eval_lengths,
                    "--tasks",
                    args.ruler_tasks,
                    "--samples",
                    str(args.ruler_samples),
                ]
                + granule
                + common,
            ]
            jobs.append((label, cmds))
    return jobs


def run_evals(jobs, work: Path, deadline: float, parallel: int) -> dict:
    """Run each label's commands in order, ``parallel`` labels at a time; stop everything at ``deadline``."""
    status: dict[str, list[str]] = {label: [] for label, _ in jobs}
    pending = [(label, list(cmds)) for label, cmds in jobs]
    running: dict[str, tuple[subprocess.Popen, list[list[str]], object, float]] = {}
    while pending or running:
        while pending and len(running) < parallel:
            label, cmds = pending.pop(0)
            running[label] = (None, cmds, None, 0.0)
        for label in list(running):
            proc, cmds, log, t0 = running[label]
            if proc is not None and proc.poll() is None:
                if time.time() > deadline:
                    _kill(proc)
                    log.close()
                    status[label].append(f"{cmds[0][4]}: stopped at the deadline")
                    status[label] += [f"{c[4]}: skipped (deadline)" for c in cmds[1:]]
                    say(f"  eval {label} {cmds[0][4]}: stopped at the deadline")
                    del running[label]
                continue
            if proc is not None:
                log.close()
                task = cmds.pop(0)[4]
                ok = proc.returncode == 0
                status[label].append(
                    f"{task}: {'ok' if ok else f'failed (exit {proc.returncode})'} in {time.time() - t0:.0f}s"
                )
                say(f"  eval {label} {status[label][-1]}")
                if not ok:
                    for line in Path(log.name).read_text().splitlines()[-12:]:
                        say("      " + line)
            if not cmds or time.time() > deadline:
                if cmds:
                    status[label] += [f"{c[4]}: skipped (deadline)" for c in cmds]
                del running[label]
                continue
            log = open(work / f"eval_{label}_{cmds[0][4]}.log", "w")
            proc = subprocess.Popen(
                cmds[0],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=ROOT,
                env=dict(os.environ, COLUMNS="160"),
            )
            running[label] = (proc, cmds, log, time.time())
        time.sleep(1.0)
    return status


def collect_evals(work: Path, status: dict) -> dict:
    bundle = {}
    for label, notes in status.items():
        entry = {"status": notes}
        for task in ("ppl", "niah", "ruler"):
            path = work / "eval" / label / f"{task}.json"
            if path.exists():
                entry[task] = json.loads(path.read_text())
        bundle[label] = entry
    return bundle


def eval_summary(bundle: dict) -> list[str]:
    lines = []
    for label, entry in bundle.items():
        bits = []
        if "ppl" in entry:
            bits.append("ppl " + ", ".join(f"{r['length']}: {r['ppl']:.3f}" for r in entry["ppl"]["result"]))
        if "niah" in entry:
            res = entry["niah"]["result"]
            per_len = [statistics.fmean(row[i] for row in res["scores"]) for i in range(len(res["lengths"]))]
            bits.append("niah % " + ", ".join(f"{n}: {v:.0f}" for n, v in zip(res["lengths"], per_len)))
        if "ruler" in entry:
            res = entry["ruler"]["result"]
            bits.append("ruler avg % " + ", ".join(f"{n}: {v:.0f}" for n, v in zip(res["lengths"], res["average"])))
        lines.append(f"  {label}: " + " | ".join(bits or entry["status"]))
    return lines


def unbundle(bundle_path: Path, out_dir: Path) -> list[Path]:
    """Split eval_accuracy_guard.json into eval_<label>_<task>.json files in ``out_dir``."""
    bundle = json.loads(bundle_path.read_text())
    written = []
    for label, entry in bundle["evals"].items():
        for task in ("ppl", "niah", "ruler"):
            if task in entry:
                path = out_dir / f"eval_{label}_{task}.json"
                path.write_text(json.dumps(entry[task], indent=1) + "\n")
                written.append(path)
    return written


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=list(ARCHS), default="small")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument(
        "--max-minutes",
        type=float,
        default=1.75,
        help="time for the training steps of one run; the steps are cut to fit (measured on the dense run)",
    )
    p.add_argument(
        "--probe-steps",
        type=int,
        default=12,
        help="dense steps run before deciding the step count (the median of the second half is the step time)",
    )
    p.add_argument(
        "--deadline-minutes",
        type=float,
        default=8.5,
        help="from the start: a training still running 1 minute before is stopped, evaluations running then are stopped",
    )
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--rope-theta", type=float, default=1e6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--v-size", type=int, default=None)
    p.add_argument("--s-size", type=int, default=None)
    p.add_argument("--last", type=int, default=20, help="final loss = mean of the last N steps")
    p.add_argument("--eval-lengths", default=None, help="default 4K,8K,16K (cuda) / 512,1K (cpu)")
    p.add_argument("--ppl-samples", type=int, default=2)
    p.add_argument("--niah-samples", type=int, default=1)
    p.add_argument("--ruler-samples", type=int, default=2)
    p.add_argument("--ruler-tasks", default="all")
    p.add_argument("--eval-parallel", type=int, default=4, help="labels evaluated at once")
    p.add_argument("--no-eval", action="store_true")
    p.add_argument("--work", type=Path, default=None, help="keep corpus, runs and exports here (default: a temp dir)")
    p.add_argument("--out", type=Path, default=None, help="flat output folder (default: bench/results)")
    p.add_argument("--unbundle", type=Path, default=None, help="split an eval_accuracy_guard.json into bench/results")
    args = p.parse_args()
    args.probe_steps = max(args.probe_steps, 4)
    if args.unbundle:
        for path in unbundle(args.unbundle, args.out or RESULTS_DIR):
            print(f"wrote {path}")
        return
    if args.eval_lengths is None:
        args.eval_lengths = "4K,8K,16K" if args.device == "cuda" else "512,1K"
    args.first_bucket = 1024 if args.seq_len >= 8192 else 128
    t_start = time.time()
    deadline = t_start + args.deadline_minutes * 60
    out = args.out or RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    work = (args.work or Path(tempfile.mkdtemp(prefix="accuracy_guard_"))).resolve()  # configs hold absolute paths
    work.mkdir(parents=True, exist_ok=True)
    LOG.append(out / "accuracy_guard.log")
    LOG[0].write_text("")
    say(
        f"accuracy guard: arch {args.arch}, seq_len {args.seq_len}, {args.steps} steps, device {args.device}; work dir {work}"
    )

    tokens = work / "tokens.npy"
    corpus = build_corpus(tokens, args.steps * args.seq_len + args.seq_len + 1, args.seq_len, args.seed)
    say(
        f"corpus: {corpus['tokens']} tokens, {corpus['documents']} documents in {corpus['seconds']}s "
        f"(by kind: {corpus['tokens_by_kind']})"
    )
    eval_max = max(int(x[:-1]) * 1024 if x.upper().endswith("K") else int(x) for x in args.eval_lengths.split(","))
    heldout = work / "heldout.jsonl"
    build_heldout(heldout, eval_max, args.ppl_samples, args.seq_len, args.seed)

    steps, records, cfgs = args.steps, {}, {}
    for mode in ("dense", "sparse"):
        folder = work / mode
        for attempt in range(2):
            cfgs[mode] = write_config(folder, args, mode, tokens, steps)
            say(f"[{time.time() - t_start:5.0f}s] training {mode}: {steps} steps")
            run = train_once(folder, cfgs[mode], steps, args, mode == "dense" and attempt == 0, deadline)
            if run["status"] != "retry":
                break
            steps = run["new_steps"]
        records[mode] = summarise(mode, cfgs[mode], run, args.last)
        r = records[mode]
        say(
            f"[{time.time() - t_start:5.0f}s] {mode}: {r['status']}, {r['steps']} steps in {r['wall_s']}s, final loss "
            f"{r.get('final_loss', float('nan')):.4f}, {r.get('tokens_per_s', 0):.0f} tokens/s"
        )

    dense, sparse = records["dense"], records["sparse"]
    gap = None
    if "final_loss" in dense and "final_loss" in sparse and dense["steps"] == sparse["steps"]:
        gap = (sparse["final_loss"] - dense["final_loss"]) / dense["final_loss"]
    result = dict(
        name="accuracy_guard",
        device=device_name() if args.device == "cuda" else "cpu",
        commit=commit(),
        command=command_line(),
        arch=args.arch,
        model_config=ARCHS[args.arch],
        seq_len=args.seq_len,
        steps=steps,
        requested_steps=args.steps,
        max_minutes_per_run=args.max_minutes,
        tokens_per_step=args.seq_len,
        corpus=corpus,
        goal=f"sparse final loss within {GOAL:.0%} of dense",
        final_loss_definition=f"mean training loss of the last {args.last} steps",
        relative_gap=gap,
        passed=None if gap is None else gap <= GOAL,
        runs=records,
    )
    (out / "accuracy_guard.json").write_text(json.dumps(result, indent=1) + "\n")
    title = f"{args.arch} Qwen2, {args.seq_len} tokens/step, {steps} steps"
    if gap is not None:
        title += f": sparse {gap:+.2%} vs dense ({'pass' if gap <= GOAL else 'FAIL'}, goal {GOAL:.0%})"
    plot(records, out / "accuracy_guard.png", title)
    say(
        f"[{time.time() - t_start:5.0f}s] relative gap {gap if gap is None else f'{gap:+.4%}'} -> "
        f"{'n/a' if gap is None else ('PASS' if gap <= GOAL else 'FAIL')}; wrote {out / 'accuracy_guard.json'}, .png"
    )

    if not args.no_eval:
        exports = {m: work / m / "export" for m in ("dense", "sparse") if records[m]["status"] == "done"}
        jobs = eval_jobs(args, exports, heldout, work)
        say(f"[{time.time() - t_start:5.0f}s] evaluating {len(jobs)} labels ({args.eval_lengths}; ppl, niah, ruler)")
        status = run_evals(jobs, work, deadline, args.eval_parallel)
        bundle = collect_evals(work, status)
        report_dir = work / "report"
        rep = subprocess.run(
            [sys.executable, "-m", "mtraining.cli", "eval", "report", str(work / "eval"), "--out-dir", str(report_dir)],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        report_md = (report_dir / "report.md").read_text() if (report_dir / "report.md").exists() else None
        if report_md is not None:  # the PNGs are renamed eval_*.png next to eval_report.md
            for png in report_dir.glob("*.png"):
                report_md = report_md.replace(f"]({png.name})", f"](eval_{png.name})")
        else:
            say("  eval report failed: " + (rep.stderr or rep.stdout)[-1000:])
        payload = dict(
            name="eval_accuracy_guard",
            device=result["device"],
            commit=result["commit"],
            command=result["command"],
            notes=[
                "labels: <how the model was trained>-trained_<attention at evaluation>-attn",
                "training corpus holds needle/vt documents in the eval's format with disjoint seeds; "
                "cwe/fwe are not in the training mixture",
                f"sparse evaluation keeps layers {DENSE_LAYERS} dense, as training did (--dense-layers)",
            ],
            evals=bundle,
            report_md=report_md,
        )
        (out / "eval_accuracy_guard.json").write_text(json.dumps(payload, indent=1) + "\n")
        if report_md is not None:
            (out / "eval_report.md").write_text(report_md)
            for png in sorted(report_dir.glob("*.png")):
                shutil.copyfile(png, out / f"eval_{png.name}")
        if args.out is None:
            unbundle(out / "eval_accuracy_guard.json", out)
        say("evaluation:")
        for line in eval_summary(bundle):
            say(line)
    say(f"[{time.time() - t_start:5.0f}s] done; outputs in {out}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

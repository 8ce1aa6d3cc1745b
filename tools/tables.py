"""Print the Markdown tables of the reports in bench/reports/ from bench/results/*.json (no number is typed by hand).

Each table is printed under a comment naming its report; BENCHMARKS.md indexes the reports' headlines.

python tools/tables.py
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def _load(name: str) -> list[dict]:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else []


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _percent(cell: dict) -> str:
    """A percentage with its interval: ``99.6 [98, 100]``."""
    return f"{cell['percent']:.1f} [{cell['interval'][0]:.0f}, {cell['interval'][1]:.0f}]"


def _difference(d: dict) -> str:
    """A paired difference in points with its interval: ``-1.2 [-3.2, +0.4]``."""
    return f"{d['difference']:+.1f} [{d['interval'][0]:+.1f}, {d['interval'][1]:+.1f}]"


def _ppl_change(c: dict) -> str:
    """A perplexity change in percent with its interval: ``+2.71% [+2.38, +3.03]``."""
    return f"{c['change_percent']:+.2f}% [{c['interval'][0]:+.2f}, {c['interval'][1]:+.2f}]"


def _runs(records: list[dict], key) -> list[tuple[object, list[dict]]]:
    """Records grouped by run, newest run first (records are appended run after run)."""
    groups: dict = {}
    for r in records:
        groups.setdefault(key(r), []).append(r)
    return list(reversed(groups.items()))


SPARSE_TIMES = [
    "density",
    "estimate ms",
    "fwd ms",
    "bwd ms",
    "bwd/fwd",
    "sparse total ms",
    "cuDNN fwd+bwd ms",
    "speedup",
    "total / (density x cuDNN)",
]
"""The columns of one bench/sparse_attention.py record's times (``_sparse_times``)."""


def _sparse_times(r: dict) -> list[str]:
    """The ``SPARSE_TIMES`` cells of one bench/sparse_attention.py record."""
    return [
        f"{r['density']:.3f}",
        f"{r['estimate_ms']:.1f}",
        f"{r['sparse_fwd_ms']:.1f}",
        f"{r['sparse_bwd_ms']:.1f}",
        f"{r['bwd_over_fwd']:.2f}",
        f"{r['sparse_total_ms']:.1f}",
        f"{r['dense_fwd_bwd_ms']:.1f}",
        f"{r['speedup_fwd_bwd']:.2f}x",
        f"{r['over_ideal']:.2f}",
    ]


def _pattern_label(r: dict) -> str:
    """A bench/sparse_attention.py record's pattern: estimated, or the sweep's target density."""
    return r["pattern"] if r["pattern"] != "sweep" else f"sweep ~{r['target_density']:.0%}"


def sparse_attention_table(name: str = "sparse_attention") -> str:
    """Sparse attention against cuDNN on one GPU (bench/sparse_attention.py), one block per run (a file of one run
    has no ``run`` key: its commit names it)."""
    head = ["seq", "inputs", "pattern", *SPARSE_TIMES, "commit"]
    blocks = []
    for run, records in _runs(_load(name), lambda r: r.get("run", r["commit"])):
        lines = [f"Run `{run}`:", "", _row(head), _row(["---"] * len(head))]
        for r in sorted(records, key=lambda r: (r["seq_len"], r["inputs"], r["pattern"], r["density"])):
            label = _pattern_label(r)
            if r["pattern"] == "estimated" and r["inputs"] == "structured" and "before" in r.get("inputs_note", ""):
                label += " (old generator)"
            lines.append(_row([f"{r['seq_len'] // 1024}K", r["inputs"], label, *_sparse_times(r), r["commit"]]))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def sparse_attention_backends_table(names: tuple[str, ...]) -> str:
    """The ``sparse_attention`` backends side by side (bench/sparse_attention.py ``--backends``), one block per file
    (one device call each); "fa4 / triton" is the total time over the Triton row's of the same pattern, and
    "fwd+bwd / (density x cuDNN)" leaves the estimate out."""
    head = ["seq", "inputs", "pattern", "backend", *SPARSE_TIMES, "fwd+bwd / (density x cuDNN)", "fa4 / triton"]
    blocks = []
    for name in names:
        records = _load(name)
        if not records:
            continue
        r0 = records[0]
        lines = [
            f"`bench/results/{name}.json`: {r0['device']}, commit {r0['commit']}, flash-attn-4 "
            f"{r0.get('flash_attn_4', '')}; `{r0['command']}`:",
            "",
            _row(head),
            _row(["---"] * len(head)),
        ]

        def pattern_key(r: dict) -> tuple:
            return (r["seq_len"], r["inputs"], r["pattern"], r["target_density"] or 0.0)

        triton = {pattern_key(r): r for r in records if r["backend"] == "triton"}
        order = {"triton": 0, "fa4": 1}
        for r in sorted(records, key=lambda r: (*pattern_key(r), order.get(r["backend"], 2))):
            base = triton.get(pattern_key(r))
            lines.append(
                _row(
                    [
                        f"{r['seq_len'] // 1024}K",
                        r["inputs"],
                        _pattern_label(r),
                        r["backend"],
                        *_sparse_times(r),
                        f"{r['sparse_fwd_bwd_ms'] / (r['density'] * r['dense_fwd_bwd_ms']):.2f}",
                        f"{r['sparse_total_ms'] / base['sparse_total_ms']:.2f}" if base and base is not r else "",
                    ]
                )
            )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


FA4_BACKEND_RUNS = tuple(
    f"sparse_attention_fa4_h200_366d150_{what}" for what in ("128k", "128k_256k", "512k", "random")
)
"""The files of the fa4 backend's report (bench/reports/fa4_backend_h200_20261128.md), one device call each."""


def block_sparse_peers_table() -> str:
    """Ours vs FA4 block-sparse and FlexAttention on our pattern rounded to their blocks, and cuDNN dense
    (bench/block_sparse_peers.py); cells are fwd / fwd+bwd ms, ratios are fwd+bwd times over ours (> 1: ours faster)."""
    head = [
        "seq",
        "density (rounded)",
        "ours ms",
        "ours total ms",
        "FA4 ms",
        "FA4 / ours time",
        "Flex ms",
        "Flex / ours time",
        "cuDNN ms",
        "cuDNN / ours time",
        "ours / (density x cuDNN)",
        "FA4 / (rounded x cuDNN)",
        "commit",
    ]

    def ms(r: dict, name: str) -> str:
        if f"{name}_fwd_bwd_ms" not in r:
            return "failed" if f"{name}_error" in r else ""
        return f"{r[f'{name}_fwd_ms']:.1f} / {r[f'{name}_fwd_bwd_ms']:.1f}"

    def ratio(r: dict, key: str, fmt: str = "{:.2f}x") -> str:
        return fmt.format(r[key]) if key in r else ""

    blocks = []
    for (device, run_commit), records in _runs(_load("block_sparse_peers"), lambda r: (r["device"], r["commit"])):
        r0 = records[0]
        lines = [
            f"{r0['gpus']} x {device}, commit {run_commit}, flash-attn-4 {r0['fa4_version']}, torch {r0['torch']}:"
        ]
        for c in (r for r in records if r["kind"] == "check"):
            errs = [
                f"{name} vs {target} pattern {max(c[f'{name}_vs_{target}'].values()):.1e}"
                if f"{name}_vs_{target}" in c
                else f"{name} {'failed' if f'{name}_error' in c else 'not run'}"
                for name, target in (("ours", "exact"), ("fa4", "rounded"), ("flex", "rounded"))
            ]
            lines += [
                "",
                f"Check at {c['seq_len'] // 1024}K, {c['inputs']} inputs (density {c['density']:.3f}, rounded "
                f"{c['rounded_density']:.3f}), largest relative error of out/dq/dk/dv against a float32 oracle: "
                + "; ".join(errs)
                + f" (the two oracles are {max(c['oracles_apart'].values()):.2f} apart).",
            ]
        lines += ["", _row(head), _row(["---"] * len(head))]
        for r in sorted((r for r in records if r["kind"] == "timing"), key=lambda r: r["seq_len"]):
            lines.append(
                _row(
                    [
                        f"{r['seq_len'] // 1024}K",
                        f"{r['density']:.3f} ({r['rounded_density']:.3f})",
                        ms(r, "ours"),
                        f"{r['ours_total_ms']:.1f}",
                        ms(r, "fa4"),
                        ratio(r, "fa4_over_ours"),
                        ms(r, "flex"),
                        ratio(r, "flex_over_ours"),
                        ms(r, "cudnn"),
                        ratio(r, "cudnn_over_ours"),
                        f"{r['ours_over_ideal']:.2f}",
                        ratio(r, "fa4_over_ideal", "{:.2f}"),
                        r["commit"],
                    ]
                )
            )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _dq_mode(tiles: dict) -> str:
    """How the record made dQ; records before dq_mode carried fused_dq (True = per-element atomics)."""
    return tiles.get("dq_mode") or ("atomic" if tiles.get("fused_dq") else "kernel")


def kernel_table() -> str:
    head = [
        "stage",
        "tiles (m, n, v, warps, stages, dQ)",
        "pattern",
        "fwd ms",
        "dQ ms",
        "dK/dV block ms",
        "dK/dV vertical ms",
    ]
    blocks = []
    for (device, run_commit), records in _runs(_load("tune_kernels"), lambda r: (r["device"], r["commit"])):
        lines = [f"{device}, commit {run_commit}:", "", _row(head), _row(["---"] * len(head))]
        for r in records:
            k = r["kernel_ms"]
            t = r["tiles"]
            lines.append(
                _row(
                    [
                        r["stage"],
                        f"({t['block_m']}, {t['block_n']}, {t['block_v']}, {t['num_warps']}, {t['num_stages']}, "
                        f"{_dq_mode(t)})",
                        f"{r['pattern']} ({r['density']:.3f})",
                        *(
                            f"{k.get(name, 0.0):.1f}"
                            for name in (
                                "_fwd_kernel",
                                "_bwd_dq_kernel",
                                "_bwd_dkdv_block_kernel",
                                "_bwd_dkdv_vertical_kernel",
                            )
                        ),
                    ]
                )
            )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _schedule(r: dict) -> str:
    """A ring record's schedule: flat, hierarchical:<inner ranks> or allgather, and its emulated link if any
    (torch's ring: empty)."""
    if r["method"] == "torch_cp":
        return ""
    name = r.get("schedule", "flat") + (f":{r['inner_size']}" if r.get("inner_size") else "")
    link = r.get("outer_link", "host")
    return name if link == "host" else f"{name}, {link}"


def ring_table(name: str = "ring_attention") -> str:
    """Every ring record of ``bench/results/<name>.json`` by run: times, the cost model's prediction, the ratios
    to torch's ring, the work imbalance and the peak memory."""
    head = [
        "seq",
        "method",
        "layout",
        "schedule",
        "density",
        "estimate ms",
        "fwd ms",
        "bwd ms",
        "fwd+bwd ms",
        "predicted ms",
        "vs torch CP",
        "fwd+bwd / (density x torch CP)",
        "imbalance max/mean",
        "peak GB",
        "note",
    ]
    blocks = []
    for (gpus, device, run_commit), rows in _runs(_load(name), lambda r: (r["gpus"], r["device"], r["commit"])):
        torch_cp = {r["seq_len"]: r["fwd_bwd_ms"] for r in rows if r["method"] == "torch_cp"}
        lines = [f"{gpus} x {device}, commit {run_commit}:", "", _row(head), _row(["---"] * len(head))]
        for r in rows:
            dense_ms = torch_cp.get(r["seq_len"])  # None where the run did not time torch's ring
            imb = "" if r["imbalance_max_over_mean"] is None else f"{r['imbalance_max_over_mean']:.3f}"
            lines.append(
                _row(
                    [
                        f"{r['seq_len'] // 1024}K",
                        r["method"],
                        r["layout"] or "",
                        _schedule(r),
                        f"{r['density']:.3f}",
                        "" if r.get("estimate_ms") is None else f"{r['estimate_ms']:.1f}",
                        f"{r['fwd_ms']:.1f}",
                        f"{r['bwd_ms']:.1f}",
                        f"{r['fwd_bwd_ms']:.1f}",
                        "" if r.get("predicted_ms") is None else f"{r['predicted_ms']:.1f}",
                        "" if dense_ms is None else f"{dense_ms / r['fwd_bwd_ms']:.2f}x",
                        f"{r['fwd_bwd_ms'] / (r['density'] * dense_ms):.2f}" if dense_ms and r["density"] < 1 else "",
                        imb,
                        "" if r.get("peak_mem_gb") is None else f"{r['peak_mem_gb']:.1f}",
                        r["note"],
                    ]
                )
            )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def kernel_variants_table(name: str = "kernel_variants") -> str:
    """Per-kernel CUDA ms of the kernel variants compared in one process each (A/B runs)."""
    head = [
        "variant",
        "commit",
        "what",
        "pattern",
        "fwd ms",
        "dQ ms",
        "dK/dV block ms",
        "dK/dV vertical ms",
        "training step ms",
    ]
    lines = [_row(head), _row(["---"] * len(head))]
    for r in _load(name):
        k = r.get("kernel_ms", {})
        cells = [
            f"{k[name]:.1f}" if name in k else ""
            for name in ("_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_block_kernel", "_bwd_dkdv_vertical_kernel")
        ]
        step = f"{r['training_step_ms']:.1f}" if "training_step_ms" in r else ""
        lines.append(_row([r["variant"], r["commit"], r["description"], r["pattern"], *cells, step]))
    return "\n".join(lines)


def layout_balance_table() -> str:
    """Rank max/mean of computed pairs per layout and world size (experiments/studies/layout_balance.py)."""
    records = _load("layout_balance")
    if not records:
        return ""
    head = ["world size", *dict.fromkeys(r["layout"] for r in records)]
    by_world: dict = {}
    for r in records:
        by_world.setdefault(r["world_size"], {})[r["layout"]] = r["rank_max_over_mean"]
    r0 = records[0]
    lines = [
        f"{r0['seq_len'] // 1024}K structured, density {r0['density']:.3f}, computed on {r0['device']}, "
        f"commit {r0['commit']}:",
        "",
        _row(head),
        _row(["---"] * len(head)),
    ]
    for world, cells in by_world.items():
        lines.append(_row([str(world), *(f"{cells.get(name, float('nan')):.4f}" for name in head[1:])]))
    return "\n".join(lines)


def estimate_cp_table() -> str:
    """Context-parallel estimate ms per layout and slash-sum path (A/B on the same GPUs)."""
    head = ["seq", "layout", "slash sums", "estimate ms", "gpus", "commit"]
    lines = [_row(head), _row(["---"] * len(head))]
    for r in _load("estimate_cp_ab"):
        lines.append(
            _row(
                [
                    f"{r['seq_len'] // 1024}K",
                    r["layout"],
                    r["slash_sums"],
                    f"{r['estimate_cp_ms']:.2f}",
                    f"{r['gpus']} x {r['device']}",
                    r["commit"],
                ]
            )
        )
    return "\n".join(lines)


def recall_table() -> str:
    """Cost of one pattern_recall call (the trainer's logging metric) next to one estimation."""
    head = ["seq", "last_q", "recall ms", "estimate ms", "recall", "device", "commit"]
    lines = [_row(head), _row(["---"] * len(head))]
    for r in _load("recall_cost"):
        lines.append(
            _row(
                [
                    f"{r['seq_len'] // 1024}K",
                    r["last_q"],
                    f"{r['recall_ms']:.1f}",
                    f"{r['estimate_ms']:.1f}",
                    f"{r['recall']:.3f}",
                    r["device"],
                    r["commit"],
                ]
            )
        )
    return "\n".join(lines)


def checkpoint_integrity_table() -> str:
    """Checkpoint save with the manifest (SHA-256 per file) vs plain DCP, verification and load (medians)."""
    head = ["checkpoint GB", "plain save s", "save + manifest s", "SHA-256 s (CPU s)", "GB per CPU-s"]
    head += ["verify s (CPU s)", "load s", "device", "commit"]
    lines = [_row(head), _row(["---"] * len(head))]
    for r in _load("checkpoint_integrity"):
        lines.append(
            _row(
                [
                    f"{r['checkpoint_bytes'] / 1e9:.2f}",
                    f"{r['plain_dcp_save_s']:.1f}",
                    f"{r['save_checkpoint_s']:.1f}",
                    f"{r['sha256_all_files_s']:.1f} ({r['sha256_all_files_cpu_s']:.1f})",
                    f"{r['sha256_gb_per_cpu_s']:.2f}",
                    f"{r['verify_checkpoint_s']:.1f} ({r['verify_checkpoint_cpu_s']:.1f})",
                    f"{r['load_checkpoint_s']:.1f}",
                    r["device"],
                    r["commit"],
                ]
            )
        )
    return "\n".join(lines)


def agreement_check_table() -> str:
    """The rings' per-call agreement check: one check, a bare all-gather, layer-like steps with and without the
    checks, and the position-ids read (slowest rank's medians)."""
    head = ["backend", "ranks", "check µs", "bare all-gather µs", "layers", "tokens", "with checks ms"]
    head += ["without ms", "position-ids read ms (tokens)", "device", "commit"]
    lines = [_row(head), _row(["---"] * len(head))]
    for r in _load("agreement_check"):
        lines.append(
            _row(
                [
                    r["backend"],
                    r["world"],
                    f"{r['check_us']:.0f}",
                    f"{r['all_gather_us']:.0f}",
                    r["layers"],
                    r["seq"],
                    f"{r['layers_ms']:.1f}",
                    f"{r['layers_unchecked_ms']:.1f}",
                    f"{r['position_ids_ms']:.1f} ({r['ids_len']})",
                    r["device"],
                    r["commit"],
                ]
            )
        )
    return "\n".join(lines)


def loss_table() -> str:
    """LM-head cross-entropy (loss + backward) by implementation: time, peak memory, the per-chunk row
    step alone (its timing clones the logits: the clone is subtracted) and errors against float64."""
    head = [
        "tokens",
        "vocab",
        "chunk",
        "implementation",
        "loss+bwd ms",
        "peak GB",
        "rows of one chunk ms",
        "rel. err loss / dhidden / dhead",
        "device",
        "commit",
    ]
    lines = [_row(head), _row(["---"] * len(head))]
    impls = (
        ("chunked, Triton rows kernel", "chunked_kernel", "rows_kernel_ms"),
        ("chunked, PyTorch row ops", "chunked_torch", "rows_torch_ms"),
        ("liger fused linear CE", "liger", None),
    )
    for r in _load("loss"):
        for name, key, rows_key in impls:
            if f"loss_{key}_ms" not in r:
                continue
            errors = (
                ""
                if f"rel_err_{key}_loss" not in r
                else " / ".join(f"{r[f'rel_err_{key}_{part}']:.1e}" for part in ("loss", "grad_hidden", "grad_weight"))
            )
            lines.append(
                _row(
                    [
                        f"{r['tokens'] // 1024}K",
                        r["vocab"],
                        r["chunk"],
                        name,
                        f"{r[f'loss_{key}_ms']:.1f}",
                        f"{r[f'loss_{key}_peak_gb']:.1f}",
                        f"{r[rows_key] - r['rows_clone_ms']:.2f}" if rows_key else "",
                        errors,
                        r["device"],
                        r["commit"],
                    ]
                )
            )
    return "\n".join(lines)


def training_tables() -> str:
    """End-to-end training throughput."""
    lines = []
    head = [
        "gpus",
        "model",
        "init",
        "seq",
        "attention",
        "layout",
        "fused kernels",
        "compile",
        "loss",
        "saved attn",
        "step s",
        "tokens/s",
        "peak GB",
        "MFU",
        "density",
        "commit",
    ]
    rows = _load("train_throughput")
    if rows:
        lines += [f"Training throughput ({rows[0]['device']}):", "", _row(head), _row(["---"] * len(head))]
        for r in rows:
            lines.append(
                _row(
                    [
                        r["gpus"],
                        r["model"],
                        r.get("init", "random"),
                        f"{r['seq_len'] // 1024}K",
                        r["attention"],
                        r["layout"],
                        r.get("fused_kernels", "none"),
                        r.get("compile", "none"),
                        r.get("loss_impl", "chunked"),
                        {True: "yes", False: "no", None: "no"}.get(
                            r.get("save_attention_outputs"), r.get("save_attention_outputs")
                        ),
                        f"{r['step_s']:.2f}",
                        f"{r['tokens_per_s']:.0f}",
                        f"{r['peak_mem_gb']:.1f}",
                        f"{r['mfu']:.3f}",
                        "" if r["density"] is None else f"{r['density']:.3f}",
                        r["commit"],
                    ]
                )
            )
    return "\n".join(lines)


def _extension_replicates(path: Path) -> str:
    """experiments/extension/replicates.py writes its tables beside its JSON."""
    return path.with_suffix(".md").read_text().strip()


def extension_tables() -> str:
    """Context extension, dense vs sparse (experiments/extension/pipeline.py): accuracy by length and the budget sweep, per scale."""
    lines = []
    for path in sorted(RESULTS.glob("extension_*.json")):
        if path.stem.endswith(("_base_search", "_base")):  # a base alone (search, --base-only): by hand
            continue
        renders = {
            "_losses": _extension_losses,
            "_density": _extension_density,
            "_answers": _extension_answers,
            "_replicates": _extension_replicates,
            "_query_position": _extension_query_position,
            "_local_verticals": _extension_local_verticals,
        }
        render = next((r for end, r in renders.items() if path.stem.endswith(end)), None)
        if render is not None:
            lines += [render(path), ""]
            continue
        r = json.loads(path.read_text())
        s, tasks, lengths = r["summary"], r["tasks"], [str(n) for n in r["lengths"]]
        long = lengths[-1]
        lines += [f"{r['name']}: {r['device']}, commit {r['commit']}, `{r['command']}`", ""]
        head = ["model / attention"] + [f"{t} {n}" for t in tasks for n in lengths] + [f"ppl last bucket {long}"]
        lines += [_row(head), _row(["---"] * len(head))]
        for label, row in s["table"].items():
            cells = [row["tasks"][t][n] for t in tasks for n in lengths]
            lines.append(_row([label] + [_percent(c) for c in cells] + [f"{row['ppl_last_bucket'][long]:.3f}"]))
        head = ["budget", "train density", "train recall"] + [f"{t} {long} minus dense" for t in tasks]
        head += ["ppl vs dense", "parity"]
        lines += ["", _row(head), _row(["---"] * len(head))]
        for e in s["sweep"]:
            diffs = [e["minus_dense"][t][long] for t in tasks]
            ppl = e["ppl_last_bucket_vs_dense"]
            lines.append(
                _row(
                    [e["budget"]["name"], f"{e['train_density']:.3f}", f"{e['train_recall']:.3f}"]
                    + [_difference(d) for d in diffs]
                    + [_ppl_change(ppl)]
                    + ["yes" if e["parity"] else "no"]
                )
            )
        lines.append("")
    return "\n".join(lines)


def _extension_losses(path: Path) -> str:
    """Mean NLL by token kind per extended model and attention (experiments/extension/losses.py)."""
    r = json.loads(path.read_text())
    lines = [f"{r['name']}: {r['device']}, commit {r['commit']}, `{r['command']}`", ""]
    kinds = ("answer", "queried key", "rest", "all")
    lines += [_row(["model / attention"] + [f"NLL {k}" for k in kinds]), _row(["---"] * (len(kinds) + 1))]
    for label, parts in r["losses"].items():
        lines.append(_row([label] + [f"{parts[k]['nll']:.3f}" for k in kinds]))
    return "\n".join(lines)


def _extension_answers(path: Path) -> str:
    """Where the extension corpus' answers lie in their documents, and the packed stages' filler
    (experiments/extension/answer_positions.py)."""
    r = json.loads(path.read_text())
    ext = r["stages"]["extension"]
    lines = [f"{r['name']}: {r['device']}, commit {r['commit']}, `{r['command']}`", ""]
    head = ["kind", "documents", "answer tokens", f"in last {r['settings']['last_q']} rows"]
    head += ["answer to end p10/50/90", "answer to evidence p10/50/90", "document p10/50/90"]
    lines += [_row(head), _row(["---"] * len(head))]

    def q(x: dict) -> str:
        return "/".join(f"{x[k]:.0f}" for k in ("p10", "p50", "p90"))

    for kind, f in [*ext["answers"]["kinds"].items(), ("mixture", ext["answers"]["mixture"])]:
        share = f["answer_tokens_in_rows_share"]
        lines.append(
            _row(
                [kind, str(f["documents"]), str(f["answer_tokens"]), f"{share:.3f}"]
                + [q(f["answer_to_end_tokens"]), q(f["answer_to_evidence_tokens"]), q(f["document_positions"])]
            )
        )
    lines += ["", _row(["stage", "seq_len", "documents", "samples", "filler share"]), _row(["---"] * 5)]
    for name, st in r["stages"].items():
        k = st["packing"]
        lines.append(
            _row([name, str(st["seq_len"]), str(k["documents"]), str(k["samples"]), f"{k['filler_share']:.3f}"])
        )
    return "\n".join(lines)


def _extension_query_position(path: Path) -> str:
    """Retrieval with the questions at the end or ``tail`` tokens before it (experiments/extension/query_position.py)."""
    r = json.loads(path.read_text())
    lines = [f"{r['name']}: {r['device']}, commit {r['commit']}, `{r['command']}`", ""]
    lines += [_row(["model / attention", "questions at the end", f"{r['tail']} tokens before it", "tail - end"])]
    lines.append(_row(["---"] * 4))
    for label, d in r["tail_minus_end"].items():
        end, tail = (r["rows"][f"{label}/{w}"]["retrieval"] for w in ("end", "tail"))
        lines.append(_row([label, _percent(end), _percent(tail), _difference(d)]))
    return "\n".join(lines)


def _extension_local_verticals(path: Path) -> str:
    """Retrieval with extra columns per query block, questions at the end or ``tail`` tokens before it
    (experiments/extension/local_verticals.py)."""
    r = json.loads(path.read_text())
    lines = [
        f"{r['name']}: {r['device']}, commit {r['commit']}, `{r['command']}` ({r['model']} extension, "
        f"{r['documents']} documents of {r['length']} tokens)",
        "",
    ]
    head = ["attention", "density", "questions at the end", f"{r['tail']} tokens before it", "before it - dense"]
    hashed = any(row.get("lsh_candidates") is not None for row in r["rows"].values())
    head += ["LSH candidate pairs"] if hashed else []
    ppl = r.get("ppl_vs_dense")  # last-bucket perplexity against dense, where the run measured it
    head += ["ppl vs dense, at the end", "before it"] if ppl else []
    lines += [_row(head), _row(["---"] * len(head))]
    for label in dict.fromkeys(key.rsplit("/", 1)[0] for key in r["rows"]):
        end, tail = (r["rows"][f"{label}/{w}"] for w in ("end", "tail"))
        cells = [_percent(x["retrieval"]) for x in (end, tail)]
        d = r["minus_dense"].get(label, {}).get("tail")
        diff = "" if d is None else _difference(d)
        density = "" if tail["density"] is None else f"{tail['density']:.3f}"
        share = tail.get("lsh_candidates")
        extra = ["" if share is None else f"{share:.3f}"] if hashed else []
        if ppl:
            extra += [_ppl_change(ppl[label][w]) if label in ppl else "" for w in ("end", "tail")]
        lines.append(_row([label, density, *cells, diff, *extra]))
    return "\n".join(lines)


def _extension_density(path: Path) -> str:
    """One extended model's last-bucket perplexity and retrieval at each pattern setting (experiments/extension/density.py)."""
    r = json.loads(path.read_text())
    lines = [
        f"{r['name']}: {r['device']}, commit {r['commit']}, `{r['command']}` ({r['model']} extension, "
        f"{r['documents']} documents of {r['length']} tokens, one process)",
        "",
    ]
    head = ["setting", "pattern: v, s, threshold, last_q", "density", "ppl last bucket", "vs dense", "retrieval %"]
    head += ["cpu s"]
    lines += [_row(head), _row(["---"] * len(head))]
    for e in r["rows"]:
        p, change, found = e["pattern"], e.get("ppl_vs_dense"), e["retrieval"]
        lines.append(
            _row(
                [
                    e["setting"],
                    _density_setting(p),
                    "1" if e["density"] is None else f"{e['density']:.3f}",
                    f"{e['ppl_last_bucket']:.3f}",
                    "–" if change is None else _ppl_change(change),
                    _percent(found),
                    f"{e['cpu_s']:.0f}",
                ]
            )
        )
    return "\n".join(lines)


def _density_setting(pattern: dict | None) -> str:
    """A density-sweep setting in a cell: v, s, threshold, last_q, or each query's top fraction of keys."""
    if pattern is None:
        return "–"
    if "top_fraction" in pattern:
        return f"each query's top {100 * pattern['top_fraction']:g}% of keys"
    p = pattern
    return f"{p['v_size']}, {p['s_size']}, {p.get('threshold') or '–'}, {p['last_q']}"


def packed_documents_table() -> str:
    """Packed documents at 512K (bench/packed_documents.py): fwd+bwd ms with and without document masking,
    the gap to (masked density x dense with documents), the estimate's cost and the emulated ranks' balance."""
    head = ["commit", "docs", "masked density", "sparse docs ms", "dense docs ms", "SDPA per doc ms",
            "sparse no docs ms", "one doc / today", "over ideal", "estimate docs / no docs ms",
            "striped time imbalance"]  # fmt: skip
    lines = [_row(head), _row(["---"] * len(head))]
    for r in reversed(_load("packed_documents")):
        lines.append(_row([
            r["commit"], r["documents"], f"{r['masked_density']:.3f}", f"{r['sparse_docs_fwd_bwd_ms']:.1f}",
            f"{r['dense_docs_fwd_bwd_ms']:.1f}", f"{r['sdpa_per_document_fwd_bwd_ms']:.1f}",
            f"{r['sparse_nodocs_fwd_bwd_ms']:.1f}", f"{r['one_document_over_today']:.3f}",
            f"{r['sparse_docs_over_ideal']:.2f}", f"{r['estimate_docs_ms']:.1f} / {r['estimate_nodocs_ms']:.1f}",
            f"{r['balance']['striped']['time_rank_imbalance']:.3f}",
        ]))  # fmt: skip
    return "\n".join(lines)


def train_overhead_table() -> str:
    """The trainer's seconds per step against a plain PyTorch loop (bench/train_overhead.py), before and after a
    change, measured in alternated rounds on a shared machine: medians over the rounds of each side's per-round
    medians, the median of the paired rounds' after / before CPU, and whether every run's losses equal the
    first "before" run's of its setting."""
    head = ["model", "seq x batch", "ranks", "plain CPU s", "trainer CPU s before (x plain)", "after (x plain)"]
    head += ["after / before CPU, paired", "wall s before / after", "rounds", "losses identical", "commits"]
    lines = [_row(head), _row(["---"] * len(head))]
    settings: dict = {}
    for r in _load("train_overhead"):
        model = r["model"]
        key = (model["hidden_size"], model["num_hidden_layers"], r["seq_len"], r["batch"], tuple(r["overrides"]))
        settings.setdefault(key, []).append(r)
    median = statistics.median
    for (hidden, layers, seq, batch, overrides), runs in settings.items():
        before = [r for r in runs if r["label"].startswith("before")]
        after = [r for r in runs if r["label"] == "after"]
        for i, ranks in enumerate(t["ranks"] for t in before[0]["trainer"]):
            b = [r["trainer"][i] for r in before]
            a = [r["trainer"][i] for r in after]
            same = all(t["losses"] == b[0]["losses"] for t in a + b)
            model = f"{hidden} x {layers} layers" + (f" {' '.join(overrides)}" if overrides else "")
            lines.append(
                _row(
                    [
                        model,
                        f"{seq} x {batch}",
                        ranks,
                        f"{median(r['plain']['cpu_s'] for r in runs):.4f}",
                        f"{median(t['cpu_s'] for t in b):.4f} ({median(t['cpu_ratio'] for t in b):.2f}x)",
                        f"{median(t['cpu_s'] for t in a):.4f} ({median(t['cpu_ratio'] for t in a):.2f}x)",
                        f"{median(y['cpu_s'] / x['cpu_s'] for x, y in zip(b, a)):.2f}",
                        f"{median(t['wall_s'] for t in b):.4f} / {median(t['wall_s'] for t in a):.4f}",
                        f"{len(b)} / {len(a)}",
                        "yes" if same else "no",
                        ", ".join(sorted({r["commit"] for r in runs})),
                    ]
                )
            )
    return "\n".join(lines)


def column_candidates_table() -> str:
    """The sorted column scorer's windows and agreement per layer on a model's Q/K (experiments/studies/column_candidates.py):
    skew (pair slots over a balanced hash's), the longest window, the largest bucket's share of the keys, and the
    share of the dense scorer's columns the sorted one keeps, uncapped and at each cap (mean over heads [worst])."""
    blocks = []
    for name in ("column_candidates_smollm2_code", "column_candidates_smollm2_prose"):
        records = _load(name)
        if not records:
            continue
        caps = [k.removeprefix("kept_cap_") for k in records[0] if k.startswith("kept_cap_")]
        head = ["layer", "skew mean [max]", "longest window", "largest bucket"] + [f"kept, cap {c}" for c in caps]
        first = records[0]
        lines = [
            f"`{name}`: {first['seq_len']} tokens of `{Path(first['tokens']).name}` from {first['offset']}, "
            f"{first['agreement_per_block']} columns per {first['block_size']}-row block, "
            f"{first['tables']} tables x {first['bits']} bits, commit {first['commit']}:",
            "",
            _row(head),
            _row(["---"] * len(head)),
        ]
        for layer in sorted({r["layer"] for r in records}):
            rs = [r for r in records if r["layer"] == layer]
            skew = [r["skew"] for r in rs]
            kept = [
                f"{statistics.mean(r[f'kept_cap_{c}'] for r in rs):.3f} [{min(r[f'kept_cap_{c}'] for r in rs):.3f}]"
                for c in caps
            ]
            cells = [layer, f"{statistics.mean(skew):.2f} [{max(skew):.2f}]", f"{max(r['window_max'] for r in rs):.0f}"]
            lines.append(_row(cells + [f"{max(r['largest_bucket_share'] for r in rs):.2f}"] + kept))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def main() -> None:
    for title, report, table in (
        ("sparse_attention", "sparse_attention_h200_20261123", sparse_attention_table()),
        (
            "sparse_attention_rate_h200_95b3127",
            "kernel_rate_h200_20261128",
            sparse_attention_table("sparse_attention_rate_h200_95b3127"),
        ),
        (
            "sparse_attention_fa4_h200_366d150",
            "fa4_backend_h200_20261128",
            sparse_attention_backends_table(FA4_BACKEND_RUNS),
        ),
        ("block_sparse_peers", "block_sparse_peers_h200_20261123", block_sparse_peers_table()),
        ("tune_kernels", "kernel_tiles_h200_20261123", kernel_table()),
        ("kernel_variants", "kernel_variants_h200_20261123", kernel_variants_table()),
        ("ring_attention", "ring_attention_h200x2_20261123", ring_table()),
        ("ring_allgather_2xh200", "ring_allgather_h200x2_20261128", ring_table("ring_allgather_2xh200")),
        (
            "kernel_variants_nonfinite_h200",
            "kernel_nonfinite_h200_20261128",
            kernel_variants_table("kernel_variants_nonfinite_h200"),
        ),
        ("layout_balance", "ring_attention_h200x2_20261123", layout_balance_table()),
        ("estimate_cp", "ring_attention_h200x2_20261123", estimate_cp_table()),
        ("packed_documents", "packed_documents_h200_20261123", packed_documents_table()),
        ("training", "training_h200_20261123", training_tables()),
        ("loss", "training_h200_20261123", loss_table()),
        ("recall_cost", "training_h200_20261123", recall_table()),
        ("extension", "extension_*", extension_tables()),
        ("checkpoint_integrity", "checkpoint_integrity_cpu_20261123", checkpoint_integrity_table()),
        ("train_overhead", "train_overhead_cpu_20261124", train_overhead_table()),
        ("agreement_check", "agreement_check_cpu_20261128", agreement_check_table()),
        ("column_candidates", "column_scorer_cpu_20261128", column_candidates_table()),
    ):
        print(f"<!-- {title}: bench/reports/{report}.md -->\n{table}\n")


if __name__ == "__main__":
    main()

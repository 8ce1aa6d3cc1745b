"""Print the Markdown tables of BENCHMARKS.md from bench/results/*.json (no number is typed by hand).

    python bench/tables.py
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _load(name: str) -> list[dict]:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else []


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def sparse_attention_table() -> str:
    head = ["seq", "inputs", "pattern", "density", "estimate ms", "fwd ms", "bwd ms", "bwd/fwd",
            "sparse total ms", "cuDNN fwd+bwd ms", "speedup", "total / (density x cuDNN)", "run", "commit"]
    lines = [_row(head), _row(["---"] * len(head))]
    for r in sorted(_load("sparse_attention"), key=lambda r: (r["run"] != "h200x4-gpu0-run2", r["seq_len"],
                                                           r["inputs"], r["pattern"], r["density"])):
        label = r["pattern"] if r["pattern"] != "sweep" else f"sweep ~{r['target_density']:.0%}"
        if r["pattern"] == "estimated" and r["inputs"] == "structured" and "before" in r.get("inputs_note", ""):
            label += " (old generator)"
        lines.append(_row([
            f"{r['seq_len'] // 1024}K", r["inputs"], label, f"{r['density']:.3f}", f"{r['estimate_ms']:.1f}",
            f"{r['sparse_fwd_ms']:.1f}", f"{r['sparse_bwd_ms']:.1f}", f"{r['bwd_over_fwd']:.2f}",
            f"{r['sparse_total_ms']:.1f}", f"{r['dense_fwd_bwd_ms']:.1f}", f"{r['speedup_fwd_bwd']:.2f}x",
            f"{r['over_ideal']:.2f}", r["run"], r["commit"],
        ]))
    return "\n".join(lines)


def _dq_mode(tiles: dict) -> str:
    """How the record made dQ; records before dq_mode carried fused_dq (True = per-element atomics)."""
    return tiles.get("dq_mode") or ("atomic" if tiles.get("fused_dq") else "kernel")


def kernel_table() -> str:
    head = ["stage", "tiles (m, n, v, warps, stages, dQ)", "pattern", "fwd ms", "dQ ms", "dK/dV block ms",
            "dK/dV vertical ms"]
    lines = [_row(head), _row(["---"] * len(head))]
    for r in _load("tune_kernels"):
        k = r["kernel_ms"]
        t = r["tiles"]
        lines.append(_row([
            r["stage"], f"({t['block_m']}, {t['block_n']}, {t['block_v']}, {t['num_warps']}, {t['num_stages']}, "
            f"{_dq_mode(t)})", f"{r['pattern']} ({r['density']:.3f})",
            *(f"{k.get(name, 0.0):.1f}" for name in ("_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_block_kernel",
                                                     "_bwd_dkdv_vertical_kernel")),
        ]))
    return "\n".join(lines)


def ring_table() -> str:
    head = ["seq", "method", "layout", "density", "fwd ms", "bwd ms", "fwd+bwd ms", "vs torch CP",
            "imbalance max/mean", "note", "commit"]
    rows = _load("ring_attention")
    torch_cp = {r["seq_len"]: r["fwd_bwd_ms"] for r in rows if r["method"] == "torch_cp"}
    lines = [_row(head), _row(["---"] * len(head))]
    for r in rows:
        ratio = torch_cp.get(r["seq_len"], float("nan")) / r["fwd_bwd_ms"]
        imb = "" if r["imbalance_max_over_mean"] is None else f"{r['imbalance_max_over_mean']:.3f}"
        lines.append(_row([
            f"{r['seq_len'] // 1024}K", r["method"], r["layout"] or "", f"{r['density']:.3f}", f"{r['fwd_ms']:.1f}",
            f"{r['bwd_ms']:.1f}", f"{r['fwd_bwd_ms']:.1f}", f"{ratio:.2f}x", imb, r["note"], r["commit"],
        ]))
    return "\n".join(lines)


def main() -> None:
    for title, table in (("sparse_attention", sparse_attention_table()), ("tune_kernels", kernel_table()),
                         ("ring_attention", ring_table())):
        print(f"<!-- {title} -->\n{table}\n")


if __name__ == "__main__":
    main()

"""Figures (PNG, matplotlib without a display): NIAH heatmaps, perplexity by position, task averages by length."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def short_length(n: int) -> str:
    """4096 -> '4K', 1048576 -> '1M', 300 -> '300'."""
    for unit, name in ((1 << 20, "M"), (1 << 10, "K")):
        if n >= unit and n % unit == 0:
            return f"{n // unit}{name}"
    return str(n)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    _pyplot().close(fig)
    return path


def niah_heatmaps(items: Sequence[tuple[str, dict]], path: str | Path) -> Path:
    """One depth x length heatmap (percent found) per (label, niah result), side by side."""
    plt = _pyplot()
    width = max(len(r["lengths"]) for _, r in items) * 0.8 + 1.6
    height = max(len(r["depths"]) for _, r in items) * 0.45 + 1.8
    fig, axes = plt.subplots(
        1, len(items), figsize=(width * len(items) + 1.2, height), squeeze=False, constrained_layout=True
    )
    image = None
    for i, (ax, (label, result)) in enumerate(zip(axes[0], items)):
        grid = result["scores"]
        image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
        ax.set_xticks(range(len(result["lengths"])), [short_length(n) for n in result["lengths"]])
        ax.set_yticks(range(len(result["depths"])), [f"{d:g}%" for d in result["depths"]])
        for r, row in enumerate(grid):
            for c, value in enumerate(row):
                ax.text(c, r, f"{value:.0f}", ha="center", va="center", fontsize=8)
        ax.set_xlabel("context length (tokens)")
        if i == 0:
            ax.set_ylabel("needle depth")
        ax.set_title(label)
    fig.colorbar(image, ax=list(axes[0]), label="found (%)")
    return _save(fig, path)


def ppl_by_position(items: Sequence[tuple[str, list[dict]]], path: str | Path) -> Path:
    """Perplexity per position bucket at each checkpoint's longest length, one line per checkpoint."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ticks: set[int] = set()
    for label, results in items:
        longest = max(results, key=lambda r: r["length"])
        ends = [b["end"] for b in longest["buckets"]]
        ticks.update(ends)
        ax.plot(
            ends,
            [b["ppl"] for b in longest["buckets"]],
            marker="o",
            label=f"{label} ({short_length(longest['length'])})",
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(ticks), [short_length(n) for n in sorted(ticks)])
    ax.minorticks_off()
    ax.set_xlabel("token position (end of bucket)")
    ax.set_ylabel("perplexity")
    ax.set_title("Perplexity by position")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, path)


def average_by_length(items: Sequence[tuple[str, dict]], path: str | Path, title: str) -> Path:
    """Average score over tasks vs context length (RULER-style or InfiniteBench), one line per checkpoint;
    lengths without a prompt are gaps."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, result in items:
        average = [math.nan if v is None else v for v in result["average"]]
        ax.plot(result["lengths"], average, marker="o", label=label)
    lengths = sorted({n for _, r in items for n in r["lengths"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [short_length(n) for n in lengths])
    ax.minorticks_off()
    ax.set_ylim(-2, 102)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("average score (%)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, path)

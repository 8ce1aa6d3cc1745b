"""Collect the JSON results of several checkpoints into one Markdown report with comparison plots."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from pathlib import Path

from . import plots
from .plots import short_length
from .ruler import markdown_table

KINDS = ("ppl", "niah", "ruler", "infinitebench")


def _load(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path} as JSON ({e}); pass the files `mtraining eval ...` wrote") from None
    return data if isinstance(data, dict) and data.get("kind") in KINDS else None


def collect(paths: Sequence[str | Path]) -> dict[str, list[dict]]:
    """Evaluation results by kind from JSON files and directories (searched recursively)."""
    found: dict[str, list[dict]] = {k: [] for k in KINDS}
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise ValueError(f"{path} does not exist; pass result JSON files or directories holding them")
        if path.is_file():
            data = _load(path)
            if data is None:
                raise ValueError(f"{path} is not an evaluation result (no kind {'/'.join(KINDS)})")
            found[data["kind"]].append(data)
        else:
            for file in sorted(path.rglob("*.json")):
                if (data := _load(file)) is not None:
                    found[data["kind"]].append(data)
    if not any(found.values()):
        raise ValueError(
            f"no evaluation results in {', '.join(map(str, paths))}; run `mtraining eval {'|'.join(KINDS)}` first"
        )
    for results in found.values():  # unique labels within a kind
        seen: dict[str, int] = {}
        for r in results:
            seen[r["label"]] = seen.get(r["label"], 0) + 1
            if seen[r["label"]] > 1:
                r["label"] = f"{r['label']} #{seen[r['label']]}"
    return found


def _fmt(value: float, digits: int = 2) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _who(r: dict) -> str:
    return f"{r['label']} ({r['attention']}, {r['world_size']} rank{'s' if r['world_size'] > 1 else ''})"


def _ppl_section(results: list[dict], out_dir: Path) -> list[str]:
    lengths = sorted({x["length"] for r in results for x in r["result"]})
    rows = []
    for r in results:
        by_len = {x["length"]: x["ppl"] for x in r["result"]}
        rows.append([_who(r)] + [_fmt(by_len.get(n, math.nan)) for n in lengths])
    out = ["## Perplexity", "", _table(["checkpoint"] + [short_length(n) for n in lengths], rows), ""]
    out += ["Perplexity per position bucket at each checkpoint's longest length (later buckets have more context):", ""]
    tables: dict[tuple[str, ...], list[list[str]]] = {}  # one table per bucket set
    for r in results:
        longest = max(r["result"], key=lambda x: x["length"])
        header = ("checkpoint", "length", *(f"{b['start']}–{b['end']}" for b in longest["buckets"]))
        row = [r["label"], short_length(longest["length"])] + [_fmt(b["ppl"]) for b in longest["buckets"]]
        tables.setdefault(header, []).append(row)
    for header, rows in tables.items():
        out += [_table(list(header), rows), ""]
    plots.ppl_by_position([(r["label"], r["result"]) for r in results], out_dir / "ppl_by_position.png")
    return out + ["![perplexity by position](ppl_by_position.png)", ""]


def _niah_section(results: list[dict], out_dir: Path) -> list[str]:
    lengths = sorted({n for r in results for n in r["result"]["lengths"]})
    rows = []
    for r in results:
        res = r["result"]
        cols = {n: sum(row[j] for row in res["scores"]) / len(res["scores"]) for j, n in enumerate(res["lengths"])}
        overall = sum(map(sum, res["scores"])) / (len(res["depths"]) * len(res["lengths"]))
        rows.append([_who(r)] + [_fmt(cols.get(n, math.nan), 1) for n in lengths] + [_fmt(overall, 1)])
    plots.niah_heatmaps([(r["label"], r["result"]) for r in results], out_dir / "niah_heatmaps.png")
    header = ["checkpoint"] + [short_length(n) for n in lengths] + ["mean"]
    out = [
        "## Needle in a haystack (% found, mean over depths)",
        "",
        _table(header, rows),
        "",
        "![needle in a haystack](niah_heatmaps.png)",
        "",
    ]
    pooled = [r for r in results if r["result"].get("by_length")]
    if pooled:
        rows = []
        for r in pooled:
            cells = {c["length"]: c for c in r["result"]["by_length"]}
            rows.append([_who(r)] + [_pooled_cell(cells.get(n)) for n in lengths])
        out += [
            "Depths pooled per length: generated / teacher-forced (all reference tokens greedy), % with 95% intervals "
            "over the prompts:",
            "",
            _table(["checkpoint"] + [short_length(n) for n in lengths], rows),
            "",
        ]
    return out


def _pooled_cell(cell: dict | None) -> str:
    if cell is None:
        return "–"
    text = f"{cell['score']:.1f} [{cell['interval'][0]:.1f}, {cell['interval'][1]:.1f}]"
    if cell.get("forced") is not None:
        text += f" / {cell['forced']:.1f} [{cell['forced_interval'][0]:.1f}, {cell['forced_interval'][1]:.1f}]"
    return text


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _task_section(results: list[dict], out_dir: Path, title: str, plot: str) -> list[str]:
    """Average over tasks per length for each checkpoint, a plot of it, then each checkpoint's task table."""
    lengths = sorted({n for r in results for n in r["result"]["lengths"]})
    rows = []
    for r in results:
        res = r["result"]
        avg = dict(zip(res["lengths"], res["average"]))
        rows.append([_who(r)] + [_fmt(avg.get(n, math.nan), 1) for n in lengths] + [_fmt(_mean(res["average"]), 1)])
    items = [(r["label"], r["result"]) for r in results]
    plots.average_by_length(items, out_dir / f"{plot}.png", f"{title} by length")
    out = [
        f"## {title} (% correct, average over tasks)",
        "",
        _table(["checkpoint"] + [short_length(n) for n in lengths] + ["mean"], rows),
        "",
        f"![{title} by length]({plot}.png)",
        "",
    ]
    for r in results:
        out += [f"### {r['label']}", "", markdown_table(r["result"]), ""]
    return out


def build_report(paths: Sequence[str | Path], out_dir: str | Path) -> Path:
    """Write ``out_dir/report.md`` and its PNGs from the results under ``paths``; returns the report path."""
    from ..train.outputs import check_output_dir

    found = collect(paths)
    out_dir = Path(out_dir)
    check_output_dir(str(out_dir), "--out-dir")
    lines = ["# Evaluation report", ""]
    every = {(r["label"], r["checkpoint"], r["attention"]) for rs in found.values() for r in rs}
    lines += [f"- **{label}**: `{ckpt}`, {attention} attention" for label, ckpt, attention in sorted(every)] + [""]
    sections = {
        "ppl": _ppl_section,
        "niah": _niah_section,
        "ruler": functools.partial(_task_section, title="RULER-style tasks", plot="ruler_by_length"),
        "infinitebench": functools.partial(_task_section, title="InfiniteBench", plot="infinitebench_by_length"),
    }
    for kind in KINDS:
        if found[kind]:
            lines += sections[kind](found[kind], out_dir)
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path

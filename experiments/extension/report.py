"""Statistics, goal checks, plots and the Markdown report of the context-extension experiment.

Every figure here is computed from the evaluation records (per-document hits and per-bucket losses)
and the training metrics the stages wrote; nothing is typed in.

- accuracy at a length: percent of answers found, 95% Wilson interval (answers scored 0/1) or a
  bootstrap interval over documents (partial credit, RULER);
- two models on the same documents: the difference with a paired bootstrap interval (documents
  resampled, both models' records kept together);
- perplexity: of the last position bucket, over all documents; sparse against dense as a percent
  change with a paired bootstrap interval.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict
from pathlib import Path

from mtraining.eval.intervals import wilson_interval

from .settings import Scale

TASK_TITLES = {"recall": "key-value retrieval", "niah": "needle in a haystack", "ruler": "RULER-style average"}
BASE_GATE = {"recall": 90.0, "niah": 90.0, "ruler": 50.0}  # the base must retrieve at L0 (issue 13)
POINTS, PPL_PERCENT = 3.0, 1.0  # parity: within 3 points on every task at every length, 1% on last-bucket ppl


def bootstrap(values: list, statistic, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of ``statistic`` over resamples (with replacement) of ``values``."""
    rng = random.Random(seed)
    draws = sorted(statistic([rng.choice(values) for _ in values]) for _ in range(resamples))
    return draws[int(0.025 * resamples)], draws[int(0.975 * resamples) - 1]


def _percent(docs: list[dict]) -> float:
    return 100.0 * sum(d["hits"] for d in docs) / sum(d["answers"] for d in docs)


def base_gate(task: str, found: dict) -> dict:
    """The base's ``accuracy`` at L0 on ``task`` against what the comparison needs of it (``BASE_GATE``)."""
    return {"accuracy": found, "needed": BASE_GATE[task], "passed": found["percent"] >= BASE_GATE[task]}


def accuracy(docs: list[dict]) -> dict:
    """Percent found over ``docs`` with a 95% interval (Wilson for 0/1 answers, else bootstrap over documents)."""
    hits, answers = sum(d["hits"] for d in docs), sum(d["answers"] for d in docs)
    if all(float(d["hits"]).is_integer() for d in docs):
        interval = wilson_interval(int(hits), answers)
    else:
        interval = bootstrap(docs, _percent)
    return {"percent": 100.0 * hits / answers, "interval": list(interval), "answers": answers, "documents": len(docs)}


def difference(a: list[dict], b: list[dict]) -> dict:
    """Percent found by ``a`` minus ``b`` (same documents, same order), paired bootstrap 95% interval."""
    if len(a) != len(b) or any(x["answers"] != y["answers"] for x, y in zip(a, b)):
        raise ValueError("a paired comparison needs the same documents in the same order")
    pairs = list(zip(a, b))
    return {"difference": paired_points(pairs), "interval": list(bootstrap(pairs, paired_points))}


def paired_points(pairs: list[tuple[dict, dict]]) -> float:
    """Percent found by the first record of each pair minus the second (the pairs share their documents)."""
    return 100.0 * sum(x["hits"] - y["hits"] for x, y in pairs) / sum(x["answers"] for x, _ in pairs)


def by_depth(niah: dict) -> dict[float, list[dict]]:
    """The NIAH records of one length grouped by needle depth: the evaluation writes them depth-major, an equal
    count per depth (checked against the grid it wrote alongside)."""
    docs, grid = niah["documents"], niah["grid"]
    depths, per = grid["depths"], len(niah["documents"]) // len(grid["depths"])
    groups = {d: docs[i * per : (i + 1) * per] for i, d in enumerate(depths)}
    if per * len(depths) != len(docs) or any(
        abs(_percent(g) - s) > 1e-9 for g, s in zip(groups.values(), grid["scores"])
    ):
        raise ValueError("NIAH records are not depth-major with an equal count per depth; cannot split them by depth")
    return groups


def long_range(niah: dict) -> list[dict]:
    """The NIAH records of one length whose needle lies before depth 1 (depth 1: just before the question, where
    the local window reaches it): what long-range retrieval is judged on."""
    return [r for depth, group in by_depth(niah).items() if depth < 1.0 for r in group]


def _bucket_tokens(doc: dict, i: int) -> int:
    a, b = doc["buckets"][i]
    return b - a + 1


def ppl_curve(docs: list[dict]) -> list[dict]:
    """Perplexity per position bucket over ``docs`` (the bucket records of ``mtraining eval ppl``)."""
    out = []
    for i, (a, b) in enumerate(docs[0]["buckets"]):
        nll = sum(d["nll"][i] for d in docs) / sum(_bucket_tokens(d, i) for d in docs)
        out.append({"start": a, "end": b, "nll": nll, "ppl": math.exp(nll)})
    return out


def ppl_percent(pairs: list[tuple[dict, dict]]) -> float:
    """Last-bucket perplexity of the first of each pair of document records against the second, in percent."""
    tokens = sum(_bucket_tokens(x, -1) for x, _ in pairs)
    return 100.0 * (math.exp(sum(x["nll"][-1] - y["nll"][-1] for x, y in pairs) / tokens) - 1.0)


def ppl_change(a: list[dict], b: list[dict]) -> dict:
    """Last-bucket perplexity of ``a`` against ``b`` in percent (same documents), paired bootstrap 95% interval."""
    pairs = list(zip(a, b))
    return {"change_percent": ppl_percent(pairs), "interval": list(bootstrap(pairs, ppl_percent))}


# ---------------------------------------------------------------------------------------------- summary
def summarise(scale: Scale, evaluations: dict[str, dict], runs: dict[str, dict]) -> dict:
    """Accuracy tables, the goal checks and the budget sweep, from the evaluations and training runs."""
    lengths, long = [str(n) for n in scale.lengths], str(scale.long)
    table = {}
    for label, ev in evaluations.items():
        table[label] = {
            "attention": ev["attention"],
            "density": ev["density"],
            "tasks": {t: {n: accuracy(ev["tasks"][t][n]["documents"]) for n in lengths} for t in scale.tasks},
            "ppl_last_bucket": {n: ppl_curve(ev["ppl"][n])[-1]["ppl"] for n in lengths},
        }
    dense, base = evaluations["dense/dense"], evaluations["base/dense"]
    l0 = lengths[0]
    goal = {
        "base_retrieves_at_l0": {t: base_gate(t, table["base/dense"]["tasks"][t][l0]) for t in scale.tasks},
        "dense_beats_base_at_long": {},
    }
    for t in scale.tasks:
        d, b = table["dense/dense"]["tasks"][t][long], table["base/dense"]["tasks"][t][long]
        goal["dense_beats_base_at_long"][t] = {
            "dense": d,
            "base": b,
            "difference": difference(dense["tasks"][t][long]["documents"], base["tasks"][t][long]["documents"]),
            "clearly": d["interval"][0] > b["interval"][1],
        }
    # equal scores mean something only if the base retrieves at L0 and the dense extension beats it at 8 L0
    goal["informative"] = all(g["passed"] for g in goal["base_retrieves_at_l0"].values()) and all(
        g["clearly"] for g in goal["dense_beats_base_at_long"].values()
    )

    def against_dense(ev: dict) -> dict:
        """``ev`` minus the dense extension read dense: points per task and length, last-bucket perplexity, and
        whether it is within the goal's margins (a loss of at most POINTS points, PPL_PERCENT perplexity)."""
        minus = {
            t: {n: difference(ev["tasks"][t][n]["documents"], dense["tasks"][t][n]["documents"]) for n in lengths}
            for t in scale.tasks
        }
        ppl = ppl_change(ev["ppl"][long], dense["ppl"][long])
        within_points = all(d["difference"] >= -POINTS for per in minus.values() for d in per.values())
        within_ppl = ppl["change_percent"] <= PPL_PERCENT
        return {
            "minus_dense": minus,
            "ppl_last_bucket_vs_dense": ppl,
            "within_points": within_points,
            "within_ppl": within_ppl,
            "parity": goal["informative"] and within_points and within_ppl,
        }

    sweep = []
    for budget in scale.budgets:
        name = f"sparse-{budget.name}"
        ev, run = evaluations[f"{name}/{name}"], runs[name]
        read_sparse = against_dense(ev)
        # depth 1 varies from run to run for dense and sparse alike (bench/reports/extension_mixtures_h200_20261124.md)
        if "niah" in scale.tasks:
            minus_dense_long_range = {
                n: difference(long_range(ev["tasks"]["niah"][n]), long_range(dense["tasks"]["niah"][n]))
                for n in lengths
            }
        else:
            minus_dense_long_range = None
        entry = {
            "budget": asdict(budget),
            "pattern_at_long": budget.pattern(scale.long, scale),
            "train_density": run.get("density"),
            "train_recall": run.get("recall"),
            "recall_curve": [[c["step"], c["recall"]] for c in run["curve"] if "recall" in c],
            "train_final_loss": run["final_loss"],
            "eval_density": ev["density"],
            "accuracy": table[f"{name}/{name}"]["tasks"],
            **read_sparse,
            "niah_depths_below_1_minus_dense": minus_dense_long_range,
            # the sparse extension read dense: what the sparse training alone changed (with cross evaluations)
            "read_dense": against_dense(evaluations[f"{name}/dense"]) if f"{name}/dense" in evaluations else None,
        }
        sweep.append(entry)
    default = next(e for e in sweep if e["budget"]["name"] == scale.default_budget)
    goal["sparse_default_parity"] = {k: default[k] for k in ("train_density", "within_points", "within_ppl", "parity")}
    goal["sparse_default_parity"]["budget"] = scale.default_budget
    read_dense = default["read_dense"]
    goal["sparse_default_parity"]["read_dense_parity"] = None if read_dense is None else read_dense["parity"]
    goal["budgets_at_parity"] = [e["budget"]["name"] for e in sweep if e["parity"]]
    return {"table": table, "goal": goal, "sweep": sweep}


# ---------------------------------------------------------------------------------------------- plots
def plots(scale: Scale, evaluations: dict[str, dict], summary: dict, out: Path) -> dict[str, Path]:
    """Heatmaps side by side, perplexity by position at 8 L0, accuracy and pattern recall against budget."""
    from mtraining.eval.plots import niah_heatmaps, ppl_by_position

    prefix, long = f"extension_{scale.name}", str(scale.long)
    default = f"sparse-{scale.default_budget}"
    grid_task = scale.tasks[0]
    shown = ["base/dense", "dense/dense", f"dense/{default}", f"{default}/{default}", f"{default}/dense"]
    heat = [(label, _grid(evaluations[label], grid_task, scale)) for label in shown if label in evaluations]
    paths = {"heatmaps": niah_heatmaps(heat, out / f"{prefix}_heatmaps.png")}
    curves = [
        (label, [{"length": scale.long, "buckets": ppl_curve(evaluations[label]["ppl"][long])}])
        for label in ("base/dense", "dense/dense", f"dense/{default}", f"{default}/{default}")
        if label in evaluations
    ]
    paths["ppl"] = ppl_by_position(curves, out / f"{prefix}_ppl.png")
    paths["budget"] = _budget_plot(scale, summary, out / f"{prefix}_budget.png")
    return paths


def _grid(evaluation: dict, task: str, scale: Scale) -> dict:
    """One evaluation's depth x length grid in ``niah_heatmaps``' format (depths in percent)."""
    cells = [evaluation["tasks"][task][str(n)]["grid"] for n in scale.lengths]
    depths = cells[0]["depths"]
    return {
        "lengths": scale.lengths,
        "depths": [100 * d for d in depths],
        "scores": [[c["scores"][i] for c in cells] for i in range(len(depths))],
    }


def _budget_plot(scale: Scale, summary: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    task = scale.tasks[0]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    dense = summary["table"]["dense/dense"]["tasks"][task]
    for n in scale.lengths:
        cells = [e["accuracy"][task][str(n)] for e in summary["sweep"]]
        xs = [e["train_density"] for e in summary["sweep"]]
        ys = [c["percent"] for c in cells]
        # a bootstrap interval (partial credit) need not contain its estimate: no negative bar
        errs = [
            [max(0.0, c["percent"] - c["interval"][0]) for c in cells],
            [max(0.0, c["interval"][1] - c["percent"]) for c in cells],
        ]
        line = ax.errorbar(xs, ys, yerr=errs, marker="o", linestyle="", capsize=3, label=f"sparse, {n} tokens")
        ax.axhline(dense[str(n)]["percent"], color=line[0].get_color(), linestyle="--", linewidth=1)
    for e in summary["sweep"]:
        ax.annotate(
            e["budget"]["name"],
            (e["train_density"], e["accuracy"][task][str(scale.long)]["percent"]),
            textcoords="offset points",
            xytext=(4, -12),
            fontsize=8,
        )
    ax.set_xscale("log")
    ax.set_xlabel("density of the sparse layers in training (kept fraction of causal pairs)")
    ax.set_ylabel(f"{TASK_TITLES[task]} (%), sparse-trained, sparse attention")
    ax.set_title("Accuracy against budget (dashed: dense extension)")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    for e in summary["sweep"]:
        if e["recall_curve"]:
            steps, recall = zip(*e["recall_curve"])
            bx.plot(steps, recall, marker=".", label=f"{e['budget']['name']} (density {e['train_density']:.3f})")
    bx.set_xlabel("extension step")
    bx.set_ylabel("pattern recall (attention mass kept, random query rows)")
    bx.set_title("Pattern recall over training")
    bx.legend(fontsize=8)
    bx.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------- Markdown
def _pct(cell: dict) -> str:
    lo, hi = cell["interval"]
    return f"{cell['percent']:.1f} [{lo:.0f}, {hi:.0f}]"


def _diff(d: dict) -> str:
    return f"{d['difference']:+.1f} [{d['interval'][0]:+.1f}, {d['interval'][1]:+.1f}]"


def _by_length(per: dict[str, dict]) -> str:
    """Differences per length: ``4096: +1.0 [-2.0, +4.0], ...``."""
    return ", ".join(f"{n}: {_diff(d)}" for n, d in per.items())


def _ppl(r: dict) -> str:
    """A perplexity change with its interval: ``+2.71% [+2.38, +3.03]``."""
    return f"{r['change_percent']:+.2f}% [{r['interval'][0]:+.2f}, {r['interval'][1]:+.2f}]"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def markdown(scale: Scale, result: dict, paths: dict[str, Path]) -> str:
    """The report: setup, goal checks, accuracy and perplexity tables, the budget sweep, training runs."""
    s, goal = result["summary"], result["summary"]["goal"]
    lengths, long = [str(n) for n in scale.lengths], str(scale.long)
    # from the result, not the scale's current settings (a report may be re-rendered after they change)
    run = result["scale"]
    ext = run["extension"]
    curriculum = " -> ".join(f"{st['steps']} x {st['batch']} x {st['seq_len']}" for st in run["curriculum"])
    masked = run.get("document_masking", False)  # absent in results made before it
    masking = "masked (attention and sparse pattern per document)" if masked else "not masked"
    kinds = ext.get("kinds")  # text task; None: the default mixture
    mixture = f" on {', '.join(sorted(set(kinds)))} documents" if kinds else ""
    seed, extension_seed = result.get("seed"), result.get("extension_seed")  # absent in results made before them
    replicate = f", extension seed {extension_seed} (seed {seed})" if extension_seed != seed else ""
    lines = [
        f"# Context extension, dense vs dynamic sparse ({scale.name} scale{replicate})",
        "",
        f"Commit {result['commit']}, device {result['device']}, `{result['command']}`; stages took "
        f"{result['wall_s'] / 60:.1f} min wall and {result['cpu_s'] / 60:.1f} min CPU (user+sys of every process).",
        "",
        f"Base: {run['model']['num_hidden_layers']}-layer, {run['model']['hidden_size']}-wide Qwen2 "
        f"({result['parameters']:,} parameters), dense attention, trained at L0 = {run['l0']} "
        f"(curriculum {curriculum}), "
        f"RoPE base {run['base_theta']:g}. Extensions to {scale.long} tokens, RoPE base x{run['theta_factor']:g}, "
        f"{ext['steps']} steps of {ext['batch']} x {ext['seq_len']} tokens{mixture}, same seed and data order, "
        f"{run['ranks']} context-parallel rank(s) (striped layout), layer 0 dense, packed documents "
        f"{masking}. Labels read `<model>/<attention at evaluation>`; intervals are 95%.",
        "",
        "## Goal checks",
        "",
    ]
    if result.get("base_check"):
        c = result["base_check"]
        lines.append(
            f"- base checked before extending ({c['accuracy']['answers']:.0f} held-out {TASK_TITLES[c['task']]} "
            f"answers at L0): {_pct(c['accuracy'])}"
        )
    for t, g in goal["base_retrieves_at_l0"].items():
        lines.append(
            f"- base at L0, {TASK_TITLES[t]}: {_pct(g['accuracy'])} (needs {g['needed']:.0f}%: "
            f"{'yes' if g['passed'] else 'NO'})"
        )
    for t, g in goal["dense_beats_base_at_long"].items():
        lines.append(
            f"- dense extension vs base at {long}, {TASK_TITLES[t]}: {_pct(g['dense'])} vs {_pct(g['base'])}, "
            f"difference {_diff(g['difference'])} ({'clearly better' if g['clearly'] else 'NOT clearly better'})"
        )
    default = next(e for e in s["sweep"] if e["budget"]["name"] == scale.default_budget)
    for t, per in default["minus_dense"].items():
        lines.append(
            f"- sparse ({scale.default_budget}, training density {default['train_density']:.3f}) minus dense, "
            f"{TASK_TITLES[t]}, points: " + _by_length(per)
        )
    if default.get("niah_depths_below_1_minus_dense"):
        lines.append(
            "- the same, needle in a haystack with the needle before depth 1 (long range; depth 1 sits by the "
            "question), points: " + _by_length(default["niah_depths_below_1_minus_dense"])
        )
    lines.append(f"- last-bucket perplexity at {long}, sparse vs dense: {_ppl(default['ppl_last_bucket_vs_dense'])}")
    if default.get("read_dense"):
        rd = default["read_dense"]
        lines += [
            f"- the sparse extension read dense (what the sparse training alone changed) minus dense, {TASK_TITLES[t]}, "
            "points: " + _by_length(per)
            for t, per in rd["minus_dense"].items()
        ]
        lines.append(
            f"- its last-bucket perplexity at {long} vs dense: {_ppl(rd['ppl_last_bucket_vs_dense'])}; the sparse "
            f"training at parity (read dense): {'yes' if rd['parity'] else 'NO'}"
        )
    lines += [
        f"- default budget at parity (within {POINTS:g} points everywhere and {PPL_PERCENT:g}% perplexity): "
        f"{'yes' if default['parity'] else 'NO'}; budgets at parity: {', '.join(goal['budgets_at_parity']) or 'none'}",
        "",
    ]
    if not goal.get("informative", True):
        lines[-1:] = [
            "- **Not informative on retrieval**: the base does not retrieve at L0 or the dense extension is not "
            "clearly better than the base at the longest length, so equal scores say nothing about sparse attention "
            "(parity is reported as NO); only the perplexity comparison stands.",
            "",
        ]
    for t in scale.tasks:
        lines += [f"## {TASK_TITLES[t]} (% found)", ""]
        rows = [[label] + [_pct(row["tasks"][t][n]) for n in lengths] for label, row in s["table"].items()]
        lines += _table(["model / attention"] + lengths, rows) + [""]
    lines += [f"![heatmaps]({paths['heatmaps'].name})", "", "## Perplexity of the last position bucket", ""]
    rows = [[label] + [f"{row['ppl_last_bucket'][n]:.3f}" for n in lengths] for label, row in s["table"].items()]
    lines += _table(["model / attention"] + lengths, rows) + ["", f"![perplexity by position]({paths['ppl'].name})", ""]
    lines += ["## Budget sweep (sparse extensions, evaluated with their own budget)", ""]
    task = scale.tasks[0]
    head = ["budget", "v, s at long", "train density", "train recall", f"eval density {long}"]
    head += [f"{t} {n}" for t in scale.tasks for n in (lengths[0], long)] + ["ppl vs dense", "parity"]
    rows = []
    for e in s["sweep"]:
        pat, b = e["pattern_at_long"], e["budget"]
        recall = "–" if e["train_recall"] is None else f"{e['train_recall']:.3f}"
        rows.append(
            [
                b["name"] + (f" (threshold {b['threshold']})" if b["threshold"] else ""),
                f"{pat['v_size']}, {pat['s_size']}",
            ]
            + [f"{e['train_density']:.3f}", recall, f"{e['eval_density'][long]:.3f}"]
            + [_pct(e["accuracy"][t][n]) for t in scale.tasks for n in (lengths[0], long)]
            + [f"{e['ppl_last_bucket_vs_dense']['change_percent']:+.2f}%", "yes" if e["parity"] else "no"]
        )
    lines += _table(head, rows) + ["", f"![accuracy against budget]({paths['budget'].name})", ""]
    lines += [
        "Train recall: the mean over the run's logged steps of the attention probability the pattern keeps, "
        "over all query rows (estimated on `last_q` rows drawn at random each step, held out from the rows "
        "the pattern is estimated from, except by chance).",
        "",
    ]
    lines += [f"Accuracy in the plot: {TASK_TITLES[task]}.", "", "## Training runs", ""]
    lines += [
        "The loss is the mean cross-entropy over every token of the training documents (filler, needles, "
        "queries), each run under its own attention; `losses.py` splits it by token kind "
        "(retrieval answers against the rest).",
        "",
    ]
    rows = [
        [name, str(t["steps"]), f"{t['final_loss']:.3f}", f"{t['wall_s']:.0f}", f"{t['cpu_s']:.0f}"]
        for name, t in result["training"].items()
    ]
    lines += _table(["run", "steps", "loss (mean of last 10 steps)", "wall s", "cpu s"], rows) + [""]
    return "\n".join(lines)

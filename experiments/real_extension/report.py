"""The experiment's report: one or more runs, each of result folders pooled by seed, one record per configuration.

Each seed trained every arm on the same data, so a seed gives one paired difference per arm, read and length:
the arm's model (read dense, or read with its own sparse attention) minus the dense arm's model read dense, in
last-bucket perplexity (percent), NIAH and RULER-style points (generated answers; NIAH also teacher-forced).
Over n >= 3 seeds each difference gets a Student t interval (``mtraining.eval.seeds``): the one-sided 95% bounds
``ppl_change_hi``, ``niah_change_lo`` and ``ruler_change_lo``. With fewer seeds the means are given and the bounds
are None (the record says why). Speed comes from the speed stage (dense over sparse attention time on the model's
own Q/K, per length) and end to end from the trainings' tokens per second.

A folder may be partial (a call cut by its time limit): every finished cell counts, and the trainings and cells
its settings asked for but it lacks are listed (``missing``). A folder whose ``gpu<g>/`` (and ``gpu<g>_<k>/``)
subfolders are result folders (``--parallel-gpus``: one per part) stands for them.

A run is one folder, or several joined by commas (machines that split one run's seeds, or a seed's arms). Each run has its own
dense arm, and its other arms pair with that one, so seeds may repeat across runs but an arm other than dense
belongs to one run. With several runs the Markdown names each configuration's run and compares the dense arms.

Writes ``real_extension.json`` (the records), ``real_extension.md`` (tables per length and read) and
``real_extension.png`` (attention speedup against accuracy change, one panel per metric).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from mtraining.eval.seeds import MIN_SEEDS, ppl_change_pct, seed_interval

GOAL = {"speedup": 3.0, "speedup_length": 131072, "ppl_change_hi": 1.0, "niah_change_lo": -3.0, "ruler_change_lo": -3.0}
METRICS = ("ppl", "niah", "niah_forced", "niah_nll", "ruler")
# Settings that must agree for folders to pool: what the models were trained and read with.
SAME = (
    "length", "steps", "lr", "warmup", "code_weight", "gpus", "dtype", "block_size", "last_q", "local_window",
    "sink_tokens", "eval_seed", "niah_prompts", "niah_forced_prompts", "depths", "ruler_samples", "ruler_tasks",
    "ppl_windows", "first_bucket", "heldout_fraction", "earlier", "rope_final", "rope_theta",
)  # fmt: skip
# Settings added since the first runs, and the value those runs had.
ADDED = {"earlier": [], "rope_final": False, "rope_theta": None, "speed_backends": []}


def setting(settings: dict, key: str):
    """One setting of a run's (or work folder's) recorded settings; the value a run made before it existed had."""
    return settings.get(key, ADDED.get(key))


def expand(folders: Sequence[Path]) -> list[Path]:
    """The result folders given: each folder, or its parts' result folders (``gpu<g>``, ``gpu<g>_<k>``) where it has
    any."""
    found = []
    for folder in map(Path, folders):
        parts = sorted(p.parent for p in folder.glob("gpu*/run.json"))
        found += parts or [folder]
    return found


def load_folder(folder: Path) -> dict:
    """One result folder: run.json, the base check, the trainings' summaries, the reads and the speed figures."""
    run = folder / "run.json"
    if not run.exists():
        raise ValueError(f"{folder} is not a result folder of this experiment (no run.json); pass --out folders")
    base = folder / "base_check.json"
    speed = folder / "speed.json"
    return {
        "folder": str(folder),
        "run": json.loads(run.read_text()),
        "base_check": json.loads(base.read_text()) if base.exists() else None,
        "train": {p.stem: json.loads(p.read_text()) for p in sorted((folder / "train").glob("*.json"))},
        "eval": {p.stem: json.loads(p.read_text()) for p in sorted((folder / "eval").glob("*.json"))},
        "speed": _with_backend(json.loads(speed.read_text()) if speed.exists() else [], json.loads(run.read_text())),
    }


def _with_backend(found: list[dict], run: dict) -> list[dict]:
    """Speed records, each naming the backend it timed: a run made before ``speed_backends`` existed timed its
    ``backend`` alone, and its records do not say so."""
    return [{"backend": run["settings"]["backend"]} | r for r in found]


def pool(folders: Sequence[dict]) -> dict:
    """The folders' results as one: settings checked equal (``SAME``), each training and read in one folder (a seed's
    arms may lie in several: a split by arm), trainings and reads merged
    (keyed ``seed<S>_<arm>`` and ``seed<S>_<arm>__<read>``), speed figures of every folder listed."""
    if not folders:
        raise ValueError("no result folders given")
    check_same(folders)
    first = max((f["run"]["settings"] for f in folders), key=lambda s: len(s["arms"]))  # a part's may hold some arms
    arms = {a["name"]: a for f in folders for a in f["run"]["settings"]["arms"]}
    owner: dict[str, str] = {}
    for f in folders:
        for name in [*f["train"], *f["eval"]]:
            if name in owner:
                raise ValueError(f"{name} is in {owner[name]} and {f['folder']}: give each folder once")
            owner[name] = f["folder"]
    seeds = sorted({seed for f in folders for seed in _seeds_of(f)})
    pooled = {"settings": first, "arms": arms, "seeds": seeds, "train": {}, "eval": {}, "speed": []}
    for f in folders:
        pooled["train"] |= f["train"]
        pooled["eval"] |= f["eval"]
        pooled["speed"] += f["speed"]
    pooled["base_check"] = next((f["base_check"] for f in folders if f["base_check"]), None)
    pooled["calls"] = [c for f in folders for c in f["run"].get("calls", [])]
    pooled["missing"] = [m for f in folders for m in missing(f)]
    pooled["sources"] = folders[0]["run"].get("sources", {})
    return pooled


def check_same(folders: Sequence[dict]) -> None:
    """Refuse folders whose models were trained or read otherwise (``SAME``): their figures do not compare."""
    first = folders[0]["run"]["settings"]
    for f in folders[1:]:
        differ = [k for k in SAME if setting(f["run"]["settings"], k) != setting(first, k)]
        if differ:
            raise ValueError(
                f"{f['folder']} and {folders[0]['folder']} differ in {differ}: their models or reads do not pair; "
                "pool only folders of one experiment"
            )


def load_runs(runs: Sequence[str | Path], paired: bool = True) -> list[dict]:
    """Each run pooled (``pool``; a run: a folder, or folders joined by commas), named by its ``label``: its
    commits, or its folders where two runs share commits. Settings are checked equal across runs; an arm other
    than dense in two runs is refused, since it could pair with either run's dense arm. ``paired=False``: runs of
    different recipes, side by side and never paired (recipes.py): only each run's own folders are checked equal."""
    parts = [[Path(p) for p in str(run).split(",")] for run in runs]
    loaded = [[load_folder(f) for f in expand(folders)] for folders in parts]
    if paired:
        check_same([f for folders in loaded for f in folders])
    pooled = [
        pool(folders) | {"run": ",".join(map(str, names)), "folders": [f["folder"] for f in folders]}
        for folders, names in zip(loaded, parts)
    ]
    owner: dict[str, str] = {}
    for run in pooled:
        for name, arm in run["arms"].items():
            if paired and arm["sparse"] and name in owner:
                raise ValueError(f"arm {name} is in {owner[name]} and {run['run']}: give each arm's run once")
            owner[name] = run["run"]
    commits = [",".join(sorted({str(c.get("commit")) for c in run["calls"]})) for run in pooled]
    for run, commit in zip(pooled, commits):
        run["label"] = commit if commit and commits.count(commit) == 1 else run["run"]
    return pooled


def missing(folder: dict) -> list[str]:
    """What ``folder``'s settings asked for that it lacks: trainings, and reads or lengths of reads."""
    s = folder["run"]["settings"]
    lengths = [s["length"] // d for d in s["eval_fractions"]]
    found = []
    for seed in s["seeds"]:
        for arm in s["arms"]:
            if f"seed{seed}_{arm['name']}" not in folder["train"]:
                found.append(f"training seed {seed} {arm['name']}")
            for read in ("dense", "sparse") if arm["sparse"] and s.get("sparse_reads", True) else ("dense",):
                have = folder["eval"].get(f"seed{seed}_{arm['name']}__{read}")
                lacking = lengths if have is None else [n for n in lengths if n not in read_metrics(have)]
                if lacking:
                    found.append(f"seed {seed} {arm['name']} read {read} at {', '.join(map(str, lacking))}")
    return found


def _seeds_of(folder: dict) -> list[int]:
    return sorted({int(name.split("_")[0].removeprefix("seed")) for name in [*folder["train"], *folder["eval"]] if name.startswith("seed")})  # fmt: skip


def cell_metrics(cell: dict) -> dict:
    """A read's figures at one length: last-bucket perplexity, NIAH (generated and teacher-forced, percent), the
    teacher-forced NIAH answers' mean loss per token (nats: a continuous measure of retrieval, which a prompt that
    neither model or both models answer still moves; None in reads made before it was kept) and the RULER-style
    average (percent)."""
    return {
        "ppl": cell["ppl"]["buckets"][-1]["ppl"],
        "niah": cell["niah"]["score"],
        "niah_forced": cell["niah"]["forced"],
        "niah_nll": cell["niah"].get("forced_nll"),
        "ruler": cell["ruler"]["average"],
    }


def read_metrics(read: dict) -> dict[int, dict]:
    return {cell["length"]: cell_metrics(cell) for cell in read["cells"]}


def differences(pooled: dict, arm: str, read: str) -> dict[int, dict[str, dict[int, float]]]:
    """Per length, metric and seed: ``arm``'s model read ``read`` (dense / sparse) minus the dense model read dense
    (perplexity in percent, the NIAH answers' loss in nats per token, the others in points); seeds lacking either
    read are left out."""
    out: dict[int, dict[str, dict[int, float]]] = {}
    for seed in pooled["seeds"]:
        ours, theirs = pooled["eval"].get(f"seed{seed}_{arm}__{read}"), pooled["eval"].get(f"seed{seed}_dense__dense")
        if ours is None or theirs is None:
            continue
        a, b = read_metrics(ours), read_metrics(theirs)
        for n in sorted(set(a) & set(b)):
            row = out.setdefault(n, {m: {} for m in METRICS})
            row["ppl"][seed] = ppl_change_pct(a[n]["ppl"], b[n]["ppl"])
            for m in METRICS[1:]:
                if a[n][m] is not None and b[n][m] is not None:
                    row[m][seed] = a[n][m] - b[n][m]
    return out


def summarise(values: dict[int, float]) -> dict:
    """The mean over seeds of one difference and, with ``MIN_SEEDS`` or more, its t interval and one-sided bounds."""
    seeds = sorted(values)
    data = [values[s] for s in seeds]
    out = {"seeds": seeds, "values": data, "mean": sum(data) / len(data) if data else None}
    if len(data) >= MIN_SEEDS:
        found = seed_interval(data)
        out |= {"interval": [found.low, found.high], "lower_bound": found.lower_bound, "upper_bound": found.upper_bound}
    else:
        out |= {"interval": None, "lower_bound": None, "upper_bound": None}
        out["note"] = f"{len(data)} seed(s): no interval over seeds (needs {MIN_SEEDS})"
    return out


def bounds(per_metric: dict[str, dict[int, float]]) -> dict:
    """One length and read: the headline fields (means and the bounds the goal reads) and every metric's summary."""
    found = {m: summarise(v) for m, v in per_metric.items()}
    return {
        "ppl_change_pct": found["ppl"]["mean"],
        "ppl_change_hi": found["ppl"]["upper_bound"],
        "niah_change": found["niah"]["mean"],
        "niah_change_lo": found["niah"]["lower_bound"],
        "niah_forced_change_lo": found["niah_forced"]["lower_bound"],
        "niah_nll_change": found["niah_nll"]["mean"],
        "niah_nll_change_hi": found["niah_nll"]["upper_bound"],
        "ruler_change": found["ruler"]["mean"],
        "ruler_change_lo": found["ruler"]["lower_bound"],
        "metrics": found,
    }


def worst(by_length: dict[int, dict]) -> dict:
    """The bounds at the worst length (largest perplexity bound, smallest NIAH and RULER-style bounds); None where
    a length has none."""

    def pick(field: str, fn):
        values = [row[field] for row in by_length.values()]
        return None if not values or any(v is None for v in values) else fn(values)

    return {
        "ppl_change_hi": pick("ppl_change_hi", max),
        "niah_change_lo": pick("niah_change_lo", min),
        "niah_forced_change_lo": pick("niah_forced_change_lo", min),
        "niah_nll_change_hi": pick("niah_nll_change_hi", max),
        "ruler_change_lo": pick("ruler_change_lo", min),
    }


def speed_of(pooled: dict, arm: str, backend: str | None = None) -> tuple[dict[int, float], dict[int, float]]:
    """(attention speedup, pattern density) per length from the speed figures (the first folder's at a length) on
    ``backend`` (None: the first record's at a length, the first of ``--speed-backends``)."""
    speedup, density = {}, {}
    for found in pooled["speed"]:
        n = found["length"]
        if arm in found["arms"] and n not in speedup and backend in (None, found["backend"]):
            speedup[n] = found["arms"][arm]["attention_speedup"]
            density[n] = found["arms"][arm]["density"]
    return speedup, density


def speed_backends_of(pooled: dict) -> list[str]:
    """The backends the speed figures timed, in their order (one: the table and records name none)."""
    return list(dict.fromkeys(found["backend"] for found in pooled["speed"]))


def by_backend(pooled: dict, arm: str) -> dict:
    """Where the speed figures timed several backends: ``attention_speedup_by_backend`` (per backend, per length);
    else nothing, as before ``--speed-backends``."""
    backends = speed_backends_of(pooled)
    if len(backends) < 2:
        return {}
    return {"attention_speedup_by_backend": {b: speed_of(pooled, arm, b)[0] for b in backends}}


def timed_layers_of(pooled: dict) -> dict[int, list[int]]:
    """The layers the speed figures timed, per length (the first folder's at a length)."""
    found: dict[int, list[int]] = {}
    for figure in pooled["speed"]:
        found.setdefault(figure["length"], sorted(int(layer) for layer in figure.get("layers", {})))
    return found


def training_of(pooled: dict, arm: str) -> dict:
    """Means over seeds of the arm's trainings: density, step time, tokens/s, peak memory, final loss; and the
    end-to-end speedup (tokens/s over the dense arm's, paired by seed)."""
    runs = {s: pooled["train"].get(f"seed{s}_{arm}") for s in pooled["seeds"]}
    runs = {s: r for s, r in runs.items() if r is not None}

    def mean(field: str):
        values = [r[field] for r in runs.values() if r.get(field) is not None]
        return sum(values) / len(values) if values else None

    ratios = []
    for s, r in runs.items():
        dense = pooled["train"].get(f"seed{s}_dense")
        if dense and r.get("tokens_per_s_median") and dense.get("tokens_per_s_median"):
            ratios.append(r["tokens_per_s_median"] / dense["tokens_per_s_median"])
    out = {k: mean(k) for k in ("density", "step_s", "tokens_per_s_median", "peak_mem_gb", "final_loss", "wall_s")}
    return out | {"seeds": sorted(runs), "e2e_speedup": sum(ratios) / len(ratios) if ratios else None}


def records(pooled: dict) -> list[dict]:
    """One record per configuration (the dense arm first, at speedup 1 and change 0)."""
    s = pooled["settings"]
    calls = pooled["calls"]
    common = {
        "run": pooled["run"],
        "model": Path(pooled["sources"].get("gguf") or "base").name,
        "length": s["length"],
        "gpus": s["gpus"],
        "device": sorted({c.get("device") for c in calls}) if calls else None,
        "commit": sorted({c.get("commit") for c in calls}) if calls else None,
        "command": sorted({c.get("command") for c in calls}) if calls else None,
        "timed_layers": timed_layers_of(pooled),
    }
    out = []
    for name, arm in pooled["arms"].items():
        train = training_of(pooled, name)
        speedup, density = speed_of(pooled, name)
        record = {"config": name, "arm": arm, **common, "seeds": train["seeds"], "density": train["density"]}
        record |= {"attention_speedup": speedup, "attention_density": density, "training": train}
        record |= by_backend(pooled, name) if arm["sparse"] else {}
        if not arm["sparse"]:
            zero = {"ppl_change_pct": 0.0, "ppl_change_hi": 0.0, "niah_change_lo": 0.0, "ruler_change_lo": 0.0}
            measured = sorted({found["length"] for found in pooled["speed"]})
            record |= zero | {"density": 1.0, "attention_speedup": dict.fromkeys(measured, 1.0), "sparse_read": None}
            out.insert(0, record)
            continue
        reads = {}
        for read in ("dense", "sparse"):
            per_length = {n: bounds(v) for n, v in differences(pooled, name, read).items()}
            reads[read] = {"by_length": per_length, "worst": worst(per_length)}
        at_l = reads["dense"]["by_length"].get(s["length"], {})
        record |= {k: at_l.get(k) for k in ("ppl_change_pct", "ppl_change_hi", "niah_change_lo", "ruler_change_lo")}
        sparse_l = reads["sparse"]["by_length"].get(s["length"], {})
        record["sparse_read"] = {k: sparse_l.get(k) for k in ("ppl_change_pct", "ppl_change_hi", "niah_change_lo", "ruler_change_lo")}  # fmt: skip
        record["reads"] = reads
        record["goal"] = goal(record)
        out.append(record)
    return out


def all_records(runs: Sequence[dict]) -> list[dict]:
    """Every run's records: the dense arms first, in the order of the runs, then the other arms."""
    found = [r for run in runs for r in records(run)]
    return sorted(found, key=lambda r: r["arm"]["sparse"])


def goal(record: dict) -> dict:
    """Whether a configuration meets issue 31's goal on what was measured: speedup at 128K and, read dense, every
    length's bounds, over at least ``MIN_SEEDS`` seeds (None where a figure is missing, and for the speedup where
    the timed layers are unlike the model: ``timed_unlike_model``)."""
    speed = record["attention_speedup"].get(GOAL["speedup_length"])
    if record["length"] == GOAL["speedup_length"] and timed_unlike_model(record):
        speed = None
    bound = record["reads"]["dense"]["worst"]
    checks = {
        "seeds": len(record["seeds"]) >= MIN_SEEDS,
        "speedup": None if speed is None else speed >= GOAL["speedup"],
        "ppl": None if bound["ppl_change_hi"] is None else bound["ppl_change_hi"] <= GOAL["ppl_change_hi"],
        "niah": None if bound["niah_change_lo"] is None else bound["niah_change_lo"] >= GOAL["niah_change_lo"],
        "ruler": None if bound["ruler_change_lo"] is None else bound["ruler_change_lo"] >= GOAL["ruler_change_lo"],
    }
    return checks | {"met": all(v is True for v in checks.values())}


# ---------------------------------------------------------------------------------------------- Markdown
def cell_text(value, digits: int = 2, sign: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def _change(summary: dict, digits: int = 2) -> str:
    """mean [low, high] of one metric's differences over seeds (the mean alone below ``MIN_SEEDS``)."""
    text = cell_text(summary["mean"], digits, sign=True)
    if summary["interval"] is not None:
        low, high = summary["interval"]
        text += f" [{low:+.{digits}f}, {high:+.{digits}f}]"
    return text


def markdown(runs: Sequence[dict], found: list[dict], picture: str | None, timed: list[dict]) -> str:
    s = runs[0]["settings"]
    seeds = sorted({seed for run in runs for seed in run["seeds"]})
    arms = _arms(found)
    lacking = missing_of(runs)
    source, dense = f"devices {found[0]['device']}; commits {found[0]['commit']}", "the dense arm's model"
    if len(runs) > 1:
        source, dense = f"{len(runs)} runs (Runs: each one's folder, commit and device)", "its run's dense model"
    lines = [
        f"# Real-model context extension: {found[0]['model']}, {s['length']} tokens",
        "",
        f"Seeds {seeds}; {schedule(s)} at lr {s['lr']:g} on {s['gpus']} GPU(s); {source}. Changes are the arm's "
        f"model minus {dense} read dense, paired by seed: mean [95% t interval over seeds] (no interval under "
        f"{MIN_SEEDS} seeds). Perplexity: last position bucket, percent; NIAH and RULER-style: points, generated "
        "answers (NIAH also teacher-forced). "
        f"{niah_prompts(runs)}",
        "",
    ]
    if len(seeds) < MIN_SEEDS:
        lines += [f"**{len(seeds)} seed(s): means only, no intervals over seeds.**", ""]
    if lacking:
        lines += ["**Partial: these were asked for and are missing:** " + "; ".join(lacking) + ".", ""]
    if len(runs) > 1:
        lines += _runs_table(runs, found)
    lines += [
        "## Goal (issue 31)",
        "",
        "| config | seeds | speedup at 128K | ppl bound | NIAH bound | NIAH forced bound | NIAH answer loss bound | RULER bound | met |",
    ]
    lines += ["|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in arms:
        w, g = r["reads"]["dense"]["worst"], r["goal"]
        speed = r["attention_speedup"].get(GOAL["speedup_length"])
        shown = cell_text(speed) + (" (timed layers only)" if speed is not None and g["speedup"] is None else "")
        lines.append(
            f"| {r['config']} | {len(r['seeds'])} | {shown} | {cell_text(w['ppl_change_hi'], sign=True)} | "
            f"{cell_text(w['niah_change_lo'], 1, True)} | {cell_text(w['niah_forced_change_lo'], 1, True)} | "
            f"{cell_text(w['niah_nll_change_hi'], 3, True)} | {cell_text(w['ruler_change_lo'], 1, True)} | "
            f"{'yes' if g['met'] else 'no'} |"
        )
    lines += [
        "",
        "Bounds: one-sided 95% over seeds, worst over the lengths read (perplexity upper, NIAH and RULER-style lower; "
        "read dense). The goal reads the generated NIAH answers; the teacher-forced ones (often more prompts per cell) "
        "are shown beside them, with the upper bound of the change in their answers' mean loss (nats per token; "
        "not part of the goal).",
        "",
    ]
    for read in ("dense", "sparse"):
        lines += [f"## Read {read}", ""]
        lengths = sorted({n for r in arms for n in r["reads"][read]["by_length"]})
        if not lengths:
            lines += ["No model was read this way (`--no-sparse-reads`)." if read == "sparse" else "No reads.", ""]
        for n in lengths:
            lines += [
                f"### {n} tokens",
                "",
                "| config | density | ppl change % | NIAH pts | NIAH forced pts | NIAH answer loss, nats | RULER pts |",
            ]
            lines += ["|---|---:|---:|---:|---:|---:|---:|"]
            for r in arms:
                row = r["reads"][read]["by_length"].get(n)
                if row is None:
                    continue
                m = row["metrics"]
                lines.append(
                    f"| {r['config']} | {cell_text(r['density'], 3)} | {_change(m['ppl'])} | {_change(m['niah'], 1)} | "
                    f"{_change(m['niah_forced'], 1)} | {_change(m['niah_nll'], 3)} | {_change(m['ruler'], 1)} |"
                )
            lines.append("")
    lines += figures_read(runs) + niah_by_depth(runs) + (_dense_across(runs) if len(runs) > 1 else [])
    lines += _training_table(runs, found) + _speed_table(found, timed) + _base(runs)
    if picture:
        lines += [f"![attention speedup against accuracy change]({picture})", ""]
    return "\n".join(lines)


def _arms(found: list[dict]) -> list[dict]:
    """The records of configurations other than dense (the dense arms are the reference)."""
    return [r for r in found if r["arm"]["sparse"]]


def missing_of(runs: Sequence[dict]) -> list[str]:
    """What the runs lack (``missing``), each named by its run where there are several."""
    if len(runs) == 1:
        return list(runs[0]["missing"])
    return [f"{run['label']}: {m}" for run in runs for m in run["missing"]]


def schedule(settings: dict) -> str:
    """The trainings' phases and RoPE in words: ``30 steps`` or ``30 steps at 65536, then 30 at 131072 tokens``, then
    the RoPE when it is not YaRN for each phase's own length."""
    earlier = settings.get("earlier") or []
    theta = setting(settings, "rope_theta")
    base = f", the RoPE base {theta:g} unscaled" if theta is not None else ""
    if not earlier:
        return f"{settings['steps']} steps{base}"
    (n, k), *rest = [*earlier, (settings["length"], settings["steps"])]
    later = ", then ".join(f"{k} at {n}" for n, k in rest)
    rope = f", the RoPE scaled for {settings['length']} in every phase" if setting(settings, "rope_final") else ""
    if theta is not None:
        rope = f", the RoPE base {theta:g} unscaled in every phase"
    return f"{k} steps at {n}, then {later} tokens (each phase from the one before's model{rope})"


def timed_only(runs: Sequence[dict], found: list[dict]) -> list[dict]:
    """The arms the speed stages timed but no run trained (``--speed-arms``): per length their speedup and
    density on the same Q/K as the trained arms', from the first folder that timed them there."""
    trained = {r["config"] for r in found}
    pooled = {"speed": [s for run in runs for s in run["speed"]]}
    names = sorted({a for s in pooled["speed"] for a in s["arms"]} - trained)
    out = []
    for name in names:
        speedup, density = speed_of(pooled, name)
        models = sorted({s["model"] for s in pooled["speed"] if name in s["arms"]})
        out.append(
            {"config": name, "attention_speedup": speedup, "attention_density": density, "models": models}
            | by_backend(pooled, name)
        )
    return out


def niah_prompts(runs: Sequence[dict]) -> str:
    """How many prompts per length the NIAH columns read: generated, and teacher-forced (every count the reads
    hold, joined by /)."""
    cells = [c["niah"] for run in runs for read in run["eval"].values() for c in read["cells"]]
    if not cells:
        return ""

    def counts(field: str) -> str:
        return "/".join(str(n) for n in sorted({c.get(field, c["prompts"]) for c in cells}))

    return f"NIAH prompts per length: {counts('generated')} generated, {counts('prompts')} teacher-forced."


def _runs_table(runs: Sequence[dict], found: list[dict]) -> list[str]:
    """Where each configuration comes from: its run's folder, commits, devices and seeds."""
    lines = ["## Runs", "", "| run | folder | commit | device | seeds | configurations |", "|---|---|---|---|---|---|"]
    for run in runs:
        mine = [r for r in found if r["run"] == run["run"]]
        commit, device = (", ".join(map(str, mine[0][k] or ["-"])) for k in ("commit", "device"))
        configs = ", ".join(r["config"] for r in mine)
        seeds = ", ".join(map(str, run["seeds"]))
        lines.append(f"| {run['label']} | {run['run']} | {commit} | {device} | {seeds} | {configs} |")
    return lines + [""]


def figures_read(runs: Sequence[dict]) -> list[str]:
    """Each read's figures, means over seeds, per length; a model read in several runs is named by its run."""
    lines = ["## Figures read (means over seeds)", "", "| model | read | length | ppl (last bucket) | NIAH % | NIAH forced % | NIAH answer loss | RULER % |"]  # fmt: skip
    lines += ["|---|---|---:|---:|---:|---:|---:|---:|"]
    reads = [(run, read["model"].split("/", 1)[-1], read) for run in runs for read in run["eval"].values()]
    owners: dict[str, set[str]] = {}
    for run, model, _ in reads:
        owners.setdefault(model, set()).add(run["run"])
    groups: dict[tuple[str, str], list[dict]] = {}
    for run, model, read in reads:
        name = f"{model} ({run['label']})" if len(owners[model]) > 1 else model
        groups.setdefault((name, read["attention"]), []).append(read_metrics(read))
    for (model, attention), found in sorted(groups.items()):
        for n in sorted({n for f in found for n in f}):
            mean = {m: mean_of([f[n][m] for f in found if n in f]) for m in METRICS}
            lines.append(
                f"| {model} | {attention} | {n} | {cell_text(mean['ppl'], 3)} | {cell_text(mean['niah'], 1)} | "
                f"{cell_text(mean['niah_forced'], 1)} | {cell_text(mean['niah_nll'], 3)} | {cell_text(mean['ruler'], 1)} |"
            )
    return lines + [""]


def niah_by_depth(runs: Sequence[dict]) -> list[str]:
    """The teacher-forced NIAH score by the needle's depth in the context, per model, read and length (means over
    seeds): where in the context a model stops finding the needle. Reads without per-prompt records are left out."""
    groups: dict[tuple[str, str, int], dict[float, list[float]]] = {}
    for run in runs:
        label = f" ({run['label']})" if len(runs) > 1 else ""
        for read in run["eval"].values():
            model = read["model"].split("/", 1)[-1] + label
            for c in read["cells"]:
                for r in c["niah"].get("records", []):
                    if "forced_score" in r:
                        key = (model, read["attention"], c["length"])
                        groups.setdefault(key, {}).setdefault(r["depth"], []).append(100 * r["forced_score"])
    if not groups:
        return []
    depths = sorted({d for by in groups.values() for d in by})
    lines = ["## NIAH by needle depth (teacher-forced %, means over seeds and prompts)", ""]
    lines += ["| model | read | length | " + " | ".join(f"{d:g}%" for d in depths) + " |"]
    lines += ["|---|---|---:|" + "---:|" * len(depths)]
    for (model, attention, n), by in sorted(groups.items()):
        cells = [cell_text(mean_of(by.get(d, [])), 0) for d in depths]
        lines.append(f"| {model} | {attention} | {n} | " + " | ".join(cells) + " |")
    return lines + [""]


def _dense_across(runs: Sequence[dict]) -> list[str]:
    """Each run's dense model read dense, per length and seed, and each later run's change from the first run's:
    the noise between runs at the same seeds and data."""
    ppl: list[dict[tuple[int, int], float]] = []
    for run in runs:
        reads = {seed: run["eval"].get(f"seed{seed}_dense__dense") for seed in run["seeds"]}
        ppl.append({(n, s): m["ppl"] for s, read in reads.items() if read for n, m in read_metrics(read).items()})
    labels = [run["label"] for run in runs]
    header = [f"dense ({label})" for label in labels] + [f"{label} vs {labels[0]} %" for label in labels[1:]]
    lines = ["## Dense arm across runs (last-bucket perplexity)", "", "| length | seed | " + " | ".join(header) + " |"]
    lines += ["|---:|---:|" + "---:|" * len(header)]
    for n, seed in sorted(set().union(*ppl)):
        values = [found.get((n, seed)) for found in ppl]
        if sum(v is not None for v in values) < 2:
            continue
        changes = [None if v is None or values[0] is None else ppl_change_pct(v, values[0]) for v in values[1:]]
        cells = [cell_text(v, 4) for v in values] + [cell_text(c, 3, sign=True) for c in changes]
        lines.append(f"| {n} | {seed} | " + " | ".join(cells) + " |")
    return lines + [""]


def mean_of(values: list) -> float | None:
    """The mean of the values that are not None; None when none is."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _training_table(runs: Sequence[dict], found: list[dict]) -> list[str]:
    """Each configuration's training; a configuration in several runs (the dense arm) is named by its run."""
    labels = {run["run"]: run["label"] for run in runs}
    names = [r["config"] for r in found]
    lines = ["## Training (means over seeds)", "", "| config | density | s/step | tokens/s | vs dense | peak GB | final loss |"]  # fmt: skip
    lines += ["|---|---:|---:|---:|---:|---:|---:|"]
    for r in found:
        t = r["training"]
        name = f"{r['config']} ({labels[r['run']]})" if names.count(r["config"]) > 1 else r["config"]
        lines.append(
            f"| {name} | {cell_text(t['density'], 3)} | {cell_text(t['step_s'])} | {cell_text(t['tokens_per_s_median'], 0)} | "
            f"{cell_text(t['e2e_speedup'])} | {cell_text(t['peak_mem_gb'], 1)} | {cell_text(t['final_loss'], 3)} |"
        )
    return lines + [""]


def _speed_table(found: list[dict], timed: list[dict]) -> list[str]:
    """Each trained configuration's attention speed, then those timed only (not trained) on the same Q/K."""
    lengths = sorted({n for r in [*found, *timed] for n in r["attention_speedup"]})
    if not lengths:
        return ["## Speed", "", "No speed figures in these folders.", ""]
    lines = ["## Attention speed (estimate + forward + backward against dense forward + backward, the model's Q/K)", ""]
    lines += ["| config | " + " | ".join(f"{n} speedup (density)" for n in lengths) + " |"]
    lines += ["|---|" + "---:|" * len(lengths)]
    for r in [*_arms(found), *timed]:
        for backend, speedup in r.get("attention_speedup_by_backend", {"": r["attention_speedup"]}).items():
            cells = [f"{cell_text(speedup.get(n))} ({cell_text(r['attention_density'].get(n), 3)})" for n in lengths]
            name = r["config"] + (f" on {backend}" if backend else "") + (" (timed only)" if r in timed else "")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if timed:
        lines += [
            "",
            "Timed only: not trained, timed on the trained models' Q/K (" + ", ".join(timed[0]["models"]) + ").",
        ]
    layers = next((r["timed_layers"] for r in found if r.get("timed_layers")), {})
    if layers:
        lines += ["", "Timed layers: " + "; ".join(f"{layers[n]} at {n}" for n in sorted(layers)) + "."]
    for r in _arms(found):
        if timed_unlike_model(r):
            lines += ["", _unrepresentative(r)]
    return lines + [""]


def timed_unlike_model(r: dict) -> bool:
    """Whether the speed stage's layers kept a density more than 10% off the model's in training, at the length it
    was trained at: their speedup is then not the model's."""
    timed, trained = r["attention_density"].get(r["length"]), r["density"]
    return timed is not None and bool(trained) and abs(timed - trained) > 0.1 * trained


def _unrepresentative(r: dict) -> str:
    """The warning where ``timed_unlike_model``."""
    timed = r["attention_density"][r["length"]]
    return (
        f"**{r['config']}: the timed layers keep {timed:.3f} of the pairs at {r['length']}, the model "
        f"{r['density']:.3f} in training: the speedup above is of those layers, not of the whole model (the goal's "
        "speedup is not counted).**"
    )


def _base(runs: Sequence[dict]) -> list[str]:
    """The base check of each run that made one (named by its run where there are several)."""
    lines = []
    for run in runs:
        found = run["base_check"]
        if not found:
            continue
        low, high = found["interval"]
        which = f" ({run['label']})" if len(runs) > 1 else ""
        lines.append(
            f"NIAH at its native {found['length']} tokens{which}: {found['score']:.1f}% [{low:.1f}, {high:.1f}] "
            f"generated, {cell_text(found.get('forced'), 1)}% teacher-forced, {found['prompts']} prompts."
        )
    return ["## Base check", "", "\n\n".join(lines), ""] if lines else []


# ---------------------------------------------------------------------------------------------- picture
def picture(found: list[dict], default: str | None, path: Path, timed: Sequence[dict] = ()) -> Path:
    """Attention speedup (x, log) against the change at the trained length (one panel per metric), read dense
    (filled) and read sparse (open), with the two-sided t interval over seeds as bars; dense at (1, 0); the
    configuration proposed as the default (``--default``) starred; the configurations timed only (``timed_only``)
    as dotted lines at their speedup, their accuracy unknown. x: the speedup at the length the change is read at
    (the trained length) where measured, so both axes describe the same inputs; else at 128K, else at the longest
    length measured, else the end-to-end training speedup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    length = found[0]["length"]
    measured = sorted({n for r in found for n in r["attention_speedup"]})
    preferred = [n for n in (length, GOAL["speedup_length"]) if n in measured]
    at = preferred[0] if preferred else (measured[-1] if measured else None)
    panels = (("ppl", "perplexity change, %", GOAL["ppl_change_hi"]), ("niah", "NIAH change, points", GOAL["niah_change_lo"]), ("ruler", "RULER-style change, points", GOAL["ruler_change_lo"]))  # fmt: skip
    speeds = {r["config"]: r["attention_speedup"][at] for r in timed if at in r["attention_speedup"]}
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (metric, title, bound) in zip(axes, panels):
        ax.axhline(0, color="grey", lw=0.8)
        ax.axhline(bound, color="tab:red", lw=0.8, ls="--")
        ax.plot([1.0], [0.0], "ko")
        ax.annotate("dense", (1.0, 0.0), textcoords="offset points", xytext=(4, 4), fontsize=8)
        for r in _arms(found):
            x = r["attention_speedup"].get(at) if at is not None else r["training"]["e2e_speedup"]
            if x is None:
                continue
            for read, style in (("dense", "o"), ("sparse", "s")):
                row = r["reads"][read]["by_length"].get(length)
                if row is None or row["metrics"][metric]["mean"] is None:
                    continue
                m = row["metrics"][metric]
                err = (
                    None if m["interval"] is None else [[m["mean"] - m["interval"][0]], [m["interval"][1] - m["mean"]]]
                )
                face = "tab:blue" if read == "dense" else "none"
                ax.errorbar([x], [m["mean"]], yerr=err, fmt=style, color="tab:blue", mfc=face, capsize=3)
                if read == "dense":
                    label = r["config"] + (" (default)" if r["config"] == default else "")
                    ax.annotate(label, (x, m["mean"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
                if r["config"] == default and read == "dense":
                    ax.plot([x], [m["mean"]], "*", color="tab:orange", ms=14, zorder=0)
        for x in speeds.values():
            ax.axvline(x, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(ticker.FixedLocator([1, 1.5, 2, 3, 5, 7, 10, 15, 20]))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlim(0.8, max([1.0, *ax.get_xlim()]) * 1.4)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(f"attention speedup at {at} tokens" if at is not None else "end-to-end training speedup")
    title = (
        f"{found[0]['model']} extended to {length}: change at {length} (filled: read dense, open: read sparse; "
        "bars: 95% t interval over seeds; dashed: the goal)"
    )
    if speeds:
        title += "\ndotted: timed only, not trained: " + ", ".join(f"{k} {v:.2f}x" for k, v in sorted(speeds.items(), key=lambda kv: kv[1]))  # fmt: skip
    fig.suptitle(title, fontsize=10, y=1.0 + 0.05 * title.count("\n"))  # above the panels' titles
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def write_report(
    runs: Sequence[str | Path], out: Path, name: str = "real_extension", default: str | None = None
) -> Path:
    """The report of ``runs`` (``load_runs``) into ``out``: ``<name>.json``, ``.md`` and ``.png``; returns the
    JSON's path. The configuration starred as the default: ``default``, else the one every run names, else none."""
    loaded = load_runs(runs)
    found = all_records(loaded)
    named = {run["settings"].get("default_arm") for run in loaded}
    default = default or (named.pop() if len(named) == 1 else None)
    out.mkdir(parents=True, exist_ok=True)
    timed = timed_only(loaded, found)
    png = picture(found, default, out / f"{name}.png", timed) if _arms(found) else None
    (out / f"{name}.md").write_text(markdown(loaded, found, png.name if png else None, timed) + "\n")
    path = out / f"{name}.json"
    folders = [f for run in loaded for f in run["folders"]]
    result = {"name": name, "folders": folders, "default": default, "records": found, "missing": missing_of(loaded)}
    result["timed_only"] = timed
    path.write_text(json.dumps(result, indent=1, default=_jsonable) + "\n")
    return path


def _jsonable(value):
    return str(value)


def write_folder_report(out: Path) -> None:
    """This folder's own report (``out/report/``), once it holds any read."""
    if any((out / "eval").glob("*.json")):
        write_report([out], out / "report")

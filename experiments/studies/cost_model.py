"""The ring cost model (mtraining/parallel/ring_cost.py) against measurements, and on larger clusters.

    python -m experiments.studies.cost_model [--ring-results bench/results/ring_attention.json] [--out cost.json]
    python -m experiments.studies.cost_model --annotate ring.json   # predictions beside every measured time of a run
    python -m experiments.studies.cost_model --choices ring.json    # parallel.ring: auto beside flat vs hierarchical

``--annotate``: every record of a bench/ring_attention.py run gets the model's prediction of its time
(bench/ring_prediction.py says how: the per-step compute MEASURED on the flat ring, the links ASSUMED), the
JSON is rewritten and a table printed. ring_attention.py annotates its own records.

``--choices``: for every case a run measured both flat and hierarchical (same length, inputs, method and
link), the trainer's own ``parallel.ring: auto`` verdict (train/ring_choice.py, with the run's shape, the
record's inner ring as the node and its outer link, NVLink for the host's) goes into both records
(``auto_ring``, ``auto_reason``, ``auto_right``: the picked ring measured within the trainer's margin of
the faster), the JSON is rewritten and a table printed. Nothing runs on a GPU: it can follow a run anywhere.

Larger clusters: per-GPU throughput (computed query-key pairs per second, forward and backward) is
MEASURED: it is taken from the ring records (sparse striped and dense zigzag, the longest sequence
there), as total pairs / (GPUs x time), so it includes the ring's per-step overheads on NVLink.
Everything else is ASSUMED and printed: the pattern density at the target length (the measured one),
the A100/H100 throughput relative to H200 (ratio of dense bf16 peaks), link bandwidths and latencies.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import RESULTS_DIR
from bench.ring_prediction import NVLINK, REAL_LINKS, annotate, print_annotated
from mtraining.parallel import ring_cost

QWEN_3B = ring_cost.AttentionShape(heads_q=16, heads_kv=2, head_dim=128)  # bf16 K/V: 1024 bytes per token per layer
H200_DENSE_BF16_TFLOPS = 989.0
CLUSTERS = [
    # name, nodes, gpus per node, throughput factor vs H200, intra link, inter link, note
    (
        "4 x 8 A100-40GB (paper)",
        4,
        8,
        312.0 / H200_DENSE_BF16_TFLOPS,
        ring_cost.Link(300e9, 2e-6),
        ring_cost.Link(25e9, 5e-6),
        "NVLink3 300 GB/s/dir, HDR InfiniBand 25 GB/s per GPU; A100 = H200 x 312/989 (dense bf16 peaks)",
    ),
    (
        "16 x 8 H100",
        16,
        8,
        1.0,
        ring_cost.Link(450e9, 2e-6),
        ring_cost.Link(50e9, 5e-6),
        "NVLink4 450 GB/s/dir, NDR InfiniBand 50 GB/s per GPU; H100 = H200 x 1.0 (same bf16 peak)",
    ),
]
SEQ_LENS = [512 * 1024, 1024 * 1024]
# bench/ring_attention.py's pattern options, for records that predate their fields
RING_DEFAULTS = dict(block_size=128, v_size=1024, s_size=6144, local_window=128, last_q=64)


def _auto_ring(record: dict):
    """The trainer's ``parallel.ring: auto`` choice (a RingChoice) for the case of hierarchical ``record``."""
    from types import SimpleNamespace

    from mtraining.train.config import parse_config
    from mtraining.train.ring_choice import choose_ring

    sparse = record["method"].startswith("sparse")
    gbps = NVLINK.bandwidth / 1e9 if record.get("outer_link", "host") in REAL_LINKS else record["outer_gbps"]
    heads = dict(num_attention_heads=record["heads_q"], num_key_value_heads=record["heads_kv"])
    heads["hidden_size"] = record["heads_q"] * record["head_dim"]
    raw = dict(
        model=dict(config=dict(model_type="qwen2", **heads), dtype=record.get("dtype", "bfloat16")),
        attention=dict(
            sparse=sparse, layout=record["layout"], block_size=record.get("block_size", RING_DEFAULTS["block_size"])
        ),
        parallel=dict(context=record["gpus"], inner_size=record["inner_size"], inter_node_gbps=gbps),
        data=dict(sources=["unused"], seq_len=record["seq_len"]),
        optim=dict(lr=1e-5),
        train=dict(steps=1),
    )
    if sparse:
        raw["attention"].update({k: record.get(k, v) for k, v in RING_DEFAULTS.items() if k != "block_size"})
    return choose_ring(parse_config(raw), record["gpus"], SimpleNamespace(**heads))


def auto_choices(records: list[dict]) -> list[dict]:
    """The trainer's choice beside every flat/hierarchical pair of ``records`` (module docstring, ``--choices``);
    returns one summary per pair."""
    from mtraining.train.ring_choice import MARGIN

    def key(r: dict) -> tuple:
        return r["seq_len"], r.get("inputs"), r["method"], r.get("outer_link", "host")

    flat = {key(r): r for r in records if r.get("schedule") == "flat" and r["fwd_bwd_ms"] == r["fwd_bwd_ms"]}
    cases = []
    for hier in records:
        pair = flat.get(key(hier))
        if hier.get("schedule") != "hierarchical" or pair is None or hier["fwd_bwd_ms"] != hier["fwd_bwd_ms"]:
            continue
        choice = _auto_ring(hier)
        measured = {"flat": pair["fwd_bwd_ms"], "hierarchical": hier["fwd_bwd_ms"]}
        right = measured[choice.ring] <= (1 + MARGIN) * min(measured.values())
        for r in (pair, hier):
            r.update(auto_ring=choice.ring, auto_reason=choice.reason, auto_right=right)
        cases.append(dict(zip(("seq_len", "inputs", "method", "outer_link"), key(hier)), inner_size=hier["inner_size"]))
        cases[-1].update(flat_ms=measured["flat"], hierarchical_ms=measured["hierarchical"], auto=choice.ring)
        cases[-1].update(right=right, reason=choice.reason)
    return cases


def print_choices(cases: list[dict]) -> None:
    """One line per case: measured flat and hierarchical fwd+bwd ms, the trainer's pick and whether it is right."""
    print(f"{'seq':>8} {'method':>16} {'link':>26} {'flat ms':>9} {'hier ms':>9} {'auto':>12} right  reason")
    for c in cases:
        print(
            f"{c['seq_len']:>8} {c['method']:>16} {c['outer_link']:>26} {c['flat_ms']:9.2f} "
            f"{c['hierarchical_ms']:9.2f} {c['auto']:>12} {'yes' if c['right'] else 'NO':>5}  {c['reason']}"
        )


def measured_throughput(records: list[dict], method: str) -> dict:
    """Per-GPU pairs/s (fwd, bwd) from the longest-sequence ring record of ``method``."""
    rows = [r for r in records if r.get("method") == method]
    if not rows:
        raise SystemExit(f"no {method!r} record in the ring results; run bench/ring_attention.py first")
    r = max(rows, key=lambda row: row["seq_len"])
    shape = ring_cost.AttentionShape(r["heads_q"], r["heads_kv"], r["head_dim"])
    pairs = shape.pairs(r["seq_len"], r["density"])
    return {
        "source": f"{r['device']} x{r['gpus']} ring, {method}, seq_len {r['seq_len']}, commit {r['commit']}",
        "density": r["density"],
        "fwd_pairs_per_s": pairs / (r["gpus"] * r["fwd_ms"] / 1e3),
        "bwd_pairs_per_s": pairs / (r["gpus"] * r["bwd_ms"] / 1e3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ring-results", default=str(RESULTS_DIR / "ring_attention.json"))
    ap.add_argument("--out", help="also write the inputs and predictions as JSON here")
    ap.add_argument(
        "--annotate", type=Path, help="a bench/ring_attention.py JSON: add predictions to its records (rewritten)"
    )
    ap.add_argument(
        "--choices", type=Path, help="a bench/ring_attention.py JSON: add the trainer's ring: auto verdicts (rewritten)"
    )
    args = ap.parse_args()
    if args.choices is not None:
        records = json.loads(args.choices.read_text())
        cases = auto_choices(records)
        args.choices.write_text(json.dumps(records, indent=1) + "\n")
        print_choices(cases)
        return
    if args.annotate is not None:
        records = annotate(json.loads(args.annotate.read_text()))
        args.annotate.write_text(json.dumps(records, indent=1) + "\n")
        print_annotated(records)
        return
    records = json.loads(Path(args.ring_results).read_text())
    inputs = {
        "sparse": measured_throughput(records, "sparse_striped"),
        "dense": measured_throughput(records, "dense_zigzag"),
    }
    print("MEASURED per-GPU throughput (H200, computed query-key pairs per second):")
    for kind, m in inputs.items():
        print(
            f"  {kind:6s} fwd {m['fwd_pairs_per_s']:.3e}  bwd {m['bwd_pairs_per_s']:.3e}  "
            f"density {m['density']:.3f}  <- {m['source']}"
        )
    print(
        "ASSUMED: attention shape Qwen2.5-3B (16 q / 2 KV heads, d=128, bf16 K/V = "
        f"{QWEN_3B.kv_bytes_per_token} B/token/layer, float32 dK/dV = {QWEN_3B.grad_bytes_per_token} B/token); "
        "density at 512K and 1M = the measured one; striped layout (every step costs the same); batch 1"
    )
    out = {"inputs": inputs, "clusters": [], "predictions": []}
    for name, nodes, gpn, factor, intra, inter, note in CLUSTERS:
        cluster = ring_cost.Cluster(nodes, gpn, intra, inter)
        print(
            f"\n{name}: {cluster.world_size} GPUs. ASSUMED: {note}; latency {intra.latency * 1e6:g} us "
            f"intra, {inter.latency * 1e6:g} us inter; throughput factor {factor:.3f}"
        )
        out["clusters"].append(
            {
                "name": name,
                "nodes": nodes,
                "gpus_per_node": gpn,
                "throughput_factor": factor,
                "intra_GBps": intra.bandwidth / 1e9,
                "inter_GBps": inter.bandwidth / 1e9,
                "note": note,
            }
        )
        print(
            f"  {'seq':>5s} {'kind':6s} {'step fwd/bwd ms':>16s} {'K/V hop ms (intra/inter)':>25s} "
            f"{'flat ms':>9s} {'hier ms':>9s} {'flat/hier':>9s}"
        )
        for n in SEQ_LENS:
            for kind, m in inputs.items():
                work = ring_cost.step_work(
                    QWEN_3B,
                    n,
                    cluster.world_size,
                    m["density"],
                    m["fwd_pairs_per_s"] * factor,
                    m["bwd_pairs_per_s"] * factor,
                )
                flat, hier = ring_cost.flat_ring_time(cluster, work), ring_cost.hierarchical_ring_time(cluster, work)
                print(
                    f"  {n // 1024:4d}K {kind:6s} {work.fwd * 1e3:7.3f}/{work.bwd * 1e3:<8.3f} "
                    f"{intra.seconds(work.kv_bytes) * 1e3:12.3f}/{inter.seconds(work.kv_bytes) * 1e3:<12.3f} "
                    f"{flat.total * 1e3:9.2f} {hier.total * 1e3:9.2f} {flat.total / hier.total:9.2f}"
                )
                out["predictions"].append(
                    {
                        "cluster": name,
                        "seq_len": n,
                        "kind": kind,
                        "step_fwd_ms": work.fwd * 1e3,
                        "step_bwd_ms": work.bwd * 1e3,
                        "kv_bytes_per_hop": work.kv_bytes,
                        "flat_fwd_ms": flat.fwd * 1e3,
                        "flat_bwd_ms": flat.bwd * 1e3,
                        "flat_ms": flat.total * 1e3,
                        "hierarchical_fwd_ms": hier.fwd * 1e3,
                        "hierarchical_bwd_ms": hier.bwd * 1e3,
                        "hierarchical_ms": hier.total * 1e3,
                        "predicted": True,
                    }
                )
    print("\nAll times are PREDICTIONS of one attention layer (forward + backward), not measurements.")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""The ring cost model's (parallel/ring_cost.py) prediction beside every measured time of a bench/ring_attention.py
run.

Every record gets ``predicted_fwd_ms``, ``predicted_bwd_ms``, ``predicted_ms`` and ``predicted_over_measured``.
The per-step compute is MEASURED: that of the same method and length on the flat ring over real links (its
``fwd_ms`` / W and ``bwd_ms`` / W, the ring being compute-bound there: that record is the calibration and predicts
itself); the links are ASSUMED (NVLink below, or the emulated link the record names), so what is checked is the
model's schedules (flat, hierarchical, all-gather) and links. bench/ring_attention.py annotates its own records;
``python -m experiments.studies.cost_model --annotate`` annotates a saved run.
"""

from __future__ import annotations

from mtraining.parallel import ring_cost

NVLINK = ring_cost.Link(450e9, 2e-6)  # NVLink4 (H100, H200) per GPU and direction: ASSUMED
REAL_LINKS = ("host",)  # a record's outer_link when no link is emulated (the host's own: NVLink on GPUs)
ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


def _calibration_key(record: dict) -> tuple:
    return (record["seq_len"], record.get("inputs"), record["method"])


def is_calibration(record: dict) -> bool:
    """A flat-ring record over real links: its per-step compute is what the predictions start from."""
    return record.get("schedule", "flat") == "flat" and record.get("outer_link", "host") in REAL_LINKS


def predict_record(record: dict, calibration: dict) -> ring_cost.Prediction:
    """The model's time (seconds) of ``record``'s schedule and link, from the per-step compute of ``calibration``
    (the same method and length on the flat ring over real links; see the module docstring)."""
    w = record["gpus"]
    elem = ELEMENT_BYTES[record.get("dtype", "bfloat16")]
    shape = ring_cost.AttentionShape(record["heads_q"], record["heads_kv"], record["head_dim"], elem, max(elem, 4))
    tokens = record["seq_len"] // w
    work = ring_cost.StepWork(
        calibration["fwd_ms"] / 1e3 / w,
        calibration["bwd_ms"] / 1e3 / w,
        tokens * shape.kv_bytes_per_token,
        tokens * shape.grad_bytes_per_token,
    )
    link = record.get("outer_link", "host")
    outer = NVLINK if link in REAL_LINKS else ring_cost.Link(record["outer_gbps"] * 1e9, record["outer_latency_s"])
    schedule = record.get("schedule", "flat")
    if schedule == "allgather":
        return ring_cost.allgather_time(ring_cost.Cluster(1, w, NVLINK, NVLINK), work)
    if schedule == "flat":  # with an emulated link every hop waits for it (ranks advance in lock step)
        nodes = 1 if link in REAL_LINKS else w
        return ring_cost.flat_ring_time(ring_cost.Cluster(nodes, w // nodes, NVLINK, outer), work)
    inner = record["inner_size"]
    return ring_cost.hierarchical_ring_time(ring_cost.Cluster(w // inner, inner, NVLINK, outer), work)


def annotate(records: list[dict]) -> list[dict]:
    """Add the model's prediction beside every measured time (records without a calibration get none);
    returns the records."""
    calibrations = {_calibration_key(r): r for r in records if is_calibration(r) and r.get("fwd_ms") == r.get("fwd_ms")}
    for r in records:
        calibration = calibrations.get(_calibration_key(r))
        if calibration is None or r.get("method") == "torch_cp" or r.get("fwd_ms") != r.get("fwd_ms"):
            continue
        p = predict_record(r, calibration)
        r.update(
            predicted_fwd_ms=p.fwd * 1e3,
            predicted_bwd_ms=p.bwd * 1e3,
            predicted_ms=p.total * 1e3,
            predicted_over_measured=p.total * 1e3 / r["fwd_bwd_ms"],
            prediction_basis="calibration" if r is calibration else "flat ring over real links, same method and length",
        )
    return records


def print_annotated(records: list[dict]) -> None:
    """One line per record: measured and predicted fwd+bwd ms."""
    print(
        f"{'seq':>8} {'method':>20} {'schedule':>12} {'link':>26} {'measured ms':>12} {'predicted ms':>13} {'ratio':>6}"
    )
    for r in records:
        if "predicted_ms" not in r:
            continue
        schedule = r.get("schedule", "flat") + (f" {r['inner_size']}" if r.get("inner_size") else "")
        print(
            f"{r['seq_len']:>8} {r['method']:>20} {schedule:>12} {r.get('outer_link', 'host'):>26} "
            f"{r['fwd_bwd_ms']:12.2f} {r['predicted_ms']:13.2f} {r['predicted_over_measured']:6.2f}"
        )

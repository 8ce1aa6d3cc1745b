"""Ring records as bench/ring_attention.py writes them, from the times issue 32 measured on 4 x H200: what the cost
model's predictions (bench/ring_prediction.py) and the trainer's ring choice (experiments/studies/cost_model.py)
are checked against."""

from __future__ import annotations

# 4 x H200 as 2 "nodes" x 2 (ring_attention(..., ring="hierarchical", inner_size=2,
# outer_comm=emulated(link)), the flat ring as 4 x 1), sparse striped, Qwen2.5-3B heads, bf16,
# fwd+bwd ms (flat, hierarchical) per link.
MEASURED_4XH200 = {
    131072: {"host": (29.6, 30.8), 25: (32.9, 32.7), 5: (103.6, 52.5)},
    524288: {"host": (227.4, 234.1), 25: (236.5, 238.3), 5: (440.3, 283.4)},
}


def issue_records(fwd_share: float) -> list[dict]:
    """One record per length, link and schedule of ``MEASURED_4XH200``; the issue gives fwd+bwd only, so the
    forward takes ``fwd_share`` of it."""
    records = []
    for n, links in MEASURED_4XH200.items():
        for link, times in links.items():
            for schedule, ms in zip(("flat", "hierarchical"), times):
                r = dict(gpus=4, heads_q=16, heads_kv=2, head_dim=128, dtype="bfloat16", seq_len=n, inputs="structured")
                r.update(layout="striped", block_size=128, v_size=1024, s_size=6144, local_window=128, last_q=64)
                r.update(
                    method="sparse_striped", schedule=schedule, inner_size=2 if schedule == "hierarchical" else None
                )
                r.update(fwd_ms=ms * fwd_share, bwd_ms=ms * (1 - fwd_share), fwd_bwd_ms=ms, outer_link="host")
                if link != "host":
                    r.update(outer_link=f"emulated {link} GB/s, 5 us", outer_gbps=float(link), outer_latency_s=5e-6)
                records.append(r)
    return records

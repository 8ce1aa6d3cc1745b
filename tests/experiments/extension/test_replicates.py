"""experiments/extension/replicates.py on hand-made results whose differences are counted here: the depth split, the
sign of sparse minus dense and of the second run minus the first, and records it cannot split by depth."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.extension import replicates as rep

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]


def _niah(hits: list[int], depths=(0.0, 1.0)) -> dict:
    """NIAH records, depth-major, with the grid the evaluation writes beside them."""
    per = len(hits) // len(depths)
    scores = [100.0 * sum(hits[i * per : (i + 1) * per]) / per for i in range(len(depths))]
    return {
        "documents": [{"hits": float(h), "answers": 1} for h in hits],
        "grid": {"depths": list(depths), "scores": scores},
    }


def _ppl(nll_per_token: float, documents: int = 4) -> dict:
    """Per-document bucket losses at 4096: two buckets of 8 tokens, ``nll_per_token`` in each."""
    return {"4096": [{"buckets": [[1, 8], [9, 16]], "nll": [8 * nll_per_token] * 2} for _ in range(documents)]}


def _result(
    dense: list[int], sparse: list[int], ruler_dense: list[float], ruler_sparse: list[float], sparse_nll: float = 1.0
) -> dict:
    def tasks(niah, ruler):
        return {
            "niah": {"4096": _niah(niah)},
            "ruler": {"4096": {"documents": [{"hits": h, "answers": 1} for h in ruler]}},
        }

    return {
        "commit": "abc",
        "device": "test",
        "evaluations": {
            "base/dense": {"tasks": tasks(dense, ruler_dense), "ppl": _ppl(2.0)},
            "dense/dense": {"tasks": tasks(dense, ruler_dense), "ppl": _ppl(1.0)},
            "sparse-v10/sparse-v10": {"tasks": tasks(sparse, ruler_sparse), "ppl": _ppl(sparse_nll)},
        },
        "summary": {
            "sweep": [
                {"budget": {"name": "v10"}, "ppl_last_bucket_vs_dense": {"change_percent": 1.5}, "train_density": 0.3}
            ]
        },
    }


def test_sparse_minus_dense_split_by_depth():
    # depth 0: dense 4/4, sparse 3/4; depth 1: dense 0/4, sparse 4/4
    result = _result([1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 0, 1, 1, 1, 1, 1], [1.0, 0.5], [0.5, 0.5])
    row = rep.compare_run(result)["v10"]["lengths"]["4096"]
    assert row["niah"]["difference"] == pytest.approx(100 * (7 - 4) / 8)
    assert row["niah_depth_below_1"]["difference"] == pytest.approx(-25.0)
    assert (row["niah_depth_1"]["a"], row["niah_depth_1"]["b"]) == (100.0, 0.0)  # sparse, dense
    assert row["ruler"]["difference"] == pytest.approx(-25.0)
    assert rep.compare_run(result)["v10"]["train_density"] == 0.3


def test_second_run_minus_first_on_the_same_prompts():
    first = _result([1, 1, 1, 1, 1, 1, 1, 1], [1] * 8, [1.0, 1.0], [1.0, 1.0])
    second = _result([1, 1, 1, 1, 0, 0, 1, 1], [1] * 8, [0.0, 1.0], [1.0, 1.0])
    out = rep.compare_replicates(first, second)
    assert "base/dense" not in out
    assert out["dense/dense"]["niah"]["4096"]["difference"] == pytest.approx(-25.0)
    assert out["dense/dense"]["ruler"]["4096"]["difference"] == pytest.approx(-50.0)
    assert out["sparse-v10/sparse-v10"]["niah"]["4096"]["difference"] == 0.0


def test_records_out_of_depth_order_are_refused():
    niah = _niah([1, 1, 0, 0])
    niah["grid"]["scores"] = [0.0, 100.0]  # the records say depth 0 found both, the grid says none
    with pytest.raises(ValueError, match="depth-major"):
        rep.by_depth(niah)


def test_script_writes_json_and_markdown(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_result([1] * 8, [1] * 8, [1.0, 1.0], [1.0, 1.0])))
    b.write_text(json.dumps(_result([1, 1, 1, 1, 0, 0, 0, 0], [1] * 8, [1.0, 1.0], [1.0, 1.0])))
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "experiments.extension.replicates", "--run", f"a={a}", "--run", f"b={b}"]
    subprocess.run(
        [*cmd, "--same", "a,b", "--pool", "ab=a,b", "--out", str(out)], check=True, capture_output=True, cwd=ROOT
    )
    result = json.loads(out.read_text())
    assert result["replicates"]["a -> b"]["dense/dense"]["niah"]["4096"]["difference"] == pytest.approx(-50.0)
    assert "| b | v10 | 4096 | +50.0" in out.with_suffix(".md").read_text()
    assert result["pooled"]["ab"]["v10"]["niah"]["4096"]["per_run"] == [0.0, 50.0]


def test_pooled_replicates_average_the_runs_and_widen_when_they_disagree():
    agree = [_result([1, 1, 0, 0], [1, 1, 1, 0], [1.0], [1.0]) for _ in range(3)]  # +25 points in each run
    differ = [
        _result([1, 1, 0, 0], [1, 1, 1, 1], [1.0], [1.0]),  # +50
        _result([1, 1, 0, 0], [1, 1, 0, 0], [1.0], [1.0]),  # 0
        _result([1, 1, 0, 0], [1, 1, 1, 0], [1.0], [1.0]),  # +25
    ]
    same, spread = rep.pooled(agree, "v10")["niah"]["4096"], rep.pooled(differ, "v10")["niah"]["4096"]
    assert same["per_run"] == [25.0] * 3 and same["difference"] == pytest.approx(25.0)
    assert spread["per_run"] == [50.0, 0.0, 25.0] and spread["difference"] == pytest.approx(25.0)
    width = [p["interval"][1] - p["interval"][0] for p in (same, spread)]
    assert width[1] > width[0] and spread["interval"][0] <= 0.0  # the runs' disagreement is in the interval
    mismatched = _result([1, 1, 0, 0], [1, 1, 1, 0], [1.0], [1.0])
    mismatched["evaluations"]["dense/dense"]["tasks"]["niah"]["4096"]["documents"][0]["answers"] = 2
    with pytest.raises(ValueError, match="same documents"):
        rep.pooled([agree[0], mismatched], "v10")


def test_runs_on_other_prompts_are_refused():
    first, second = (_result([1] * 8, [1] * 8, [1.0, 1.0], [1.0, 1.0]) for _ in range(2))
    for result, answer in ((first, "123"), (second, "456")):
        result["evaluations"]["dense/dense"]["tasks"]["niah"]["4096"]["documents"][0]["expected"] = [answer]
    with pytest.raises(ValueError, match="other prompts"):
        rep.compare_replicates(first, second)
    unequal = _result([1] * 8, [1] * 8, [1.0, 1.0], [1.0, 1.0])
    unequal["evaluations"]["sparse-v10/sparse-v10"]["tasks"]["niah"]["4096"]["documents"].pop()
    with pytest.raises(ValueError, match="same documents"):
        rep.pooled([first, unequal], "v10")


def test_long_range_leaves_out_the_needles_at_depth_1():
    from experiments.extension.report import long_range

    niah = _niah([1, 0, 1, 1, 0, 0], depths=(0.0, 0.5, 1.0))
    assert long_range(niah) == niah["documents"][:4]


def test_pooled_perplexity_averages_the_runs_changes():
    runs = [_result([1] * 4, [1] * 4, [1.0], [1.0], sparse_nll=nll) for nll in (1.0, 1.1, 1.2)]
    ppl = rep.pooled(runs, "v10")["ppl_last_bucket"]["4096"]
    expected = [100 * (math.exp(d) - 1) for d in (0.0, 0.1, 0.2)]
    assert ppl["per_run"] == pytest.approx(expected)
    assert ppl["difference"] == pytest.approx(sum(expected) / 3)
    assert ppl["interval"][0] <= expected[1] <= ppl["interval"][1] and ppl["interval"][0] >= 0.0
    md = rep.markdown(
        {
            "commit": "abc",
            "command": "x",
            "runs": {},
            "replicates": {},
            "pooled": {"p": {"v10": rep.pooled(runs, "v10")}},
        }
    )
    assert f"v10: last-bucket perplexity at 4096, sparse vs dense: {sum(expected) / 3:+.2f}%" in md


def test_runs_with_cross_evaluations_also_pool_the_sparse_model_read_dense(tmp_path):
    paths = []
    for i, nll in enumerate((1.1, 1.2)):
        result = _result([1, 1, 0, 0], [1, 1, 1, 0], [1.0], [1.0], sparse_nll=nll)
        read_dense = _result([1, 1, 0, 0], [1, 1, 0, 0], [1.0], [1.0])["evaluations"]["dense/dense"]  # as dense
        result["evaluations"]["sparse-v10/dense"] = {**read_dense, "ppl": _ppl(1.0 + nll / 100)}
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(result))
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "experiments.extension.replicates", "--run", f"a={paths[0]}", "--run", f"b={paths[1]}"]
    subprocess.run([*cmd, "--pool", "ab=a,b", "--out", str(out)], check=True, capture_output=True, cwd=ROOT)
    pool = json.loads(out.read_text())["pooled"]["ab"]
    assert pool["v10"]["niah"]["4096"]["per_run"] == [25.0, 25.0]  # read sparse: one more needle found
    assert pool["v10 read dense"]["niah"]["4096"]["per_run"] == [0.0, 0.0]  # read dense: the same as dense
    expected = [100 * (math.exp(x / 100) - 1) for x in (1.1, 1.2)]
    assert pool["v10 read dense"]["ppl_last_bucket"]["4096"]["per_run"] == pytest.approx(expected)
    assert "v10 read dense: last-bucket perplexity at 4096" in out.with_suffix(".md").read_text()

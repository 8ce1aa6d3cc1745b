"""The speed stage's figures over several documents: times summed, densities averaged, each document kept."""

from __future__ import annotations

import pytest

from experiments.real_extension.speed import combine, combine_backends, summary


def timed(dense: float, sparse: float, density: float) -> dict:
    """``time_arms``'s result for one layer (3) and one arm at 1024 tokens."""
    row = {"ms": sparse, "estimate_ms": 1.0, "density": density}
    return {
        "length": 1024,
        "dense_ms": dense,
        "arms": {"v": {"attention_speedup": dense / sparse, "sparse_ms": sparse, "density": density}},
        "layers": {"3": {"dense_ms": dense, "arms": {"v": row}}},
    }


def test_documents_add_their_times_and_average_their_densities():
    both = combine([timed(100.0, 20.0, 0.1), timed(100.0, 40.0, 0.3)])
    assert both["arms"]["v"]["attention_speedup"] == pytest.approx(200.0 / 60.0)  # not the mean of 5x and 2.5x
    assert both["arms"]["v"]["density"] == pytest.approx(0.2) and both["dense_ms"] == 200.0
    assert both["layers"]["3"]["arms"]["v"] == {"ms": 60.0, "estimate_ms": 2.0, "density": pytest.approx(0.2)}
    assert [d["arms"]["v"]["attention_speedup"] for d in both["documents"]] == [5.0, 2.5]


def test_each_backend_is_combined_on_its_own_the_first_leading():
    def doc(dense: float, ms: dict[str, float]) -> list[dict]:
        layers = {b: {"0": {"dense_ms": dense, "arms": {"v": {"ms": t, "estimate_ms": 1.0, "density": 0.2}}}} for b, t in ms.items()}  # fmt: skip
        return [{"length": 8, "backend": b, **summary(layers[b]), "layers": layers[b]} for b in ms]

    records = combine_backends([doc(100.0, {"fa4": 20.0, "triton": 50.0}), doc(100.0, {"fa4": 30.0, "triton": 50.0})])
    assert [r["backend"] for r in records] == ["fa4", "triton"] and "others" not in records[0]
    assert records[0]["arms"]["v"]["attention_speedup"] == pytest.approx(4.0)
    assert records[1]["arms"]["v"]["attention_speedup"] == pytest.approx(2.0)


def test_the_parser_takes_fa4_among_the_speed_backends():
    from experiments.real_extension.cli import parser, settings_of

    args = parser().parse_args(["--preset", "toy", "--speed-backends", "fa4", "triton"])
    assert settings_of(args).timed_backends == ("fa4", "triton")
    assert settings_of(parser().parse_args(["--preset", "toy"])).timed_backends == ("torch",)


def test_fa4_among_the_speed_backends_without_flash_attn_4_names_the_fix(tmp_path, monkeypatch):
    from experiments.common.stages import Refused
    from experiments.real_extension import pipeline
    from experiments.real_extension.cli import parser, settings_of

    monkeypatch.setattr(pipeline, "fa4_installed", lambda: False)
    settings = settings_of(parser().parse_args(["--preset", "toy", "--speed-backends", "triton", "fa4"]))
    exp = pipeline.Experiment(settings, pipeline.Sources(None), tmp_path / "w", tmp_path / "o")
    with pytest.raises(Refused, match=r"carry its wheels in \.fa4/"):
        exp.speed(1024, 0)  # refused before any model is loaded

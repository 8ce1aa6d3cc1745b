"""Budgets files: parsing (YAML and JSON), per-layer/per-head lookup, PatternConfig hook, every error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mtraining.ops.estimate.budgets import Budgets, load_budgets
from mtraining.ops.estimate.estimator import PatternConfig, estimate_pattern

YAML = """
num_heads: 4
default: {v_size: 16, s_size: 64}
layers:
  0: {v_size: [8, 12, 16, 20]}
  "2": {s_size: [32, 48, 64, 80], v_size: 10}
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_yaml_and_json_agree(tmp_path):
    from_yaml = load_budgets(_write(tmp_path, "b.yaml", YAML))
    import yaml

    from_json = load_budgets(_write(tmp_path, "b.json", json.dumps(yaml.safe_load(YAML))))
    for budgets in (from_yaml, from_json):
        v, s = budgets.for_layer(0, 4)
        assert v.tolist() == [8, 12, 16, 20] and s.tolist() == [64] * 4 and v.dtype == torch.int64
        v, s = budgets.for_layer(1, 4)
        assert v.tolist() == [16] * 4 and s.tolist() == [64] * 4
        v, s = budgets.for_layer(2, 4)
        assert v.tolist() == [10] * 4 and s.tolist() == [32, 48, 64, 80]
        assert budgets.min_values() == (8, 32)
    assert from_yaml.default == from_json.default and from_yaml.layers == from_json.layers
    assert from_yaml.source.endswith("b.yaml")


def test_minimal_file_and_yml_suffix(tmp_path):
    budgets = load_budgets(_write(tmp_path, "b.yml", "default: {v_size: 3, s_size: 5}\n"))
    v, s = budgets.for_layer(7, 2)
    assert v.tolist() == [3, 3] and s.tolist() == [5, 5] and budgets.num_heads is None


def test_pattern_config_uses_per_head_budgets(tmp_path):
    path = _write(tmp_path, "b.yaml", YAML)
    config = PatternConfig.from_settings(path, last_q=16, block_size=16, sink_tokens=2, local_window=16)
    assert config.budgets == load_budgets(path)
    assert (
        PatternConfig.from_settings(load_budgets(path), last_q=16, block_size=16, sink_tokens=2, local_window=16)
        == config
    )
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 128, 4, 16, generator=g)
    k = torch.randn(1, 128, 2, 16, generator=g)
    for layer, expected in ((0, [8, 12, 16, 20]), (1, [16] * 4), (2, [10] * 4)):
        pattern = estimate_pattern(q, k, config, layer_idx=layer)
        assert pattern.num_verticals[0].tolist() == expected
    # each head of layer 2 matches a uniform config with that head's slash budget
    per_head = estimate_pattern(q, k, config, layer_idx=2)
    for head, s_size in enumerate([32, 48, 64, 80]):
        uniform = PatternConfig(v_size=10, s_size=s_size, last_q=16, block_size=16, sink_tokens=2, local_window=16)
        expected = estimate_pattern(q, k, uniform)
        assert torch.equal(per_head.diag_mask()[:, head], expected.diag_mask()[:, head])
        assert torch.equal(per_head.vertical_mask()[:, head], expected.vertical_mask()[:, head])


@pytest.mark.parametrize(
    "name,text,match",
    [
        ("b.yaml", "default: {v_size: 8, s_size: [1, 2}\n", "invalid YAML"),
        ("b.json", '{"default": {"v_size": 8,}}', "invalid JSON"),
        ("b.txt", "default: {v_size: 8, s_size: 8}\n", r"must end in \.json, \.yaml or \.yml"),
        ("b.yaml", "- 1\n- 2\n", "top level must be a mapping"),
        ("b.yaml", "", "top level must be a mapping"),
        ("b.yaml", "default: {v_size: 8, s_size: 8}\nextra: 1\n", r"unknown top-level key\(s\) \['extra'\]"),
        ("b.yaml", "layers: {}\n", "missing 'default"),
        ("b.yaml", "default: {v_size: 8}\n", "default must give both v_size and s_size"),
        ("b.yaml", "default: 8\n", "default must be a mapping"),
        ("b.yaml", "default: {v_size: 8, s_size: 8, k_size: 3}\n", r"unknown key\(s\) \['k_size'\]"),
        ("b.yaml", "default: {v_size: -4, s_size: 8}\n", "default.v_size must be >= 1, got -4"),
        ("b.yaml", "default: {v_size: 0, s_size: 8}\n", "default.v_size must be >= 1, got 0"),
        ("b.yaml", "default: {v_size: 8.5, s_size: 8}\n", "default.v_size must be an integer"),
        ("b.yaml", "default: {v_size: true, s_size: 8}\n", "default.v_size must be an integer"),
        ("b.yaml", "default: {v_size: 8, s_size: [4, -1]}\n", r"default.s_size\[1\] must be >= 1"),
        ("b.yaml", "default: {v_size: 8, s_size: []}\n", "empty list"),
        ("b.yaml", "num_heads: 2\ndefault: {v_size: [1, 2, 3], s_size: 8}\n", "lists 3 values but num_heads is 2"),
        ("b.yaml", "num_heads: 0\ndefault: {v_size: 8, s_size: 8}\n", "num_heads must be >= 1"),
        ("b.yaml", "default: {v_size: 8, s_size: 8}\nlayers: [1]\n", "layers must be a mapping"),
        ("b.yaml", "default: {v_size: 8, s_size: 8}\nlayers: {first: {v_size: 2}}\n", "layer key 'first'"),
        ("b.yaml", "default: {v_size: 8, s_size: 8}\nlayers: {-1: {v_size: 2}}\n", "layer key -1"),
        ("b.yaml", 'default: {v_size: 8, s_size: 8}\nlayers: {0: {v_size: 2}, "0": {s_size: 4}}\n', "given twice"),
        ("b.yaml", "default: {v_size: 8, s_size: 8}\nlayers: {3: {v_size: 2, kind: 4}}\n", r"layers\[3\]: unknown"),
    ],
)
def test_malformed_files(tmp_path, name, text, match):
    path = _write(tmp_path, name, text)
    with pytest.raises(ValueError, match=match) as err:
        load_budgets(path)
    assert str(path) in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist") as err:
        load_budgets(tmp_path / "nope.yaml")
    assert "nope.yaml" in str(err.value)
    with pytest.raises(ValueError, match="does not exist"):
        PatternConfig.from_settings(tmp_path / "nope.yaml")


def test_head_count_mismatch_at_lookup(tmp_path):
    path = _write(tmp_path, "b.yaml", "default: {v_size: [4, 4, 4], s_size: 8}\n")
    budgets = load_budgets(path)
    with pytest.raises(ValueError, match="layer 0 v_size lists 3 values but the model has 4 query heads") as err:
        budgets.for_layer(0, 4)
    assert str(path) in str(err.value)
    declared = load_budgets(_write(tmp_path, "c.yaml", YAML))
    with pytest.raises(ValueError, match="declared for num_heads=4 but the model has 8"):
        declared.for_layer(1, 8)


def test_config_checks_forced_lines_against_file(tmp_path):
    path = _write(tmp_path, "b.yaml", YAML)
    with pytest.raises(ValueError, match=r"sink_tokens \(9\) exceeds the smallest vertical budget \(8 in .*b.yaml\)"):
        PatternConfig.from_settings(path, sink_tokens=9, local_window=16)
    with pytest.raises(ValueError, match=r"local_window \(33\) exceeds the smallest slash budget \(32 in"):
        PatternConfig.from_settings(path, local_window=33)
    with pytest.raises(ValueError, match="either v_size/s_size or budgets"):
        PatternConfig.from_settings(path, v_size=4, local_window=16)


def test_from_dict_is_hashable_and_comparable():
    a = Budgets.from_dict({"default": {"v_size": [1, 2], "s_size": 3}, "layers": {"1": {"v_size": 5}}})
    b = Budgets.from_dict({"default": {"v_size": [1, 2], "s_size": 3}, "layers": {1: {"v_size": 5}}})
    assert a == b and hash(a) == hash(b)
    assert hash(PatternConfig(budgets=a, sink_tokens=1, local_window=3)) is not None

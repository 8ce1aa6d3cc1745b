"""HF config overrides, sliding-window detection and the exported config of a context-extended model."""

from __future__ import annotations

import pytest
import torch

from mtraining.models import build_config, build_model
from mtraining.models.loader import sliding_window_layers, trained_config
from tests.configs import SMALL as SMALL_BASE

SMALL = SMALL_BASE | dict(intermediate_size=64, num_hidden_layers=4, max_position_embeddings=1024)


def test_overrides_reach_the_config_of_a_model_folder(tmp_path):
    windowed = dict(model_type="qwen2", **SMALL, use_sliding_window=True, sliding_window=64, max_window_layers=2)
    build_model(config=windowed).save_pretrained(tmp_path)
    assert sliding_window_layers(build_config(path=tmp_path)) == [2, 3]
    cfg = build_config(
        path=tmp_path,
        overrides={
            "use_sliding_window": False,  # derived fields (layer_types) follow: the constructor sees it
            "rope_theta": 2e6,
            "attention_dropout": 0.0,
            "max_position_embeddings": 4096,
        },
    )
    assert sliding_window_layers(cfg) == [] and cfg.max_position_embeddings == 4096
    assert cfg.rope_parameters["rope_theta"] == 2e6
    yarn = build_config(path=tmp_path, overrides={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert yarn.rope_parameters["rope_type"] == "yarn" and yarn.rope_parameters["factor"] == 4.0
    with pytest.raises(ValueError, match=r"\['rope_thetta'\] are not fields of a qwen2 config"):
        build_config(path=tmp_path, overrides={"rope_thetta": 1e6})
    mistral = build_config(config=dict(model_type="mistral", **SMALL))
    assert sliding_window_layers(mistral) == [0, 1, 2, 3]  # Mistral's default window of 4096
    assert (
        sliding_window_layers(
            build_config(config=dict(model_type="mistral", **SMALL), overrides={"sliding_window": None})
        )
        == []
    )
    assert sliding_window_layers(build_config(config=dict(model_type="llama", **SMALL))) == []


def _rope(config) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention scaling) of the model a config builds."""
    model = build_model(config=config.to_dict())
    rotary = model.model.rotary_emb
    return rotary.inv_freq, rotary.attention_scaling


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_theta": 4e4},
        {"rope_type": "yarn", "factor": 4.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        {"rope_type": "linear", "factor": 4.0},
    ],
    ids=["base", "yarn", "yarn explicit", "linear"],
)
def test_the_exported_config_records_the_trained_length_with_the_same_rope(rope):
    """A 1K model trained at 4K: the export says max_position_embeddings 4096 and computes the same RoPE."""
    trained = build_config(config=dict(model_type="qwen2", **SMALL), rope_parameters=rope)
    exported = trained_config(trained, 4096)
    assert exported.max_position_embeddings == 4096 and trained.max_position_embeddings == 1024
    (freq_a, scale_a), (freq_b, scale_b) = _rope(trained), _rope(exported)
    assert torch.equal(freq_a, freq_b) and scale_a == scale_b
    assert trained_config(trained, 512).max_position_embeddings == 1024  # never shrinks


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_depth_scaled_init_redraws_only_the_residual_output_projections(model_type):
    config = dict(model_type=model_type, **SMALL)
    torch.manual_seed(0)
    hf = dict(build_model(config=config).named_parameters())
    torch.manual_seed(0)
    scaled = dict(build_model(config=config, init="depth_scaled").named_parameters())
    std = 0.02 / (2 * SMALL["num_hidden_layers"]) ** 0.5
    redrawn = [n for n in hf if n.endswith(("o_proj.weight", "down_proj.weight"))]
    assert len(redrawn) == 2 * SMALL["num_hidden_layers"]
    for name, param in scaled.items():
        if name in redrawn:
            assert param.std().item() == pytest.approx(std, rel=0.15), name  # hf draws them with std 0.02
            assert hf[name].std().item() == pytest.approx(0.02, rel=0.15), name
        else:
            assert torch.equal(param, hf[name]), name


def test_depth_scaled_init_refuses_a_model_with_trained_weights(tmp_path):
    build_model(config=dict(model_type="qwen2", **SMALL)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="keeps its trained ones"):
        build_model(path=tmp_path, init="depth_scaled")


@pytest.mark.parametrize(
    "damage, expected",
    [("truncated", "Error while deserializing header"), ("other config", "do not fit")],
)
def test_a_model_folder_whose_weights_cannot_load_is_refused_by_name(tmp_path, damage, expected):
    """A copy cut short or a config.json of another model: a ValueError naming the folder, not the loader's
    traceback."""
    build_model(config=dict(model_type="qwen2", **SMALL)).save_pretrained(tmp_path)
    if damage == "truncated":
        weights = tmp_path / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    else:
        build_config(config=dict(model_type="qwen2", **SMALL | dict(hidden_size=48))).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"{tmp_path}.*cannot be loaded.*{expected}"):
        build_model(path=tmp_path)

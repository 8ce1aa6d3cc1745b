"""Build or load Hugging Face causal LMs that run mtraining attention, and export them back.

No network: a model comes from a local directory (config.json + *.safetensors) or from an
architecture config with random weights. Weights are kept in float32 (the master copy); the
trainer decides the compute dtype.
"""

from __future__ import annotations

import copy
import math
import shutil
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError
from torch import nn

from .adapter import ATTN_IMPLEMENTATION, register

SUPPORTED_TYPES = ("qwen2", "qwen3", "llama", "mistral")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


# Constructor arguments that HF configs translate into rope_parameters (older config.json spellings).
_ROPE_ALIASES = ("rope_theta", "rope_scaling", "partial_rotary_factor")
# Fields from which Qwen2/Qwen3 configs derive layer_types (which layers use a sliding window).
_WINDOW_FIELDS = {"use_sliding_window", "sliding_window", "max_window_layers"}
# RoPE types whose frequencies depend on the pre-training length (kept explicit when the length grows).
_SCALED_ROPE = ("yarn", "longrope", "llama3")
# The projections that close each residual branch (attention, MLP), as every supported type names them.
RESIDUAL_OUTPUTS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
Init = Literal["hf", "depth_scaled"]


# HF config fields that must be positive integers / positive finite numbers when given
_POSITIVE_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
_POSITIVE_FLOAT_FIELDS = ("rope_theta", "rms_norm_eps")


def check_hf_fields(config: dict[str, Any], where: str) -> None:
    """Impossible numbers in HF config fields fail here, not deep inside transformers; ``where`` prefixes each
    field's name in the message (``model.config.``, or a config.json file's ``PATH: ``)."""
    for key in _POSITIVE_INT_FIELDS:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{where}{key} must be a positive integer, got {value!r}")
    for key in _POSITIVE_FLOAT_FIELDS:
        value = config.get(key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
        if value is not None and not ok:
            raise ValueError(f"{where}{key} must be a finite number > 0, got {value!r}")
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise ValueError(f"{where}num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})")


def build_config(
    path: str | Path | None = None,
    config: dict[str, Any] | None = None,
    rope_theta: float | None = None,
    rope_parameters: dict[str, Any] | None = None,
    overrides: dict[str, Any] | None = None,
):
    """The HF config from a local directory or a dict with ``model_type``, with ``overrides`` (HF config
    fields, given to the config's constructor so derived fields follow) and RoPE changes applied."""
    from transformers import CONFIG_MAPPING, PretrainedConfig

    if (path is None) == (config is None):
        raise ValueError("pass exactly one of path (a local HF directory) or config (a dict with model_type)")
    if path is not None:
        path = Path(path)
        refuse_gguf(path, "model.path")
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is not a Hugging Face model directory: it has no config.json")
        try:
            fields = PretrainedConfig.get_config_dict(path, local_files_only=True)[0]
        except (OSError, ValueError) as err:
            fields = f"unreadable ({err})"
        if not isinstance(fields, dict):
            raise ValueError(
                f"{path / 'config.json'} is not a Hugging Face config (a JSON object): {fields}; restore the file "
                "from the model's source, or re-export the model"
            )
        check_hf_fields(fields, f"{path / 'config.json'}: ")
    else:
        fields = dict(config)
    model_type = fields.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; use one of {SUPPORTED_TYPES}")
    overrides = dict(overrides or {})
    _check_overrides(model_type, overrides)
    if set(overrides) & _WINDOW_FIELDS and "layer_types" not in overrides:
        fields.pop("layer_types", None)  # derived again from the overridden window settings
    rope_changes = _rope_changes(overrides)
    try:
        hf_config = CONFIG_MAPPING[model_type].from_dict({**fields, **overrides})
    except Exception as err:  # transformers' field validation (its own error types): a bad value in the fields
        where = path / "config.json" if path is not None else "model.config"
        raise ValueError(f"{where} (with model.overrides) does not make a {model_type} config: {err}") from None
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope.update(rope_changes)
    rope.update(rope_parameters or {})
    if rope_theta is not None:
        rope["rope_theta"] = float(rope_theta)
    if rope:
        hf_config.rope_parameters = rope
    return hf_config


def _rope_changes(overrides: dict[str, Any]) -> dict[str, Any]:
    """Take the RoPE fields out of ``overrides`` as rope_parameters entries (config.json values would win
    over constructor arguments)."""
    changes: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        scaling = dict(overrides.pop(key, None) or {})
        if "type" in scaling:  # the older spelling of rope_type
            scaling["rope_type"] = scaling.pop("type")
        changes.update(scaling)
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in overrides:
            changes[key] = overrides.pop(key)
    return changes


def _check_overrides(model_type: str | None, overrides: dict[str, Any]) -> None:
    """ValueError naming the known fields when an override is not a field of this model type's config."""
    from transformers import AutoConfig

    if not overrides:
        return
    known = set(AutoConfig.for_model(model_type).to_dict()) | set(_ROPE_ALIASES)
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(
            f"model.overrides: {unknown} are not fields of a {model_type} config; known fields: {sorted(known)}"
        )


def head_dim(hf_config) -> int:
    """Attention head size of a HF config (explicit head_dim, else hidden_size / heads)."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def refuse_gguf(path: str | Path, where: str) -> None:
    """ValueError naming ``mtraining convert`` when ``path`` is a GGUF file, or a folder of GGUF files without
    config.json: the trainer and eval load Hugging Face folders, converted once."""
    path = Path(path)
    found = [path] if path.suffix == ".gguf" else []
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob("*.gguf"))
    if found:
        raise ValueError(
            f"{where} {found[0]} is a GGUF file; convert it once with `mtraining convert {found[0]} OUT_DIR` "
            "and point at OUT_DIR (a Hugging Face folder)"
        )


def sliding_window_layers(hf_config) -> list[int]:
    """Layers that would run sliding-window attention (mtraining attention is causal over the whole sequence)."""
    types = getattr(hf_config, "layer_types", None)
    if types is not None:
        return [i for i, t in enumerate(types) if t == "sliding_attention"]
    if getattr(hf_config, "sliding_window", None) is not None:  # Mistral: every layer
        return list(range(hf_config.num_hidden_layers))
    return []


def trained_config(hf_config, seq_len: int):
    """A copy of ``hf_config`` that records training at ``seq_len`` tokens, for export.

    max_position_embeddings becomes at least ``seq_len``; RoPE types whose frequencies depend on the
    pre-training length (YaRN, LongRoPE, Llama 3) keep that length and their factor explicit in
    rope_parameters, so the exported model computes the RoPE it was trained with.
    """
    out = copy.deepcopy(hf_config)
    before = hf_config.max_position_embeddings
    rope = dict(getattr(out, "rope_parameters", None) or {})
    if rope.get("rope_type") in _SCALED_ROPE:
        original = rope.setdefault("original_max_position_embeddings", before)
        if rope.get("factor") is None:
            rope["factor"] = before / original
        out.rope_parameters = rope
    out.max_position_embeddings = max(before, seq_len)
    return out


def build_model(
    path: str | Path | None = None,
    config: dict[str, Any] | None = None,
    rope_theta: float | None = None,
    rope_parameters: dict[str, Any] | None = None,
    attn_implementation: str = ATTN_IMPLEMENTATION,
    overrides: dict[str, Any] | None = None,
    init: Init = "hf",
) -> nn.Module:
    """A float32 ``*ForCausalLM``: weights from ``path`` (local safetensors) or random from ``config``.

    Random init follows the current torch RNG: seed it first for reproducible weights. ``init`` (random
    weights only): ``hf`` draws them as transformers does; ``depth_scaled`` then redraws the residual
    branches' output projections (see ``depth_scaled_init``).
    """
    from transformers import AutoModelForCausalLM

    register()
    hf_config = build_config(path, config, rope_theta, rope_parameters, overrides)
    if path is not None:
        if init != "hf":
            raise ValueError(f"init={init!r} draws random weights; a model loaded from {path} keeps its trained ones")
        check_weights(path)
        try:
            return AutoModelForCausalLM.from_pretrained(
                path,
                config=hf_config,
                attn_implementation=attn_implementation,
                dtype=torch.float32,
                local_files_only=True,
            )
        except (OSError, RuntimeError, SafetensorError) as err:  # a cut file; weights of another config
            detail = str(err).splitlines()[0] if str(err) else type(err).__name__
            if "ignore_mismatched_sizes" in detail:  # transformers logs the table of shapes above
                detail = "its weights' shapes do not fit its config.json (the table above lists them)"
            raise ValueError(
                f"the weights in {path} cannot be loaded ({detail}); copy the folder again, or export it again "
                "with `mtraining export`"
            ) from None
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn_implementation, dtype=torch.float32)
    if init == "depth_scaled":
        depth_scaled_init(model)
    return model


def depth_scaled_init(model: nn.Module) -> None:
    """Redraw every attention ``o_proj`` and MLP ``down_proj`` from N(0, initializer_range / sqrt(2 x layers)).

    GPT-2, Megatron-LM and torchtitan scale these projections so that the residual stream starts as the
    token embedding rather than the sum of 2 x layers random branches. Hugging Face's init does not, and
    deep or wide models trained from scratch then wait far longer before forming induction heads (copying
    from context, which retrieval needs).
    """
    c = model.config
    std = c.initializer_range / math.sqrt(2 * c.num_hidden_layers)
    redrawn = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(RESIDUAL_OUTPUTS):
                param.normal_(0.0, std)
                redrawn += 1
    if redrawn != 2 * c.num_hidden_layers:
        raise ValueError(f"depth_scaled init found {redrawn} of {2 * c.num_hidden_layers} residual output projections")


def check_weights(path: str | Path) -> None:
    """ValueError unless the model folder holds safetensors weights."""
    if not any(Path(path).glob("*.safetensors")):
        raise ValueError(f"{path} has no *.safetensors weights; export or convert the model to safetensors")


def export_hf(
    state_dict: dict[str, torch.Tensor],
    hf_config,
    out_dir: str | Path,
    tokenizer: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``state_dict`` (full, unsharded) and ``hf_config`` as a HF directory loadable by from_pretrained.

    ``tokenizer`` (a tokenizer.json file, or a HF directory holding tokenizer files) is copied along.
    """
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in state_dict.items()}, strict=True, assign=True)
    model.tie_weights()
    model.config._attn_implementation = "sdpa"
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer = Path(tokenizer)
        files = [tokenizer] if tokenizer.is_file() else [tokenizer / n for n in _TOKENIZER_FILES]
        for file in files:
            if file.is_file():
                shutil.copyfile(file, out_dir / file.name)
    return out_dir

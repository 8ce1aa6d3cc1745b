"""Checks that need no ranks, run once before they start, and the model checks every rank repeats.

``mtraining train --nproc N`` runs ``preflight`` in the launcher: data paths and formats, the
tokenizer, text tokenised into the cache (so the ranks only memory-map it), the output folders, the
model folder and config (overrides, vocabulary, sliding windows), the world and ring shape, optional
packages. A mistake is one message before any rank starts. Runs started by torchrun directly get the
same checks inside the trainer, reported once by rank 0 (agree.py).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from ..models.loader import build_config, check_weights, sliding_window_layers
from .config import Config
from .data import Source, check_vocabulary, document_separator, load_sources
from .outputs import check_output_dirs
from .packing import PackedStream
from .ring_choice import choose_ring


def check_model(cfg: Config, hf_config, sources: list[Source]) -> None:
    """ValueError naming the fix when the model cannot train on this data with mtraining attention."""
    where = cfg.model.path or "model.config"
    check_vocabulary(sources, hf_config.vocab_size, cfg.data.token_dtype)
    layers = sliding_window_layers(hf_config)
    if layers:
        raise ValueError(
            f"{where} uses sliding-window attention (window {hf_config.sliding_window}) in layers {layers}, which "
            "mtraining attention does not run (it attends causally over the whole sequence); train with full "
            "attention: model.overrides: {use_sliding_window: false} for Qwen2/Qwen3, {sliding_window: null} for Mistral"
        )
    if getattr(hf_config, "attention_dropout", 0.0):
        raise ValueError(
            f"{where} sets attention_dropout={hf_config.attention_dropout}, which mtraining attention does not "
            "support; set model.overrides: {attention_dropout: 0.0}"
        )


def rope_warning(cfg: Config, hf_config) -> str | None:
    """A warning when data.seq_len exceeds the model's trained positions and the config leaves RoPE as it is."""
    trained = getattr(hf_config, "max_position_embeddings", None)
    if trained is None or cfg.data.seq_len <= trained or cfg.model.changes_rope:
        return None
    return (
        f"warning: data.seq_len ({cfg.data.seq_len}) exceeds the model's max_position_embeddings ({trained}) and the "
        "config leaves RoPE unchanged, so positions beyond it are extrapolated; for context extension raise the "
        "RoPE base (model.rope_theta) or set a RoPE scaling (model.rope_parameters, e.g. {rope_type: yarn, factor: 4})"
    )


def check_sources(cfg: Config, sources: list[Source]) -> None:
    """ValueError unless every source holds at least one sample of data.seq_len + 1 tokens."""
    for source in sources:
        PackedStream(source.stream, cfg.data.seq_len, f"data source {source.name!r}")


def preflight(cfg: Config, world_size: int, local_world_size: int, log: Callable[[str], None] = print) -> list[str]:
    """Every check possible before the ranks start (raises ValueError naming the fix); returns warnings."""
    cfg.check_world_size(world_size)
    check_output_dirs(cfg)
    if cfg.log.wandb is not None and importlib.util.find_spec("wandb") is None:
        raise ValueError('log.wandb needs the wandb package: pip install -e ".[wandb]" (or remove log.wandb)')
    sources = load_sources(cfg, tokenize=True, log=log)
    check_sources(cfg, sources)
    hf_config = build_config(**cfg.model.hf_kwargs())
    choose_ring(cfg, local_world_size, hf_config)  # the ring's shape fits the world
    if cfg.model.path is not None:
        check_weights(cfg.model.path)
    check_model(cfg, hf_config, sources)
    document_separator(cfg)
    return [w for w in (rope_warning(cfg, hf_config),) if w]

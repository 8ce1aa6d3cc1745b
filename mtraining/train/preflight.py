"""What runs once before the ranks start, and the model checks every rank repeats.

``mtraining train --nproc N`` runs ``preflight`` in the launcher: every check of ``check.check_run``
(config as launched, output folders, packages, model folder and weights' shapes, tokenizer, data,
resume against the newest checkpoint, disk) reported together, then the text tokenised into the cache
(so the ranks only memory-map it) and each source checked to hold a sample. A mistake is one message
before any rank starts. Runs started by torchrun directly get the same checks inside the trainer,
reported once by rank 0 (agree.py).
"""

from __future__ import annotations

from collections.abc import Callable

from ..models.loader import sliding_window_layers
from .check import Launch, check_run
from .config import Config
from .data import Source, check_vocabulary, document_separator, load_sources
from .outputs import check_output_dirs
from .packing import PackedStream


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


def check_before_ranks(cfg: Config, launch: Launch):
    """``check_run``: ValueError listing every problem; else (the warnings to print, the model's HF config)."""
    report, found = check_run(cfg, launch)
    report.raise_problems()
    rope = rope_warning(cfg, found.hf_config)
    return [f"warning: {w}" for w in report.warnings] + ([rope] if rope else []), found.hf_config


def preflight(cfg: Config, world_size: int, local_world_size: int, log: Callable[[str], None] = print) -> list[str]:
    """Every check possible before the ranks start, then the text tokenised (raises ValueError naming the fix);
    returns warnings."""
    warnings, hf_config = check_before_ranks(cfg, Launch(local_world_size, world_size // local_world_size))
    check_output_dirs(cfg)  # created here, before the ranks start
    sources = load_sources(cfg, tokenize=True, log=log)
    check_sources(cfg, sources)
    check_model(cfg, hf_config, sources)
    document_separator(cfg)
    return warnings

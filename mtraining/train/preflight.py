"""What runs once before the ranks start, and the RoPE and data checks every rank repeats (the model's:
``check.check_model``).

``mtraining train --nproc N`` runs ``preflight`` in the launcher: every check of ``check.check_run``
(config as launched, output folders, packages, model folder and weights' shapes, tokenizer, data,
resume against the newest checkpoint, disk) reported together, then the text tokenised into the cache
(so the ranks only memory-map it) and each source checked to hold a sample. A mistake is one message
before any rank starts. Runs started by torchrun directly get the same checks inside the trainer,
reported once by rank 0 (agree.py).
"""

from __future__ import annotations

from collections.abc import Callable

from .check import Launch, check_model, check_run
from .config import Config
from .data import Source, document_separator, load_sources
from .outputs import check_output_dirs
from .packing import PackedStream


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

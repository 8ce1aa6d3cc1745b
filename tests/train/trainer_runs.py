"""The trainer's tiny test run, shared by the trainer's tests: a Qwen2 config, budgets, a config builder, one run.

A tiny Qwen2 on the shipped corpus (the tokenizer's 512 ids), 128-token sequences, float32.
"""

from __future__ import annotations

from pathlib import Path

from mtraining.train.config import Config, parse_config

DATA = Path(__file__).resolve().parents[2] / "data"
RAW = {
    "model": {
        "config": {
            "model_type": "qwen2",
            "vocab_size": 512,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 1024,
            "tie_word_embeddings": True,
        },
        "dtype": "float32",
    },
    "attention": {"layout": "striped", "block_size": 16, "backend": "torch", "last_q": 16, "local_window": 16},
    "data": {"sources": [str(DATA / "tiny_corpus.jsonl")], "tokenizer": str(DATA / "tokenizer.json"), "seq_len": 128},
    "train": {"steps": 4, "seed": 0, "loss_chunk_tokens": 96, "device": "cpu"},
    "optim": {"lr": 1e-2, "warmup_steps": 1},
    "log": {"progress": False, "every": 1},
}
FULL_BUDGET = ["attention.v_size=128", "attention.s_size=128"]
SMALL_BUDGET = ["attention.v_size=16", "attention.s_size=32"]


def make_config(*overrides: str) -> Config:
    """``RAW`` with dotted ``key=value`` overrides."""
    return parse_config(RAW, list(overrides))


def run_trainer(cfg: Config) -> list[dict]:
    """Train ``cfg`` on this rank; the metrics of every logged step."""
    from mtraining.train.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        return trainer.run()
    finally:
        trainer.close()

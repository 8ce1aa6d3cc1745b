"""mtraining: distributed dynamic sparse attention for ultra-long-context LLM training."""

__version__ = "0.1.0"

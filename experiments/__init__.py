"""Experiments built on mtraining's public API (experiments/README.md). The core never imports them."""

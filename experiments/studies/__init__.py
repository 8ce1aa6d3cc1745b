"""Measurement studies that time nothing, one module each (``python -m experiments.studies.<name>``):

- ``imbalance``: the exact (q, k) pairs per rank and ring step of a pattern under a layout (a module: used by
  ``layout_balance``, bench/packed_documents.py and bench/ring_attention.py);
- ``layout_balance``: each context-parallel layout's per-rank balance for an estimated pattern;
- ``cost_model``: the ring cost model against measured ring times, and on larger clusters (bench/ring_attention.py
  annotates its records with it);
- ``column_candidates``: how many pairs the sorted column scorer walks, on a model's Q/K or synthetic ones;
- ``gguf_convert``: a GGUF checkpoint converted by ``mtraining convert`` against transformers reading it.

Results are written to bench/results/; their reports are in bench/reports/.
"""

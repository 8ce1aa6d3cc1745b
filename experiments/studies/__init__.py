"""Measurement studies, one module each (``python -m experiments.studies.<name>``). Each answers one design
question (how balanced a layout is, what a safety check costs, how far a conversion is exact); the speed of
attention, rings and training steps is timed in bench/.

- ``layout_balance``: each context-parallel layout's per-rank balance for an estimated pattern (counted by
  bench/imbalance.py);
- ``cost_model``: the ring cost model against measured ring times (each record's prediction:
  bench/ring_prediction.py), the trainer's ring choice against them, and the model on larger clusters;
- ``column_candidates``: how many pairs the sorted column scorer walks, on a model's Q/K or synthetic ones;
- ``gguf_convert``: a GGUF checkpoint converted by ``mtraining convert`` against transformers reading it;
- ``checkpoint_integrity``: what the checkpoint manifest (SHA-256 of every file) costs at save and resume;
- ``agreement_check``: what the rings' per-call agreement check costs;
- ``eval_cost``: what one NIAH prompt costs the evaluation (building, prefill, dense decoding).

Results are written to bench/results/; their reports are in bench/reports/.
"""

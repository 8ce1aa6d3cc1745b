"""Evaluation: long-document perplexity by position, needle-in-a-haystack, RULER-style tasks, reports.

One job per module:

- ``documents``: local text / JSONL / parquet documents and the built-in filler text;
- ``tasks``: seeded generators of NIAH and RULER-style samples fitted to a token budget;
- ``scoring``: scoring of predictions against the generated answers;
- ``answers``: greedy answers to generated prompts, scored per cell of a grid (NIAH, RULER);
- ``loading``: checkpoint + tokenizer loading and the up-front checks (RoPE range, memory);
- ``engine``: the forward passes (per-token loss, prefill + greedy answer), single process or
  context parallel through the same ring attention as training;
- ``ppl``, ``niah``, ``ruler``: the three evaluations; ``report`` and ``plots``: comparison output;
- ``options``: the model, attention and output options every command takes, declared once;
- ``cli``: the ``mtraining eval`` typer sub-app.
"""

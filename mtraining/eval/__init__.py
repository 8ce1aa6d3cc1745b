"""Evaluation: long-document perplexity by position, needle-in-a-haystack, RULER-style tasks, InfiniteBench, reports.

One job per module:

- ``documents``: local text / JSONL / parquet documents and the built-in filler text;
- ``tasks``: seeded generators of NIAH and RULER-style samples fitted to a token budget;
- ``infinitebench``: InfiniteBench's passkey, number string, key-value and Math.Find tasks (generated,
  or rendered from official records) and their evaluation;
- ``datafiles``: the benchmarks' own files (InfiniteBench and RULER JSONL) as samples placed by length;
- ``scoring``: scoring of predictions against expected answers (ours and the benchmarks' official rules);
- ``answers``: greedy answers to prompts, scored per cell of a grid (NIAH, RULER, InfiniteBench);
- ``loading``: checkpoint + tokenizer loading and the up-front checks (RoPE range, memory);
- ``engine``: the forward passes (per-token loss, prefill + greedy answer), single process or
  context parallel through the same ring attention as training;
- ``ppl``, ``niah``, ``ruler``: the three other evaluations; ``report`` and ``plots``: comparison output;
- ``options``: the model, attention and output options every command takes, declared once;
- ``cli``: the ``mtraining eval`` typer sub-app.
"""

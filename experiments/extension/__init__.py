"""The context-extension experiment: does dynamic sparse training keep accuracy? (``python -m experiments.extension``)

- ``pipeline``: the five resumable stages (corpus, base, extend, eval, report); ``__main__`` runs it;
- ``settings``: the scales, curricula, budgets and evaluation settings;
- ``recall_corpus`` (CPU scale: word-level associative recall) and ``text_corpus`` (GPU scale: the eval's
  NIAH/RULER formats): the generated corpora, made while the GPU trains (``experiments.common.background``);
- ``evaluation``: every model at every length through ``mtraining.eval``; ``report``: statistics, plots, Markdown;
- follow-up studies, each a ``python -m experiments.extension.<name>`` command: ``replicates``, ``density``,
  ``losses``, ``base_search``, ``induction_init``, ``answer_positions``, ``query_position``, ``local_verticals``,
  ``packed_recall``.

Results are written to bench/results/ (``extension_<scale>*.json``, ``.md``, PNGs).
"""

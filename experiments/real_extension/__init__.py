"""Fast and accurate at once on a real model (issue 31): ``python -m experiments.real_extension``.

A pretrained GGUF model is extended 8x with YaRN on real long documents, dense and sparse arms on the same data
and seeds; every model is read with NIAH, RULER-style tasks and perplexity (the whole prompt through the attention
under test), and the sparse arms are timed on the extended model's own Q/K. Modules:

- ``cli``: the command line (``__main__`` runs it); ``pipeline``: the resumable stages of one machine's part;
- ``settings``: the arms, the RoPE scaling, the presets (gpu, toy), the calibration table of measured GPU times;
  ``costs``: each stage's expected time (measured here, else calibrated, else FLOPs);
- ``parallel``: ``--parallel-gpus``, the seeds spread over the GPUs of one machine; ``session``: ``--plan``'s calls;
- ``evaluation``: one read of one model at every length, and the prompts built in the background;
- ``speed``: Q/K/V dumped from the model, each arm timed against dense attention;
- ``report``: result folders of several machines pooled by seed, intervals over seeds, Markdown and one picture;
  ``recipes``: the dense models of a recipe screen (``--variants``) side by side, unpaired.

Results: ``real_extension.json``, ``.md`` and ``.png`` in bench/results/ (``--report-from``).
"""

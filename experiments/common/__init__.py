"""What every experiment's driver needs, kept once: ``stages`` (the log, atomic JSON writes, the stage clock and
its --max-minutes deadline, the refusals), ``training`` (``mtraining train`` as a resumable subprocess stopped at
the deadline, and its metrics) and ``background`` (CPU work on the spare cores while the GPU trains)."""

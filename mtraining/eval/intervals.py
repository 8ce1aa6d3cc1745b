"""95% intervals over the prompts (or documents) of one evaluation cell.

``wilson_interval`` for a proportion of right/wrong answers; ``score_interval`` picks it when every score is 0
or 1 and otherwise resamples the prompts (scores such as the fraction of several expected answers found);
``mean_of_means_interval`` resamples the prompts of several groups at once (a RULER-style average over tasks);
``mean_interval`` resamples values in their own units (per-document losses).
Resampling is seeded, so a result file is reproducible. Intervals over training seeds are in ``seeds``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

RESAMPLES = 2000


def wilson_interval(hits: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion, in percent (z = 1.96: 95%)."""
    if total <= 0:
        return (math.nan, math.nan)
    p = hits / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    if hits == total:  # centre + half is 1 in exact arithmetic; keep the bound from rounding below the estimate
        return (100 * (centre - half), 100.0)
    if hits == 0:
        return (0.0, 100 * (centre + half))
    return (100 * max(0.0, centre - half), 100 * min(1.0, centre + half))


def _bootstrap(groups: Sequence[Sequence[float]], seed: int) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of the mean over ``groups`` (non-empty) of each group's mean, every
    group's values resampled with replacement."""
    rng = random.Random(seed)
    means = sorted(sum(sum(rng.choices(g, k=len(g))) / len(g) for g in groups) / len(groups) for _ in range(RESAMPLES))
    return (means[int(0.025 * RESAMPLES)], means[int(0.975 * RESAMPLES) - 1])


def mean_interval(values: Sequence[float], seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of the mean of ``values`` (e.g. per-document losses), in their units;
    (nan, nan) for fewer than two values."""
    if len(values) < 2:
        return (math.nan, math.nan)
    return _bootstrap([list(values)], seed)


def mean_of_means_interval(groups: Sequence[Sequence[float]], seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap 95% interval (in percent) of the mean over groups of each group's mean score (0..1),
    each group's prompts resampled with replacement; (nan, nan) when no group has a score."""
    groups = [list(g) for g in groups if len(g)]
    if not groups:
        return (math.nan, math.nan)
    lo, hi = _bootstrap(groups, seed)
    return (100 * lo, 100 * hi)


def score_interval(scores: Sequence[float], seed: int = 0) -> tuple[float, float]:
    """95% interval (in percent) of the mean of 0..1 scores: Wilson when every score is 0 or 1, else the
    percentile bootstrap over the scores; (nan, nan) without scores."""
    if all(s in (0, 1) for s in scores):
        return wilson_interval(int(sum(scores)), len(scores))
    return mean_of_means_interval([scores], seed)

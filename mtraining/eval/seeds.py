"""Intervals over training seeds: is a sparse-trained model's change against its dense twin within a bound?

Each seed trains a dense and a sparse model on the same data; per cell (a length, a reading) the seed gives one
paired difference, sparse minus dense: the perplexity change in percent, the NIAH or RULER-style change in
points. Over n seeds the differences' mean has the Student t interval mean +- t(n - 1) * sd / sqrt(n). Prompts
are not the unit here (their intervals are in ``intervals``): two seeds can only span their own two means, so
pooling prompts over seeds understates how much another seed would move the result.

``seed_interval`` gives the two-sided interval and the one-sided bounds at the same confidence; ``change_bounds``
names the bounds the accuracy goal reads: ``ppl_change_hi`` (upper bound of the perplexity change, percent),
``niah_change_lo`` and ``ruler_change_lo`` (lower bounds, points). The t quantile is computed here (A&S 26.7.3-4:
the t distribution of integer degrees of freedom in closed form, inverted by bisection), so nothing beyond the
standard library is needed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

MIN_SEEDS = 3  # below this a result says so (``SeedInterval.enough``)


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with ``df`` (a positive int) degrees of freedom."""
    if not isinstance(df, int) or isinstance(df, bool) or df < 1:
        raise ValueError(f"degrees of freedom must be a positive int, got {df!r}")
    theta = math.atan(abs(t) / math.sqrt(df))
    c, s = math.cos(theta), math.sin(theta)
    if df % 2:  # odd: (2 / pi) (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...)), df - 3 terms after 1
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= c * c * (2 * k) / (2 * k + 1)
            total += term
        inside = 2 / math.pi * (theta + s * c * total)
    else:  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...), up to cos^(df - 2)
        term, total = 1.0, 1.0
        for k in range(1, df // 2):
            term *= c * c * (2 * k - 1) / (2 * k)
            total += term
        inside = s * total
    return 0.5 + math.copysign(inside, t) / 2


def t_quantile(p: float, df: int) -> float:
    """The t with P(T <= t) = p (0 < p < 1), by bisection on ``t_cdf`` to float precision."""
    if not 0 < p < 1:
        raise ValueError(f"p must lie in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class SeedInterval:
    """The mean of per-seed paired differences and its t intervals.

    Attributes:
        n: seeds; mean, sd: the differences' mean and sample standard deviation.
        low, high: the two-sided interval at ``confidence``.
        lower_bound, upper_bound: the one-sided bounds at ``confidence`` (mean -+ t(confidence) * sd / sqrt(n)).
        enough: n >= MIN_SEEDS.
    """

    n: int
    mean: float
    sd: float
    confidence: float
    low: float
    high: float
    lower_bound: float
    upper_bound: float
    enough: bool


def seed_interval(differences: Sequence[float], confidence: float = 0.95) -> SeedInterval:
    """The t interval over seeds of ``differences`` (one paired sparse - dense difference per seed); ValueError
    for fewer than two seeds (no spread to read) or non-finite differences."""
    values = [float(d) for d in differences]
    if len(values) < 2:
        raise ValueError(
            f"an interval over seeds needs at least 2 seeds (3 or more to mean much), got {len(values)}: "
            "train and evaluate more seeds of each arm"
        )
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"the per-seed differences must be finite numbers, got {values}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    se = sd / math.sqrt(n)
    two = t_quantile(1 - (1 - confidence) / 2, n - 1) * se
    one = t_quantile(confidence, n - 1) * se
    return SeedInterval(n, mean, sd, confidence, mean - two, mean + two, mean - one, mean + one, n >= MIN_SEEDS)


def change_bounds(
    ppl_change_pct: Sequence[float],
    niah_change: Sequence[float],
    ruler_change: Sequence[float],
    confidence: float = 0.95,
) -> dict:
    """One cell's record of per-seed changes (sparse - dense): perplexity in percent, NIAH and RULER-style in
    points. ``ppl_change_pct``, ``niah_change``, ``ruler_change``: the mean changes; ``ppl_change_hi``: the
    upper one-sided bound of the perplexity change; ``niah_change_lo``, ``ruler_change_lo``: the lower one-sided
    bounds; ``seeds`` and each interval in full under ``intervals``."""
    named = {"ppl": ppl_change_pct, "niah": niah_change, "ruler": ruler_change}
    counts = {name: len(values) for name, values in named.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"every metric needs one difference per seed, got {counts}")
    found = {name: seed_interval(values, confidence) for name, values in named.items()}
    return {
        "seeds": found["ppl"].n,
        "ppl_change_pct": found["ppl"].mean,
        "ppl_change_hi": found["ppl"].upper_bound,
        "niah_change": found["niah"].mean,
        "niah_change_lo": found["niah"].lower_bound,
        "ruler_change": found["ruler"].mean,
        "ruler_change_lo": found["ruler"].lower_bound,
        "intervals": {name: asdict(interval) for name, interval in found.items()},
    }


def ppl_change_pct(sparse_ppl: float, dense_ppl: float) -> float:
    """The perplexity change of a sparse model against its dense twin, in percent of the dense one."""
    if not dense_ppl > 0 or not sparse_ppl > 0:
        raise ValueError(f"perplexities must be positive, got sparse {sparse_ppl} and dense {dense_ppl}")
    return 100.0 * (sparse_ppl / dense_ppl - 1.0)

"""Intervals over seeds (mtraining.eval.seeds) against scipy's t distribution and hand-computed values."""

from __future__ import annotations

import math

import pytest
from scipy import stats  # a test dependency (the test extra)

from mtraining.eval.seeds import change_bounds, ppl_change_pct, seed_interval, t_cdf, t_quantile


@pytest.mark.parametrize("df", [1, 2, 3, 4, 5, 7, 10, 29, 60])
def test_t_distribution_matches_scipy(df):
    for t in (-7.5, -2.0, -0.3, 0.0, 0.4, 1.0, 2.5, 12.0):
        assert t_cdf(t, df) == pytest.approx(stats.t.cdf(t, df), abs=1e-12)
    for p in (0.025, 0.05, 0.5, 0.9, 0.95, 0.975, 0.995):
        assert t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-9, abs=1e-12)


def test_interval_over_seeds_matches_scipy_and_a_hand_value():
    diffs = [0.59, 0.26, 0.38]
    got = seed_interval(diffs)
    mean, sem = sum(diffs) / 3, stats.sem(diffs)
    low, high = stats.t.interval(0.95, 2, loc=mean, scale=sem)
    assert (got.low, got.high) == (pytest.approx(low, rel=1e-9), pytest.approx(high, rel=1e-9))
    assert got.upper_bound == pytest.approx(mean + stats.t.ppf(0.95, 2) * sem, rel=1e-9)
    assert got.lower_bound == pytest.approx(mean - stats.t.ppf(0.95, 2) * sem, rel=1e-9)
    # by hand: mean 0.41, sd 0.16703..., t(0.975, 2) = 4.302653: half-width 0.41494
    assert got.mean == pytest.approx(0.41) and got.sd == pytest.approx(math.sqrt(0.0279), rel=1e-9)
    assert got.high - got.mean == pytest.approx(4.302653 * math.sqrt(0.0279 / 3), rel=1e-6) and got.enough
    # the two runs +0.12 and +0.42: a t-interval over them is far wider than their span
    two = seed_interval([0.12, 0.42])
    assert not two.enough and two.low < -1.5 and two.high > 2.0


def test_fewer_than_two_seeds_are_refused():
    for bad in ([], [0.3]):
        with pytest.raises(ValueError, match="at least 2 seeds"):
            seed_interval(bad)
    with pytest.raises(ValueError, match="finite"):
        seed_interval([0.1, math.nan])


def test_change_bounds_name_the_goal_bounds():
    cell = change_bounds([0.5, 0.2, 0.4], [-1.0, 2.0, 0.5], [1.0, -0.5, 0.0])
    assert cell["seeds"] == 3
    assert cell["ppl_change_hi"] == pytest.approx(seed_interval([0.5, 0.2, 0.4]).upper_bound)
    assert cell["niah_change_lo"] == pytest.approx(seed_interval([-1.0, 2.0, 0.5]).lower_bound)
    assert cell["ruler_change_lo"] < cell["ruler_change"] < cell["intervals"]["ruler"]["high"]
    with pytest.raises(ValueError, match="one difference per seed"):
        change_bounds([0.5, 0.2, 0.4], [1.0, 2.0], [1.0, 2.0, 3.0])
    assert ppl_change_pct(10.1, 10.0) == pytest.approx(1.0)

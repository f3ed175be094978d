"""bench.paired: the benchmark's statistics rule on differences computed here by hand."""

from __future__ import annotations

import math

import pytest

from bench.paired import paired, t_quantile, verdict


def test_t_quantiles_match_the_printed_table():
    # two-sided 95 % points of Student's t (any statistics table): df 1, 2, 4, 9
    for df, printed in ((1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262)):
        assert t_quantile(df) == pytest.approx(printed, abs=5e-4)
    assert t_quantile(4, 0.90) == pytest.approx(2.132, abs=5e-4)
    with pytest.raises(ValueError, match="integer >= 1"):
        t_quantile(0)


def test_five_seeds_ahead_beat_and_lie_within_three_points():
    # a - b per seed: 2.0, 1.0, 3.0, 2.5, 1.5 -> mean 2.0; deviations 0, -1, 1, 0.5, -0.5, squares sum 2.5;
    # s^2 = 2.5 / 4 = 0.625, s = 0.7906; s / sqrt(5) = 0.35355; t(4) = 2.7764 -> half width 0.9816:
    # interval [1.018, 2.982]: above 0 (a beats b), inside +-3, not inside +-2.
    a = {0: 82.0, 1: 81.0, 2: 83.0, 3: 82.5, 4: 81.5}
    b = {s: 80.0 for s in range(5)}
    p = paired(a, b)
    assert p.seeds == (0, 1, 2, 3, 4) and p.n == 5 and p.signs == "+++++"
    assert p.mean == pytest.approx(2.0) and p.interval is not None
    lo, hi = p.interval
    half = 2.776445 * math.sqrt(0.625) / math.sqrt(5)
    assert (lo, hi) == pytest.approx((2.0 - half, 2.0 + half))
    assert (round(lo, 3), round(hi, 3)) == (1.018, 2.982)
    assert p.beats() == 1 and p.within(3.0) and not p.within(2.0)
    assert verdict(p, "A", "B") == "A beats B (5 seeds)"
    assert verdict(p, "A", "B", within=3) == "A beats B, and A is within 3 of B (5 seeds)"
    assert verdict(p, "A", "B", within=2) == "A beats B (5 seeds)"
    assert p.text() == "+2.00 [+1.02, +2.98] (+++++, 5 seeds)"
    # the same seeds the other way round: b beats a
    assert paired(b, a).beats() == -1 and verdict(paired(b, a), "B", "A") == "A beats B (5 seeds)"


def test_a_tie_across_zero_is_undecided_not_equal():
    # a - b: +0.5, -0.5, 0.0 -> mean 0, s = 0.5, s / sqrt(3) = 0.28868, t(2) = 4.3027 -> half width 1.2421:
    # [-1.242, +1.242] crosses 0 (nobody beats) and sticks out of +-1 (not within 1), but lies inside +-1.5.
    p = paired({0: 10.5, 1: 9.5, 2: 10.0}, {0: 10.0, 1: 10.0, 2: 10.0})
    assert p.signs == "+-0" and p.interval is not None
    assert [round(x, 3) for x in p.interval] == [-1.242, 1.242]
    assert p.beats() == 0 and not p.within(1.0) and p.within(1.5)
    assert verdict(p, "A", "B", within=1) == "undecided (3 seeds)"
    assert verdict(p, "A", "B", within=1.5) == "A is within 1.5 of B (3 seeds)"


def test_ahead_in_every_seed_is_not_enough_at_three_seeds():
    # The old rule ("ahead on the mean and in every seed") called this a win; a - b = 1, 2, 6: mean 3,
    # s = sqrt(((-2)^2 + (-1)^2 + 3^2) / 2) = sqrt(7) = 2.6458, half width 4.3027 * 2.6458 / sqrt(3) = 6.572:
    # [-3.57, +9.57] -> undecided.
    p = paired({0: 1.0, 1: 2.0, 2: 6.0}, {0: 0.0, 1: 0.0, 2: 0.0})
    assert p.signs == "+++" and p.interval is not None and [round(x, 2) for x in p.interval] == [-3.57, 9.57]
    assert verdict(p, "A", "B") == "undecided (3 seeds)"


def test_only_common_seeds_pair_and_one_seed_has_no_interval():
    p = paired({0: 5.0, 1: 6.0, 2: 7.0, 3: 9.0}, {1: 5.0, 3: 8.0, 7: 0.0})
    assert p.seeds == (1, 3) and p.diffs == (1.0, 1.0)
    assert p.interval == pytest.approx((1.0, 1.0))  # no spread: a zero-width interval above 0
    one = paired({0: 2.0}, {0: 1.0})
    assert one.interval is None and one.beats() == 0 and not one.within(10)
    assert verdict(one, "A", "B") == "undecided (1 seed: an interval needs at least 2)"
    assert one.text() == "+1.00 [no interval] (+, 1 seed)"
    assert paired({0: 1.0}, {1: 1.0}).text() == "- (no common seeds)"

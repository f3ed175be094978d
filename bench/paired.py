"""Paired comparison of two benchmark rows by seed (docs/algorithms.md, Evaluation > Statistics).

Two rows run on the same seeds see the same partition, initialisation and batch order, so what one
seed adds to both cancels in their difference. The rule compares the per-seed differences a - b:
their mean with its 95 % Student-t interval (t over the seeds, n - 1 degrees of freedom) and, beside
it, their signs seed by seed. Verdicts:

- "A beats B" when the interval lies above 0 (B beats A when below);
- "A is within d of B" when the interval lies inside (-d, +d);
- otherwise "undecided" (not "equal": an interval across 0 says the seeds cannot tell).

Every verdict says how many seeds it rests on. Pure Python (no scipy): the t quantile is found by
bisection on the closed-form CDF of Student's t with an integer number of degrees of freedom.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass


def t_two_sided_prob(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with `df` (integer >= 1) degrees of freedom.

    Abramowitz & Stegun 26.7.3 (odd df) and 26.7.4 (even df), with theta = atan(t / sqrt(df))."""
    if df < 1 or int(df) != df:
        raise ValueError(f"t distribution: degrees of freedom must be an integer >= 1, got {df}")
    t = abs(t)
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2 == 1:
        series, term = 0.0, 1.0
        if df > 1:
            series = 1.0
            for k in range(1, (df - 3) // 2 + 1):  # terms (2*4*..*2k)/(1*3*..*(2k+1)) cos^2k
                term *= 2 * k / (2 * k + 1) * c2
                series += term
        return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * series)
    series, term = 1.0, 1.0
    for k in range(1, (df - 2) // 2 + 1):  # terms (1*3*..*(2k-1))/(2*4*..*2k) cos^2k
        term *= (2 * k - 1) / (2 * k) * c2
        series += term
    return math.sin(theta) * series


def t_quantile(df: int, level: float = 0.95) -> float:
    """The t with P(|T| <= t) = level: the half-width of a two-sided `level` interval is t * s / sqrt(n)."""
    if not 0 < level < 1:
        raise ValueError(f"t quantile: level must lie in (0, 1), got {level}")
    lo, hi = 0.0, 1.0
    while t_two_sided_prob(hi, df) < level:
        hi *= 2
    for _ in range(200):  # bisection to float precision
        mid = (lo + hi) / 2
        if t_two_sided_prob(mid, df) < level:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass(frozen=True)
class Paired:
    """The paired differences a - b over the seeds both rows ran, in the unit they were given."""

    seeds: tuple[int, ...]
    diffs: tuple[float, ...]
    level: float = 0.95

    @property
    def n(self) -> int:
        return len(self.diffs)

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.diffs) if self.diffs else None

    @property
    def interval(self) -> tuple[float, float] | None:
        """mean ± t(n-1) * s / sqrt(n); None below 2 seeds (no spread to scale by)."""
        if self.n < 2:
            return None
        m, s = statistics.fmean(self.diffs), statistics.stdev(self.diffs)
        half = t_quantile(self.n - 1, self.level) * s / math.sqrt(self.n)
        return m - half, m + half

    @property
    def signs(self) -> str:
        """One character per seed, in seed order: + (a ahead), - (b ahead), 0 (equal)."""
        return "".join("+" if d > 0 else "-" if d < 0 else "0" for d in self.diffs)

    def beats(self) -> int:
        """+1 when a beats b (interval above 0), -1 when b beats a (below 0), else 0."""
        iv = self.interval
        if iv is None:
            return 0
        return 1 if iv[0] > 0 else -1 if iv[1] < 0 else 0

    def within(self, d: float) -> bool:
        """The interval lies inside (-d, +d): a and b differ by less than d at this level."""
        iv = self.interval
        return iv is not None and -d < iv[0] and iv[1] < d

    def text(self, digits: int = 2) -> str:
        """`+1.23 [-0.40, +2.86] (++-, 3 seeds)`: the mean, its interval, the signs and the seed count."""
        if not self.diffs:
            return "- (no common seeds)"
        iv = self.interval
        span = f" [{iv[0]:+.{digits}f}, {iv[1]:+.{digits}f}]" if iv is not None else " [no interval]"
        return f"{self.mean:+.{digits}f}{span} ({self.signs}, {self.n} seed{'s' if self.n != 1 else ''})"


def paired(a: Mapping[int, float], b: Mapping[int, float], level: float = 0.95) -> Paired:
    """The differences a[s] - b[s] over the seeds s both have, in seed order."""
    seeds = tuple(sorted(set(a) & set(b)))
    return Paired(seeds, tuple(a[s] - b[s] for s in seeds), level)


def verdict(p: Paired, a: str, b: str, within: float | None = None) -> str:
    """The rule's verdict in words, with its seed count: "a beats b", "a is within d of b" (when `within`
    is given), both where both hold, else "undecided"."""
    seeds = f"{p.n} seed{'s' if p.n != 1 else ''}"
    if p.interval is None:
        return f"undecided ({seeds}: an interval needs at least 2)"
    said = []
    who = p.beats()
    if who:
        said.append(f"{a} beats {b}" if who > 0 else f"{b} beats {a}")
    if within is not None and p.within(within):
        said.append(f"{a} is within {within:g} of {b}")
    return (", and ".join(said) if said else "undecided") + f" ({seeds})"

"""k and t of secure aggregation from a stated threat model (Bell, Bonawitz, Gascon, Lepoint, Raykova: "Secure
Single-Server Aggregation with (Poly)Logarithmic Overhead", CCS 2020, Sec. 4; the same bounds as Google's Harary
graph parameter finder). Pure arithmetic: exact binomial tails over fractions, no I/O (docs/privacy.md has the table).

The graph (protofl/secagg.py `neighbours`) is a Harary graph H(n, k) over a keyed shuffle of the n devices that
sent keys: each joined to the k/2 before and the k/2 after it on the ring (k even), or everybody to everybody when
k >= n - 1. A device's secrets are Shamir-shared among its k neighbours with threshold t. The threat model:

- every device drops independently with probability `dropout` (delta) before it answers the unmask step;
- every device is corrupt (colludes with the server) independently with probability `corrupt` (gamma);
- the server may lie about who dropped (it tells some neighbours "u survived", others "u dropped").

Three bad events, each bounded from above by an exact computation:

1. **the round fails** (correctness): some device's secret has fewer than t answering holders. For one device,
   q_fail = P[Binomial(k, 1 - delta) <= t - 1]. The events "device u has t answering neighbours" are all increasing
   in the independent survivals, so by Harris' inequality they are positively correlated: the round completes with
   probability at least (1 - q_fail)^n, which is what `complete` states (the issue's 0.69 failure at 20 % for
   n = 100, k = 14, t = 8 is 1 - (1 - P[Bin(14, 0.8) <= 7])^100).
2. **a device is unmasked** (privacy): with c corrupt neighbours (they give the server both shares), the server gets
   t shares of both b_u and s_u once (k - c) + 2c >= 2t, that is c >= 2t - k; q_exp = P[Binomial(k, gamma) >=
   2t - k], and over the n devices at most n q_exp (a union bound). A strict majority t > k/2 makes 2t - k >= 1:
   without corrupt devices nobody is unmasked, whatever the server says (`secagg.roster_problem`).
3. **the honest survivors fall apart** (privacy): the server learns the sum of each part. On the ring a removed set
   disconnects H(n, k) only if it holds k/2 consecutive devices at two places, with a device between them on both
   sides: n (n - k - 1) / 2 such pairs of runs, each all bad (dropped or corrupt: beta = 1 - (1 - delta)(1 - gamma))
   with probability beta^k; at most n (n - k - 1) / 2 beta^k (a union bound; 0 for the complete graph).

`derive` picks k the smallest even degree (from `secagg.MIN_NEIGHBOURS`), then the complete graph, for which some
strict majority t keeps events 2 and 3 under the target (t the smallest such: it fails least) and event 1 under it
too; where no k does (few devices, much dropout), the complete graph with the smallest t that keeps privacy under
the target (privacy is never traded for liveness; t = k where none does), and `meets` is false. Without a stated
threat model the server keeps its fixed k = 2 ceil(log2 n), t = k/2 + 1 (`secagg.degree`, `secagg.threshold`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from protofl import secagg

TARGET = 2.0**-20  # each bad event's probability bound: Google's correctness parameter (2^-20 a round)


@dataclass(frozen=True)
class Threat:
    """The stated threat model: the fraction of devices that drop before answering, the fraction that collude with
    the server, and the bound each bad event's probability must stay under."""

    dropout: float = 0.0
    corrupt: float = 0.0
    target: float = TARGET

    def __post_init__(self) -> None:
        if not (0.0 <= self.dropout < 1.0 and 0.0 <= self.corrupt < 1.0 and 0.0 < self.target < 1.0):
            raise ValueError(f"dropout and corrupt must be in [0, 1), target in (0, 1): got {self}")


@dataclass(frozen=True)
class Params:
    """k neighbours a device and threshold t for n devices, and what they give under the threat model: `fail`,
    an upper bound on the probability that the round cannot unmask, and `exposed`, on the probability that the
    server learns more than the survivors' sum; `meets`: both under the target."""

    n: int
    k: int
    t: int
    fail: float
    exposed: float
    meets: bool

    @property
    def complete(self) -> float:
        """A lower bound on the probability that the round completes (unmasks) at the stated dropout."""
        return 1.0 - self.fail


def _exact(x: float) -> Fraction:
    """A rate as the decimal it was written as (0.2 is 1/5, not the float nearest it)."""
    return Fraction(repr(float(x)))


def binom_le(k: int, p: Fraction, m: int) -> Fraction:
    """P[Binomial(k, p) <= m], exactly."""
    return sum((math.comb(k, i) * p**i * (1 - p) ** (k - i) for i in range(0, min(m, k) + 1)), Fraction(0))


def fail_one(k: int, t: int, dropout: Fraction) -> Fraction:
    """Event 1 for one device: fewer than t of its k neighbours answer (each answers with probability 1 - dropout)."""
    return binom_le(k, 1 - dropout, t - 1)


def fail_round(n: int, k: int, t: int, dropout: Fraction) -> float:
    """Event 1: an upper bound on the probability that some device's secret cannot be rebuilt, 1 - (1 - q)^n (in
    floating point from the exact q: -expm1(n log1p(-q)), exact to its last digits where q is tiny)."""
    q = float(fail_one(k, t, dropout))
    return 1.0 if q >= 1.0 else -math.expm1(n * math.log1p(-q))


def exposed(n: int, k: int, t: int, dropout: Fraction, corrupt: Fraction) -> float:
    """Events 2 and 3: an upper bound on the probability that the server learns more than the survivors' sum."""
    unmasked = n * (1 - binom_le(k, corrupt, 2 * t - k - 1))  # n P[Bin(k, gamma) >= 2t - k]
    bad = 1 - (1 - dropout) * (1 - corrupt)
    apart = Fraction(n * (n - k - 1), 2) * bad**k if k < n - 1 else Fraction(0)
    return float(min(Fraction(1), unmasked + apart))


def _params(n: int, k: int, t: int, threat: Threat) -> Params:
    d, c = _exact(threat.dropout), _exact(threat.corrupt)
    fail, exp = fail_round(n, k, t, d), exposed(n, k, t, d, c)
    return Params(n, k, t, fail, exp, fail <= threat.target and exp <= threat.target)


def _private_t(n: int, k: int, threat: Threat) -> int | None:
    """The smallest strict majority t of k whose privacy bound is under the target (None: none is)."""
    d, c = _exact(threat.dropout), _exact(threat.corrupt)
    for t in range(k // 2 + 1, k + 1):
        if exposed(n, k, t, d, c) <= threat.target:
            return t
    return None


def derive(n: int, threat: Threat) -> Params:
    """k and t for n devices under `threat` (the module's docstring says how)."""
    if n < secagg.MIN_NEIGHBOURS + 1:  # too few for any roster a device accepts: today's, stated as failing
        k = max(0, n - 1)
        t = secagg.threshold(k)
        return Params(n, k, t, 1.0, 1.0, False)
    for k in [*range(secagg.MIN_NEIGHBOURS, n - 1, 2), n - 1]:
        private = _private_t(n, k, threat)
        if private is not None:
            got = _params(n, k, private, threat)
            if got.meets:
                return got
    k = n - 1
    return _params(n, k, _private_t(n, k, threat) or k, threat)


def stated(dropout: float | None, corrupt: float | None) -> Threat | None:
    """The threat model a config states (`secagg_dropout`, `secagg_corrupt`: either set; the other is 0), or None."""
    if dropout is None and corrupt is None:
        return None
    return Threat(float(dropout or 0.0), float(corrupt or 0.0))


def for_round(n: int, threat: Threat | None) -> Params:
    """The k and t of a round of n devices: derived from a stated threat model, else today's fixed ones (judged as
    if nothing dropped)."""
    return fixed(n, Threat()) if threat is None else derive(n, threat)


def fixed(n: int, threat: Threat) -> Params:
    """Today's fixed k and t for n devices (no threat model stated), with what they give under `threat`."""
    k = secagg.degree(n)  # (even, or n - 1: the complete graph)
    t = secagg.threshold(k)
    if n < secagg.MIN_NEIGHBOURS + 1:
        return Params(n, k, t, 1.0, 1.0, False)
    return _params(n, k, t, threat)

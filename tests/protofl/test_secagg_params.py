"""k and t from a threat model (protofl/secagg_params.py): the binomial tails and the three bounds against values a
reader can work out with pencil and paper, the choice of k as the smallest that meets the target, today's fixed
parameters kept where no model is stated, and docs/privacy.md's table as the function computes it."""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path

import pytest

from protofl import secagg
from protofl.secagg_params import (
    TARGET,
    Threat,
    binom_le,
    derive,
    exposed,
    fail_one,
    fail_round,
    fixed,
    for_round,
    stated,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "privacy.md"


def test_the_binomial_tail_by_hand() -> None:
    # P[Bin(2, 1/2) <= 0] = 1/4; P[Bin(3, 1/2) <= 1] = (1 + 3) / 8.
    assert binom_le(2, Fraction(1, 2), 0) == Fraction(1, 4)
    assert binom_le(3, Fraction(1, 2), 1) == Fraction(1, 2)
    # 4 neighbours each answering with 9/10, at most 2 answer: .1^4 + 4 (.9)(.1^3) + 6 (.81)(.01) = .0523.
    assert binom_le(4, Fraction(9, 10), 2) == Fraction(523, 10000)
    assert fail_one(4, 3, Fraction(1, 10)) == Fraction(523, 10000)  # t = 3 of 4 at 10 % dropout: the same event
    assert binom_le(4, Fraction(9, 10), 4) == 1


def test_the_round_failure_is_the_issues_arithmetic() -> None:
    # Issue 58: 100 devices, fixed k = 14, t = 8: q = P[Bin(14, 1 - d) <= 7], the round fails with 1 - (1 - q)^100.
    assert fail_round(100, 14, 8, Fraction(1, 10)) == pytest.approx(0.0180, abs=5e-4)  # "about 0.02"
    assert fail_round(100, 14, 8, Fraction(1, 5)) == pytest.approx(0.689, abs=1e-3)  # "0.69"
    assert fail_round(100, 14, 8, Fraction(3, 10)) > 0.9999  # "~1"
    # 5 devices, complete (k = 4), t = 3, 10 % dropout: 1 - (1 - .0523)^5 = 0.23554...
    assert fail_round(5, 4, 3, Fraction(1, 10)) == pytest.approx(1 - 0.9477**5, rel=1e-12)
    assert fail_round(5, 4, 3, Fraction(0)) == 0.0


def test_the_privacy_bounds_by_hand() -> None:
    # Complete graph of 5 (k = 4), t = 3: a lying server needs c >= 2t - k = 2 corrupt neighbours of a device;
    # 5 P[Bin(4, .1) >= 2] = 5 (1 - .9^4 - 4 (.1)(.9^3)) = 5 (.0523) = .2615 (no cut of a complete graph).
    assert exposed(5, 4, 3, Fraction(0), Fraction(1, 10)) == pytest.approx(0.2615, rel=1e-12)
    # t = 4 of 4: c >= 4; 5 (.1^4) = .0005.
    assert exposed(5, 4, 4, Fraction(0), Fraction(1, 10)) == pytest.approx(0.0005, rel=1e-12)
    # No corrupt device: a strict majority unmasks nobody; a ring of 10 with k = 4 at 10 % dropout falls apart
    # with at most 10 (10 - 4 - 1) / 2 (.1^4) = 25 (.0001) = .0025.
    assert exposed(10, 4, 3, Fraction(1, 10), Fraction(0)) == pytest.approx(0.0025, rel=1e-12)
    assert exposed(10, 9, 5, Fraction(1, 10), Fraction(0)) == 0.0  # the complete graph: never apart


def test_k_is_the_smallest_that_meets_the_target_and_t_a_strict_majority() -> None:
    # No dropout, no corrupt device: nothing can go wrong, so the smallest roster a device accepts (a ring).
    p = derive(100, Threat(0.0))
    assert (p.k, p.t, p.fail, p.exposed, p.meets) == (2, 2, 0.0, 0.0, True)
    for n, dropout, corrupt in [(100, 0.1, 0.0), (100, 0.2, 0.0), (1000, 0.3, 0.0), (100, 0.1, 0.05)]:
        threat = Threat(dropout, corrupt)
        p = derive(n, threat)
        assert p.meets and p.fail <= TARGET and p.exposed <= TARGET and 2 * p.t > p.k and p.k % 2 == 0
        # the even degree below it meets the target with no strict majority t
        d, c = Fraction(str(dropout)), Fraction(str(corrupt))
        k = p.k - 2
        assert not any(
            fail_round(n, k, t, d) <= TARGET and exposed(n, k, t, d, c) <= TARGET for t in range(k // 2 + 1, k + 1)
        )
    assert (derive(100, Threat(0.1)).k, derive(100, Threat(0.1)).t) == (34, 18)
    assert (derive(100, Threat(0.1, 0.05)).k, derive(100, Threat(0.1, 0.05)).t) == (64, 41)  # t above the majority


def test_out_of_reach_the_complete_graph_privacy_first() -> None:
    # 10 devices at 10 % dropout: no k meets 2^-20; the complete graph (k = 9) with the bare majority t = 5.
    p = derive(10, Threat(0.1))
    assert (p.k, p.t, p.meets) == (9, 5, False) and p.fail == pytest.approx(0.00887, abs=1e-5)
    # Too few devices for any roster a device accepts (each would have 1 neighbour).
    assert derive(2, Threat(0.1)).meets is False and derive(2, Threat(0.1)).k == 1


def test_unset_keeps_todays_fixed_k_and_t() -> None:
    assert stated(None, None) is None
    assert stated(0.2, None) == Threat(0.2, 0.0) and stated(None, 0.05) == Threat(0.0, 0.05)
    for n in (3, 4, 6, 10, 100, 1000):
        p = for_round(n, None)
        assert (p.k, p.t) == (secagg.degree(n), secagg.threshold(secagg.degree(n)))
    assert [(fixed(n, Threat()).k, fixed(n, Threat()).t) for n in (4, 10, 100)] == [(3, 2), (8, 5), (14, 8)]


def test_the_docs_table_is_the_functions() -> None:
    text = DOCS.read_text()
    rows = re.findall(r"^\| (\d+) \| (\d+)% \| (\d+) \| (\d+) \| ([^|]+) \| (\d+), (\d+) \| ([^|]+) \|$", text, re.M)
    assert len(rows) == 12, rows
    seen = set()
    for n, pct, k, t, fail, fk, ft, ffail in rows:
        p, f = derive(int(n), Threat(int(pct) / 100)), fixed(int(n), Threat(int(pct) / 100))
        assert (int(k), int(t), fail.strip()) == (p.k, p.t, f"{p.fail:.2g}"), (n, pct)
        assert (int(fk), int(ft), ffail.strip()) == (f.k, f.t, f"{f.fail:.2g}"), (n, pct)
        seen.add((int(n), int(pct)))
    assert seen == {(n, d) for n in (10, 100, 1000) for d in (0, 10, 20, 30)}

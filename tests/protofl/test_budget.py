"""Adaptive uploads: the richest encoding that fits, stepping down f4 -> f2 -> q8 -> fewer APUD values."""

from __future__ import annotations

import pytest

from protofl.budget import choose_upload, leaner, upload_budget

VB = {"f4": 4, "f2": 2, "q8": 1}


def sparse_size(dt: str, k: int | None) -> int:
    """100 B of envelope + K (u2 index + value)."""
    assert k is not None
    return 100 + k * (2 + VB[dt])


def test_budget_is_rate_times_share_times_time_left() -> None:
    # NB-IoT uplink 62.5 kbit/s = 7812.5 B/s; 80 % of 10 s -> 62,500 B
    assert upload_budget(7812.5, 0.8, 10.0) == 62_500
    assert upload_budget(7812.5, 0.8, -3.0) == 0  # past the deadline already
    with pytest.raises(ValueError):
        upload_budget(1.0, 0.0, 1.0)


def test_no_budget_keeps_the_config_encoding() -> None:
    c = choose_upload(sparse_size, "f4", 1000, None)
    assert (c.dt, c.k, c.nbytes, c.fits, c.budget) == ("f4", 1000, 6100, True, None)


@pytest.mark.parametrize(
    "budget, dt, k, nbytes",
    [
        (6100, "f4", 1000, 6100),  # K=1000 at f4: 100 + 1000 * 6 = 6100 fits exactly
        (6099, "f2", 1000, 4100),  # f4 one byte over; f2: 100 + 1000 * 4
        (4000, "q8", 1000, 3100),  # f2 over; q8: 100 + 1000 * 3
        (3000, "q8", 966, 2998),  # q8 at K=1000 over: the largest K with 100 + 3K <= 3000 is 966
    ],
)
def test_steps_down_precision_then_k(budget: int, dt: str, k: int, nbytes: int) -> None:
    c = choose_upload(sparse_size, "f4", 1000, budget)
    assert (c.dt, c.k, c.nbytes, c.fits) == (dt, k, nbytes, True)
    assert c.nbytes <= budget


def test_nothing_fits_sends_the_leanest_and_says_so() -> None:
    dense = lambda dt, k: 100 + 1000 * VB[dt]  # noqa: E731 - FedAvg: no K to give up
    c = choose_upload(dense, "f4", None, 500)
    assert (c.dt, c.nbytes, c.fits) == ("q8", 1100, False)
    c = choose_upload(sparse_size, "f4", 1000, 50)  # not even K=1 fits
    assert (c.dt, c.k, c.fits) == ("q8", 1, False)


def test_an_encoding_that_cannot_carry_the_values_is_skipped() -> None:
    no_f2 = lambda dt, k: None if dt == "f2" else 100 + 1000 * VB[dt]  # noqa: E731 - values beyond float16
    assert choose_upload(no_f2, "f4", None, 3000).dt == "q8"


def test_leaner() -> None:
    assert leaner("f4", "q8") == "q8" and leaner("f2", "f4") == "f2"

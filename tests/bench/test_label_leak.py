"""The figure docs/privacy.md gives for the counts leak across rounds (bench/label_leak.py): two unmasked sums whose
survivor sets differ by one device give its per-class counts exactly; and the exposure arithmetic, by hand."""

from __future__ import annotations

import numpy as np

from bench.label_leak import exposed_fraction, subtraction


def test_two_rounds_whose_survivors_differ_by_one_device_give_its_counts_exactly() -> None:
    got = subtraction(np.random.default_rng(0))
    assert got["exact"] == 1.0
    assert got["row_error"] > 0.01  # its rows are not given exactly: the others' rows drifted between the rounds


def test_a_device_is_exposed_when_its_indicator_is_in_the_span_of_the_survivor_sets() -> None:
    class Fixed:  # every round survives except device 0 in the second: rows [1,1,1] and [0,1,1]
        def random(self, shape: tuple[int, int]) -> np.ndarray:
            return np.array([[0.9, 0.9, 0.9], [0.0, 0.9, 0.9]])[: shape[0]]

    # [1,1,1] - [0,1,1] = e_0: device 0 determined; devices 1 and 2 only as a sum: 1/3 exposed
    assert exposed_fraction(3, 0.5, 2, Fixed()) == 1 / 3  # type: ignore[arg-type]

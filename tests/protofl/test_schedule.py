"""Which rounds are evaluated (local split) and which score the official test set."""

from __future__ import annotations

import pytest

from protofl.errors import ConfigError
from protofl.schedule import check_cadence, is_due


def test_every_nth_round_and_always_the_last() -> None:
    assert [r for r in range(1, 8) if is_due(r, 3, 7)] == [3, 6, 7]
    assert [r for r in range(1, 5) if is_due(r, 1, 4)] == [1, 2, 3, 4]
    assert [r for r in range(1, 5) if is_due(r, 10, None)] == []  # rounds unknown: no "last"


def test_test_cadence_defaults_to_eval_and_must_be_a_multiple() -> None:
    assert check_cadence(2, None) == 2
    assert check_cadence(2, 10) == 10
    with pytest.raises(ConfigError, match="multiple of --eval-every"):
        check_cadence(2, 3)
    with pytest.raises(ConfigError, match="--eval-every must be >= 1"):
        check_cadence(0, None)

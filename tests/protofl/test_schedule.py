"""Which rounds are evaluated (local split) and which score the official test set."""

from __future__ import annotations

import pytest

from protofl.errors import ConfigError
from protofl.schedule import check_cadence, describe_test_cadence, is_due, scores_test_set


def test_every_nth_round_and_always_the_last() -> None:
    assert [r for r in range(1, 8) if is_due(r, 3, 7)] == [3, 6, 7]
    assert [r for r in range(1, 5) if is_due(r, 1, 4)] == [1, 2, 3, 4]
    assert [r for r in range(1, 5) if is_due(r, 10, None)] == []  # rounds unknown: no "last"


def test_test_cadence_defaults_to_the_last_round_and_must_be_a_multiple() -> None:
    assert check_cadence(2, None) is None
    assert [r for r in range(1, 8) if scores_test_set(r, None, 7)] == [7]  # the default: the last round only
    assert [r for r in range(1, 8) if scores_test_set(r, 2, 7)] == [2, 4, 6, 7]
    assert [r for r in range(1, 5) if scores_test_set(r, None, None)] == []  # rounds unknown: no "last"
    assert describe_test_cadence(None, 10) == "round 10 only (the last)"
    assert describe_test_cadence(2, 10) == "every 2 rounds and the last"
    assert check_cadence(2, 10) == 10
    with pytest.raises(ConfigError, match="multiple of --eval-every"):
        check_cadence(2, 3)
    with pytest.raises(ConfigError, match="--eval-every must be >= 1"):
        check_cadence(0, None)

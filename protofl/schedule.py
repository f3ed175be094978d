"""Which rounds are evaluated: one rule for the devices, the progress display and the reports.

Evaluation is what a benchmark pays most for (every client scores its own model), so it has two
cadences: `eval_every` for the cheap local split (and the round's metrics message), `test_every` for
the official test set (global and ensemble accuracy; simulation only). The last round always has both.
"""

from __future__ import annotations

from protofl.errors import ConfigError


def is_due(round_: int, every: int, rounds: int | None) -> bool:
    """Round `round_` (1-based) is every `every`-th round or the last of `rounds` (None: not known)."""
    return round_ % max(1, every) == 0 or (rounds is not None and round_ >= rounds)


def check_cadence(eval_every: int, test_every: int | None) -> int:
    """The test-set cadence (default: `eval_every`); it must fall on rounds that report metrics."""
    if eval_every < 1:
        raise ConfigError(f"--eval-every must be >= 1, got {eval_every}")
    if test_every is None:
        return eval_every
    if test_every < 1 or test_every % eval_every:
        raise ConfigError(f"--test-every must be a positive multiple of --eval-every ({eval_every}), got {test_every}: "
                          "the test set is scored on rounds that report metrics")
    return test_every

"""Which rounds are evaluated: one rule for the devices, the progress display and the reports.

Evaluation is what a benchmark pays most for (every client scores its own model), so it has two
cadences: `eval_every` for the cheap local split (and the round's metrics message), `test_every` for
the official test set (global and ensemble accuracy; simulation only). The last round always has both.
Scoring the test set costs each client a forward pass over all of it (10,000 images on Fashion-MNIST:
more than a round of its local training), so by default (`test_every` None) only the last round
scores it; the per-round curves come from the local split.
"""

from __future__ import annotations

from protofl.errors import ConfigError


def is_due(round_: int, every: int, rounds: int | None) -> bool:
    """Round `round_` (1-based) is every `every`-th round or the last of `rounds` (None: not known)."""
    return round_ % max(1, every) == 0 or (rounds is not None and round_ >= rounds)


def scores_test_set(round_: int, test_every: int | None, rounds: int | None) -> bool:
    """Whether round `round_` scores the official test set: every `test_every`-th round and the last, or
    (`test_every` None, the default) the last round only."""
    if test_every is None:
        return rounds is not None and round_ >= rounds
    return is_due(round_, test_every, rounds)


def check_cadence(eval_every: int, test_every: int | None) -> int | None:
    """The checked test-set cadence (None: the last round only); it must fall on rounds that report metrics."""
    if eval_every < 1:
        raise ConfigError(f"--eval-every must be >= 1, got {eval_every}")
    if test_every is None:
        return None
    if test_every < 1 or test_every % eval_every:
        raise ConfigError(
            f"--test-every must be a positive multiple of --eval-every ({eval_every}), got {test_every}: "
            "the test set is scored on rounds that report metrics"
        )
    return test_every


def describe_test_cadence(test_every: int | None, rounds: int | None) -> str:
    """In words, which rounds score the official test set (for report headers)."""
    if test_every is None or (rounds is not None and test_every >= rounds):
        return "the last round only" if rounds is None else f"round {rounds} only (the last)"
    return f"every {test_every} round{'s' if test_every > 1 else ''} and the last"

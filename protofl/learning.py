"""Whether a federation is learning: the one rule the server's log, `protofl-server status` and the reports apply.

A federation is **not learning** at round r when

- **flat**: at least one accuracy it reports each round has been reported in `WINDOW + 1` rounds or more, and
  none of them has ever risen `MIN_GAIN` (1 point) or more above its first reported value. The accuracies
  watched are the devices' local accuracy (`local_acc`, each on its own held-out split), the clients' global
  accuracy (`global_acc`, a simulation's test set) and the deployable model's (`predictor_acc`: the global
  predictor, or FedAvg's global model, on the server's validation data or a simulation's test set); or
- **collapsed**: the deployable model put `COLLAPSE_SHARE` (95 %) or more of a round's scored images in one
  class while that class holds less than half of their labels (a model that answers one class whatever it sees).

An accuracy over 99 % (1 - MIN_GAIN) in any round counts as learning (nothing left to gain: small easy data).

A federation that learned and then levelled off (a plateau) is never flat: its accuracy rose above its first value.
The verdict is given once (`LearningWatch.update` returns the note the first round it holds, None after), with
what to do. Pure Python, no numpy: the server, the simulator and `protofl-server report` all read it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["COLLAPSE_SHARE", "MIN_GAIN", "WATCHED", "WINDOW", "LearningWatch", "collapse", "verdict"]

WINDOW = 3  # rounds after the first before a flat accuracy counts
MIN_GAIN = 0.01  # a rise of 1 point over the first reported value is learning
COLLAPSE_SHARE = 0.95
WATCHED = ("local_acc", "global_acc", "predictor_acc")

ADVICE = (
    "check that the devices' labels are right and their data is not tiny or constant; raise lr (--set lr=...), "
    "local_epochs or min_local_steps; see docs/how-to/watch.md (a federation that is not learning)"
)


def collapse(predicted: Iterable[int], labels: Iterable[int]) -> str | None:
    """The note where one class takes COLLAPSE_SHARE or more of the predictions but under half of the labels."""
    pred, lab = list(predicted), list(labels)
    if not pred or len(pred) != len(lab):
        return None
    top = max(set(pred), key=pred.count)
    share, truth = pred.count(top) / len(pred), lab.count(top) / len(lab)
    if share >= COLLAPSE_SHARE and truth < 0.5:
        return (
            f"collapsed: the deployable model put {100 * share:.0f} % of the scored images in class {top}, which "
            f"holds {100 * truth:.0f} % of their labels"
        )
    return None


def verdict(rows: Iterable[Mapping[str, object]]) -> str | None:
    """The flat half of the rule over a run's round rows (dicts with `round` and the WATCHED keys): its note, or
    None while the federation is learning or has run too few rounds to say."""
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key in WATCHED:
            v = row.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                series.setdefault(key, []).append((int(row.get("round", 0)), float(v)))  # type: ignore[call-overload]
    long = {k: s for k, s in series.items() if len(s) >= WINDOW + 1}
    if not long:
        return None
    if any(max(v for _, v in s[1:]) >= s[0][1] + MIN_GAIN for s in series.values() if len(s) > 1):
        return None  # some accuracy rose: learning (or learned, then levelled off)
    if any(max(v for _, v in s) > 1 - MIN_GAIN for s in series.values()):
        return None  # right from round 1 (small easy data): nothing left to gain
    parts = ", ".join(
        f"{key} {100 * s[0][1]:.1f} % in round {s[0][0]}, at most {100 * max(v for _, v in s[1:]):.1f} % "
        f"in rounds {s[1][0]}-{s[-1][0]}"
        for key, s in sorted(long.items())
    )
    return f"not learning: no accuracy rose {100 * MIN_GAIN:.0f} point over its first value ({parts})"


@dataclass
class LearningWatch:
    """The rule applied round by round: `update` with each round's row (and, where the deployable model's
    predictions were seen, their collapse note); the note once, the first round the federation is not learning."""

    rows: list[dict[str, object]] = field(default_factory=list)
    note: str | None = None  # the verdict once given (kept: status shows it until the run ends)

    def update(self, row: Mapping[str, object], collapsed: str | None = None) -> str | None:
        self.rows.append(dict(row))
        if self.note is not None:
            return None
        found = collapsed or verdict(self.rows)
        if found is None:
            return None
        self.note = f"round {row.get('round')}: {found}; {ADVICE}"
        return self.note

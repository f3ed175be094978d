"""A round's outcome for people: its accuracies, and when it can be shown.

A round closes with its last upload, but the devices evaluate after uploading, so its `metrics`
messages arrive just after the close. `RoundProgress` holds each closed round back until every
participant reported, the round asks for no metrics, or `GRACE_S` seconds passed (a device may
never report), then hands it on in round order. The service's per-round log line and both simulation
runners' progress rows come from it. `accuracies` summarises one round's metrics the one way every
report and log line does. numpy only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from broker_server.core.shell import RoundRecord
from protofl.schedule import is_due
from protofl.wire import Metrics

# How long a closed round waits for its participants' metrics before it is shown without them.
GRACE_S = 5.0
# ... and at most this much longer while the server asks for metrics the broker dropped (broker_server/ops/resend.py).
HOLD_S = 30.0


def _pooled(counts: list[tuple[int, int]]) -> float | None:
    """Sample-weighted accuracy over clients: sum of correct / sum of samples."""
    n = sum(total for _, total in counts)
    return sum(correct for correct, _ in counts) / n if n else None


def _mean(counts: list[tuple[int, int]]) -> float | None:
    """Mean over clients of each client's accuracy (clients with no samples do not count)."""
    rates = [correct / total for correct, total in counts if total]
    return float(np.mean(rates)) if rates else None


def accuracies(metrics: Iterable[Metrics]) -> dict[str, float | None]:
    """The round's accuracies from its clients' metrics (docs/algorithms.md, Evaluation).

    local: each client on its own held-out split, sample-weighted; global: each client on the official
    test set, mean over clients; the `_proto_` pair is the same for nearest-prototype predictions, over
    the clients that sent those counts. None where no client sent what an accuracy needs."""
    ms = list(metrics)
    return {
        "local_acc": _pooled([(m.correct_local, m.n_local) for m in ms]),
        "global_acc": _mean([(m.correct_test, m.n_test) for m in ms]),
        "local_proto_acc": _pooled(
            [(m.proto_correct_local, m.n_local) for m in ms if m.proto_correct_local is not None]
        ),
        "global_proto_acc": _mean([(m.proto_correct_test, m.n_test) for m in ms if m.proto_correct_test is not None]),
    }


class RoundProgress:
    """Hands each closed round, with the metrics its clients sent, to `emit` once they are in.

    `eval_every` (None: unknown, as for a server whose devices choose it) says which rounds ask for
    metrics: every `eval_every`-th and the last of `rounds`; a round that asks for none is emitted as
    soon as it closes. Metrics may arrive before their round's close is seen; late ones (after their
    round was emitted) still count for `all_metrics_in`.

    Memory is bounded by the rounds, never by what devices send: metrics are kept for the rounds
    closed and not yet emitted and for the round after the last close (the open one), one per client
    and round; a message for any other round (far ahead, or already emitted) is not stored. Of an
    emitted round only the participants still missing are remembered."""

    def __init__(
        self,
        emit: Callable[[RoundRecord, dict[str, Metrics]], None],
        *,
        grace: float = GRACE_S,
        eval_every: int | None = None,
        rounds: int | None = None,
    ) -> None:
        self.emit = emit
        self.grace = grace
        self.eval_every = eval_every
        self.rounds = rounds
        self.closed: list[RoundRecord] = []
        self.emitted = 0
        self._metrics: dict[int, dict[str, Metrics]] = {}  # rounds not emitted yet: client -> its metrics
        self._last_emitted = 0  # round number of the last round emitted
        self._last_known = 0  # the last round closed (or before the round a resumed service started in)
        self._missing: dict[int, set[str]] = {}  # emitted rounds: participants whose metrics are still due

    @property
    def pending(self) -> list[RoundRecord]:
        """Closed rounds not emitted yet, oldest first."""
        return self.closed[self.emitted :]

    def start_at(self, round_: int) -> None:
        """A service resumed in `round_`: the rounds before it were shown by the process that ran them,
        and metrics for `round_` may come before its close."""
        self._last_emitted = max(self._last_emitted, round_ - 1)
        self._last_known = max(self._last_known, round_ - 1)

    def round_end(self, rec: RoundRecord) -> None:
        self.closed.append(rec)
        self._last_known = max(self._last_known, rec.round)

    def add_metrics(self, client: str, round_: int, msg: Metrics) -> bool:
        """Count `client`'s metrics for `round_`; False if the round is none this progress waits for."""
        if self._last_emitted < round_ <= self._last_known + 1:
            self._metrics.setdefault(round_, {})[client] = msg  # a second message replaces the first
            return True
        missing = self._missing.get(round_)
        if missing is None or client not in missing:
            return False
        missing.discard(client)  # late: the row is out, but the run knows it arrived
        if not missing:
            del self._missing[round_]
        return True

    def expects_metrics(self, round_: int) -> bool:
        if self.eval_every is None:
            return True
        return is_due(round_, self.eval_every, self.rounds)

    def _due(self, rec: RoundRecord) -> set[str]:
        """The participants of a round not emitted yet whose metrics it still waits for."""
        if not self.expects_metrics(rec.round):
            return set()
        return set(rec.clients) - set(self._metrics.get(rec.round, {}))

    def complete(self, rec: RoundRecord) -> bool:
        """Every participant of the round reported (or the round asks for no metrics)."""
        if rec.round <= self._last_emitted:
            return not self._missing.get(rec.round)
        return not self._due(rec)

    def awaited(self) -> dict[int, tuple[float, set[str]]]:
        """The closed rounds not shown yet that wait for metrics: {round: (when it closed, who has not reported)}."""
        return {rec.round: (rec.ended, due) for rec in self.pending if (due := self._due(rec))}

    def poll(self, now: float, force: bool = False, hold: bool = False) -> int:
        """Emit the rounds that are ready (all of them with `force`), in order; returns how many. With `hold`
        (missing metrics are being asked for again) a round still missing some waits up to HOLD_S past its
        grace."""
        n = 0
        wait = self.grace + (HOLD_S if hold else 0.0)
        while self.emitted < len(self.closed):
            rec = self.closed[self.emitted]
            if not (force or self.complete(rec) or now >= rec.ended + wait):
                break
            self.emitted += 1
            n += 1
            self._emit(rec)
        return n

    def _emit(self, rec: RoundRecord) -> None:
        due = self._due(rec)
        if due:
            self._missing[rec.round] = due
        self._last_emitted = max(self._last_emitted, rec.round)
        metrics = self._metrics.pop(rec.round, {})
        for r in [r for r in self._metrics if r <= self._last_emitted]:  # rounds that never closed here
            del self._metrics[r]
        self.emit(rec, metrics)

    def all_metrics_in(self) -> bool:
        """Every participant's metrics of every closed round that asks for them."""
        return not self._missing and all(self.complete(rec) for rec in self.pending)

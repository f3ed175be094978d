"""Nothing lost when the broker drops: its drops detected, and the devices that lost a message asked again.

Mosquitto acknowledges a device's QoS 1 upload when it arrives, then queues it for the aggregator; when
that queue is full (`max_queued_messages`, broker_server/ops/capacity.py) it drops the message. The device
saw its PUBLISH acknowledged and never sends it again, and the broker says so only once per client in
its log ("Outgoing messages are being dropped for client ..."). What it does count, every time, is
`$SYS/broker/publish/messages/dropped` (Mosquitto 2.0, published every `sys_interval`): the server
subscribes to it (the ACL lets the server read that one topic) and `BrokerDrops` turns the cumulative
counter into new drops. The counter is the broker's, for every client; its own reset (a restarted
broker) starts again from zero. A counter message that the full queue drops itself raises the counter,
so the next one is published: the server learns of drops once it has caught up with its backlog.

Which messages were lost the broker does not say. So, from a drop on, `Resender` asks each device that
still owes the open phase something (a member that has not joined, a client whose upload is missing) to
send it again, on the device's own `down/<id>` topic (wire `Resend`; only the server may write there),
and each participant of a closed round whose metrics its log line still waits for (its line waits for the
answers). A device keeps its last uploads and metrics (edge_agent/ops/runner.py) and re-sends them; duplicate
uploads are dropped by the round machine's envelope screen, a second metrics message replaces the first.
The requests are flow-controlled so that a fleet of 10,000 does not flood the queue again: at most
`window` requests are outstanding (not yet answered by what they ask for; `Resender` says when one
expires), where the window is sized so that its answers fit half the queue; each device is asked at most
`MAX_ATTEMPTS` times per drop episode, and an episode asks only for the uploads of the phase open when the
drops were seen (joins and closed rounds' metrics whenever they were lost), so the next phase's devices,
still training, are not asked. numpy-free, no I/O: the service publishes what `due` returns.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from broker_server.core.rounds import RoundMachine
from broker_server.ops.broker import DROPPED_TOPIC

__all__ = ["DROPPED_TOPIC", "Ask", "BrokerDrops", "Resender", "owed"]
log = logging.getLogger("protofl.server")
MAX_COUNTER_BYTES = 24  # a decimal counter; anything longer is not one
QUIET_S = 2.0  # a request whose answer has not come while nothing reached the server for this long expires
MAX_AGE_S = 30.0  # ... and any request after this long (steady traffic must not keep dead requests alive)
MAX_ATTEMPTS = 3  # per device and episode
SETTLE_S = 0.5  # after drops, the first requests wait until nothing reached the server for this long


class BrokerDrops:
    """The broker's cumulative dropped-messages counter, read from its `$SYS` payloads."""

    def __init__(self, from_zero: bool = False) -> None:
        self.total = 0  # drops seen since this server started
        # The first reading is the baseline (drops before we listened), unless counted `from_zero`: a site
        # broker's counter, whose first reading may come only after its bridge reconnected, past the drops.
        self._last: int | None = 0 if from_zero else None

    def observe(self, payload: bytes) -> int:
        """New drops since the last reading (0 for the first, unless counted from zero)."""
        text = payload[: MAX_COUNTER_BYTES + 1].decode("ascii", "replace").strip()
        if len(payload) > MAX_COUNTER_BYTES or not text.isdigit():
            return 0  # not a counter: ignored (only the broker can publish on $SYS)
        value = int(text)
        last, self._last = self._last, value
        if last is None:
            return 0
        new = value - last if value >= last else value  # a smaller value: the broker restarted, counting anew
        self.total += new
        return new


@dataclass(frozen=True)
class Ask:
    """One request: `client` should send its join ("join"), its uploads of (round, phase) ("uploads"), or its
    metrics of `round` ("metrics")."""

    client: str
    ask: str
    round: int = 0
    phase: str = ""


def owed(
    machine: RoundMachine, members: Collection[str] | None, metrics: Mapping[int, Collection[str]] | None = None
) -> list[Ask]:
    """What devices still owe the federation now: the open phase's missing uploads first, then the joins of
    members that are not clients (without a member list nobody's join can be known to be missing), then the
    metrics of closed rounds that `metrics` ({round: participants}) says their log lines wait for."""
    s = machine.state
    out: list[Ask] = []
    open_ = s.phase
    if open_ is not None and not s.finished:
        out += [Ask(c, "uploads", s.round, open_.phase.value) for c in sorted(open_.expected) if not open_.complete(c)]
    if members and not s.finished:
        out += [Ask(c, "join") for c in sorted(members) if c not in s.clients]
    for r, clients in sorted((metrics or {}).items()):
        out += [Ask(c, "metrics", r) for c in sorted(clients)]
    return out


class Resender:
    """Which devices to ask to re-send, and when: after drops, at most `window` requests outstanding.

    A request is outstanding until what it asks for arrives, or it expires: after `quiet` seconds in which
    nothing at all reached the server (its answers are not queued behind others: it was lost, or the device
    is gone or still training), or after `max_age` seconds anyway. While the server drains a backlog nothing
    expires, so the window really bounds the answers in the broker's queue, however slow the aggregator.
    An expired request is asked again, up to `attempts` times per device and episode. After an alarm the first
    requests wait until the server has drained what the broker still held (`settle` seconds of quiet): the
    devices whose uploads are in that backlog owe nothing."""

    def __init__(
        self,
        window: int,
        quiet: float = QUIET_S,
        max_age: float = MAX_AGE_S,
        attempts: int = MAX_ATTEMPTS,
        settle: float = SETTLE_S,
    ) -> None:
        if window < 1:
            raise ValueError(f"the re-send window must be at least 1, got {window}")
        self.window = window
        self.quiet = quiet
        self.max_age = max_age
        self.attempts = attempts
        self.settle = settle
        self.requests = 0  # requests sent since this server started
        self.episodes = 0
        self._scope: tuple[int, str] | None = None  # the (round, phase) whose uploads this episode asks for
        self._asked: dict[Ask, tuple[float, int]] = {}  # when last asked, how often
        self._progress = float("-inf")  # when something last reached the server
        self._alarmed: float | None = None  # an alarm whose first requests wait for the server to settle

    @property
    def active(self) -> bool:
        return self._scope is not None

    def progress(self, now: float) -> None:
        """Messages reached the server at `now` (answers may still be queued behind them)."""
        self._progress = now

    def alarm(self, round_: int, phase: str) -> None:
        """The broker dropped messages while (round_, phase) was open: ask again who still owes it. More drops
        in the same phase may have hit answers too: every device may be asked `attempts` times again."""
        if self._scope != (round_, phase):
            self._asked.clear()
        else:
            self._asked = {a: (t, 0) for a, (t, _) in self._asked.items()}
        self._scope = (round_, phase)
        self._alarmed = self._progress
        self.episodes += 1

    def _expired(self, asked_at: float, now: float) -> bool:
        return now - max(asked_at, self._progress) >= self.quiet or now - asked_at >= self.max_age

    def due(self, owing: list[Ask], now: float) -> list[Ask]:
        """The requests to send now, out of `owing` (what `owed` says); ends the episode once nobody in its
        scope owes anything that can still be asked."""
        scope = self._scope
        if scope is None:
            return []
        if self._alarmed is not None:
            # Uploads that came after the counter still wait in the broker's queue: their devices are not to be
            # asked. The first requests go out once nothing has arrived for `settle` (the backlog is drained).
            if now - self._progress < self.settle and now - self._alarmed < self.max_age:
                return []
            self._alarmed = None
        # Joins, and closed rounds' metrics, whenever they were lost; uploads of the phase of the drops only.
        mine = [a for a in owing if a.ask != "uploads" or (a.round, a.phase) == scope]
        outstanding, eligible = 0, []
        for a in mine:
            asked = self._asked.get(a)
            if asked is None:
                eligible.append(a)
            elif not self._expired(asked[0], now):
                outstanding += 1
            elif asked[1] < self.attempts:
                eligible.append(a)
        if not eligible:
            if not outstanding:
                self._scope = None
                self._asked.clear()
            return []
        take = eligible[: max(0, self.window - outstanding)]
        for a in take:
            self._asked[a] = (now, self._asked.get(a, (0.0, 0))[1] + 1)
        self.requests += len(take)
        return take

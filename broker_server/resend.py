"""Nothing lost when the broker drops: its drops detected, and the devices that lost a message asked again.

Mosquitto acknowledges a device's QoS 1 upload when it arrives, then queues it for the aggregator; when
that queue is full (`max_queued_messages`, broker_server/capacity.py) it drops the message. The device
saw its PUBLISH acknowledged and never sends it again, and the broker says so only once per client in
its log ("Outgoing messages are being dropped for client ..."). What it does count, every time, is
`$SYS/broker/publish/messages/dropped` (Mosquitto 2.0, published every `sys_interval`): the server
subscribes to it (the ACL lets the server read that one topic) and `BrokerDrops` turns the cumulative
counter into new drops. The counter is the broker's, for every client; its own reset (a restarted
broker) starts again from zero. A counter message that the full queue drops itself raises the counter,
so the next one is published: the server learns of drops once it has caught up with its backlog.

Which messages were lost the broker does not say. So, from a drop on, `Resender` asks each device that
still owes the open phase something (a member that has not joined, a client whose upload is missing) to
send it again, on the device's own `down/<id>` topic (wire `Resend`; only the server may write there).
A device keeps its last uploads (edge_agent/runner.py) and re-sends them; duplicates are dropped by the
round machine's envelope screen. The requests are flow-controlled so that a fleet of 10,000 does not
flood the queue again: at most `window` requests are outstanding (not yet answered by the upload or
join they ask for, and younger than `timeout`), where the window is sized so that its answers fit half
the queue; each device is asked at most once per drop episode, and an episode covers only the phase
open when the drops were seen (joins excepted), so the next phase's devices, still training, are not
asked. numpy-free, no I/O: the service publishes what `due` returns.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass

from broker_server.broker import DROPPED_TOPIC
from broker_server.rounds import RoundMachine

__all__ = ["DROPPED_TOPIC", "Ask", "BrokerDrops", "Resender", "owed"]
log = logging.getLogger("protofl.server")
MAX_COUNTER_BYTES = 24  # a decimal counter; anything longer is not one
ASK_TIMEOUT_S = 5.0  # a request not answered by then frees its place in the window (the device may be gone)


class BrokerDrops:
    """The broker's cumulative dropped-messages counter, read from its `$SYS` payloads."""

    def __init__(self) -> None:
        self.total = 0  # drops seen since this server started
        self._last: int | None = None

    def observe(self, payload: bytes) -> int:
        """New drops since the last reading (0 for the first: it is the baseline, drops before we listened)."""
        text = payload[:MAX_COUNTER_BYTES + 1].decode("ascii", "replace").strip()
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
    """One request: `client` should send its join ("join") or its uploads of (round, phase) ("uploads")."""

    client: str
    ask: str
    round: int = 0
    phase: str = ""


def owed(machine: RoundMachine, members: Collection[str] | None) -> list[Ask]:
    """What devices still owe the federation now: the open phase's missing uploads first, then the joins of
    members that are not clients (without a member list nobody's join can be known to be missing)."""
    s = machine.state
    if s.finished:
        return []
    out: list[Ask] = []
    open_ = s.phase
    if open_ is not None:
        out += [Ask(c, "uploads", s.round, open_.phase.value) for c in sorted(open_.expected) if not open_.complete(c)]
    if members:
        out += [Ask(c, "join") for c in sorted(members) if c not in s.clients]
    return out


class Resender:
    """Which devices to ask to re-send, and when: after drops, at most `window` requests outstanding."""

    def __init__(self, window: int, timeout: float = ASK_TIMEOUT_S) -> None:
        if window < 1:
            raise ValueError(f"the re-send window must be at least 1, got {window}")
        self.window = window
        self.timeout = timeout
        self.requests = 0  # requests sent since this server started
        self.episodes = 0
        self._scope: tuple[int, str] | None = None  # the (round, phase) whose uploads this episode asks for
        self._asked: dict[Ask, float] = {}

    @property
    def active(self) -> bool:
        return self._scope is not None

    def alarm(self, round_: int, phase: str) -> None:
        """The broker dropped messages while (round_, phase) was open: ask again who still owes it."""
        self._asked.clear()  # whoever was asked before may have lost its answer too
        self._scope = (round_, phase)
        self.episodes += 1

    def due(self, owing: list[Ask], now: float) -> list[Ask]:
        """The requests to send now, out of `owing` (what `owed` says); ends the episode once nobody in its
        scope owes anything that was not asked and answered or timed out."""
        scope = self._scope
        if scope is None:
            return []
        mine = [a for a in owing if a.ask == "join" or (a.round, a.phase) == scope]
        wanted = set(mine)
        outstanding = sum(1 for a, t in self._asked.items() if a in wanted and now - t < self.timeout)
        fresh = [a for a in mine if a not in self._asked]
        if not fresh:
            if not outstanding:
                self._scope = None
                self._asked.clear()
            return []
        take = fresh[:max(0, self.window - outstanding)]
        for a in take:
            self._asked[a] = now
        self.requests += len(take)
        return take

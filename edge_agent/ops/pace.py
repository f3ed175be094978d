"""A device's pace: when its messages go out, and when a round that failed here is tried again.

`Outbox`: the agent's messages leave in order; with a device profile through a `HeldSender`, each not before the
release time the agent's round clock gave it (edge_agent/core/emulation.py), and in simulation in the emulated order the
thread agents share (`ReleaseOrder`). `Retry`: a round that failed here (training diverged, hostile anchors) is
said on the presence topic and tried again after `retry_s`, up to `max_attempts` times; after the last try the
device gives up on that phase (presence `GAVE_UP`, broker_server/core/shell.py), and the next round message is tried
afresh. No torch, no numpy.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from edge_agent.core.emulation import Emulation, HeldSender, RoundClock
from edge_agent.core.outcome import Failure, Send
from protofl.transport.mqtt import MqttTransport

__all__ = ["GAVE_UP", "Outbox", "Retry", "Ticket"]

GAVE_UP = (
    "gave_up"  # our presence after the last failed try of a round: we leave that phase (broker_server/core/shell.py)
)


@dataclass
class Ticket:
    """One message handed to the outbox: its transport sequence number once it is published (a held one later, on
    the sender's thread); None while it waits, or for good where publishing it failed."""

    seq: int | None = None


class Outbox:
    """The agent's messages onto `transport`, in order; with a device profile (`emulation`) not before their release
    time, retained ones and the presence (published on the transport directly) at once. Each send's `Ticket` says
    when the broker has it (`acknowledged`)."""

    def __init__(self, transport: MqttTransport, emulation: Emulation | None, client_id: str, round_topic: str) -> None:
        self.transport = transport
        self.round_topic = round_topic
        self.clock = RoundClock(emulation) if emulation is not None else None
        self.order = emulation.order if emulation is not None else None
        self._due: deque[Ticket] = deque()  # held messages' tickets, in the order the sender publishes them
        self.held = HeldSender(self._release, self.order, client_id) if self.clock is not None else None
        self.client_id = client_id
        if self.order is not None:
            self.order.watch(client_id, self._round_waiting)

    def send(self, s: Send) -> Ticket:
        if self.held is None:
            return Ticket(self.transport.publish_seq(s.topic, s.payload, qos=1))
        ticket = Ticket()
        self._due.append(ticket)  # before it is submitted: the sender pops tickets in its (FIFO) order
        self.held.submit(s.topic, s.payload, 1, s.not_before)
        return ticket

    def acknowledged(self, ticket: Ticket) -> bool:
        """The broker has the message (QoS 1's PUBACK came)."""
        return ticket.seq is not None and self.transport.acknowledged(ticket.seq)

    def _release(self, topic: str, payload: bytes, qos: int) -> None:
        """A held message's time came (the sender's thread)."""
        ticket = self._due.popleft()
        ticket.seq = self.transport.publish_seq(topic, payload, qos=qos)

    def close(self) -> None:
        """What is held back (the last metrics) goes out first."""
        if self.held is not None:
            self.held.close()

    @contextlib.contextmanager
    def round(self, recv_t: float) -> Iterator[None]:
        """A round message that came off the wire at `recv_t` being handled: in simulation its uploads leave in
        emulated order, due from its start."""
        if self.order is None:
            yield
            return
        self.order.arrived(self.client_id, self.clock.start(recv_t) if self.clock is not None else recv_t)
        try:
            yield
        finally:
            self.order.done(self.client_id)

    def _round_waiting(self) -> float | None:
        """When the round message waiting in the inbox, not yet handled, arrived (None: none waits)."""
        topic = self.round_topic
        recv_t = self.transport.arrived.get(topic) if self.transport.waiting(topic) else None
        return None if recv_t is None or self.clock is None else self.clock.start(recv_t)


class Retry:
    """The latest round message handled (to give it again) and how often it failed."""

    def __init__(self, retry_s: float, max_attempts: int) -> None:
        self.retry_s, self.max_attempts = retry_s, max_attempts
        self.last: tuple[str, bytes] | None = None  # (topic, payload)
        self.attempts = 0
        self.at = 0.0  # when to give it again (monotonic s; 0: no retry planned)

    def seen(self, message: tuple[str, bytes]) -> None:
        """A round message handled (not one whose uploads only went again): a new one is tried afresh."""
        if message != self.last:
            self.last, self.attempts = message, 0

    def failed(self, failure: Failure, now: float) -> tuple[str, str]:
        """Plan the next try of the failed round (if any is left); (our presence state, what it says)."""
        self.attempts += 1
        retry = self.attempts < self.max_attempts
        detail = f"round {failure.round} {failure.phase} failed ({failure.reason}); " + (
            f"retry {self.attempts}/{self.max_attempts - 1} in {self.retry_s:.0f} s" if retry else "giving up"
        )
        self.at = now + self.retry_s if retry else 0.0
        return ("online" if retry else GAVE_UP), detail

    def due(self, now: float) -> tuple[str, bytes] | None:
        """The round message to give again now, if a retry is due."""
        if not self.at or now < self.at or self.last is None:
            return None
        self.at = 0.0
        return self.last

    def reset(self) -> None:
        self.last, self.attempts, self.at = None, 0, 0.0

"""A deterministic in-process broker for simulation.

Publishing only enqueues; `pump()` delivers in FIFO order until the queue is empty. That keeps
handlers from recursing into each other (an agent's upload closing a round that publishes the next
round that an agent handles ...) and makes a simulation's message order reproducible.

A client's `InProcessTransport` is also a whole `Connection` (base.py), so a service runs over it as over
MQTT: its `pump` delivers the broker's queue (every client's: there is one thread), a message is acknowledged
once its handlers returned (there is nothing to acknowledge), and `before_ack` runs after each batch.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from protofl.transport.base import Handler, topic_matches


@dataclass
class _Subscription:
    pattern: str
    handler: Handler
    owner: InProcessTransport


@dataclass
class InProcessBroker:
    retained: dict[str, bytes] = field(default_factory=dict)
    _subs: list[_Subscription] = field(default_factory=list)
    _queue: deque = field(default_factory=deque)
    delivered: int = 0
    _turns: dict[str, int] = field(default_factory=dict)  # shared subscription group -> next member

    def connect(self, name: str) -> InProcessTransport:
        return InProcessTransport(self, name)

    def _publish(self, topic: str, payload: bytes, retain: bool) -> None:
        if retain:
            # MQTT: an empty retained payload clears the retained message.
            if payload:
                self.retained[topic] = payload
            else:
                self.retained.pop(topic, None)
        groups: dict[str, list[_Subscription]] = {}
        for sub in list(self._subs):
            if sub.owner.closed:
                continue
            group, pattern = _shared(sub.pattern)
            if topic_matches(pattern, topic):
                if group is None:
                    self._queue.append((sub, topic, payload))
                else:
                    groups.setdefault(group, []).append(sub)
        # MQTT 5 shared subscription `$share/group/filter`: each message to one member of the group, in turn.
        for group, members in groups.items():
            turn = self._turns.get(group, 0)
            self._turns[group] = turn + 1
            self._queue.append((members[turn % len(members)], topic, payload))

    def _subscribe(self, sub: _Subscription) -> None:
        self._subs.append(sub)
        if _shared(sub.pattern)[0] is not None:
            return  # MQTT 5: retained messages are not sent to a shared subscription
        for topic, payload in list(self.retained.items()):
            if topic_matches(sub.pattern, topic):
                self._queue.append((sub, topic, payload))

    def pump(self, max_messages: int | None = None) -> int:
        """Deliver queued messages; returns how many were delivered."""
        n = 0
        while self._queue and (max_messages is None or n < max_messages):
            sub, topic, payload = self._queue.popleft()
            if sub.owner.closed:
                continue
            sub.handler(topic, payload)
            n += 1
        self.delivered += n
        return n

    @property
    def pending(self) -> int:
        return len(self._queue)


class InProcessTransport:
    """One client's connection to an `InProcessBroker` (connected from the start)."""

    def __init__(self, broker: InProcessBroker, name: str) -> None:
        self.broker = broker
        self.name = name
        self.closed = False
        self.manual_ack = True  # delivered synchronously: nothing is acknowledged before its handlers returned
        self.before_ack: Callable[[], None] | None = None
        self.resume_session = False  # the broker's state is the process's: there is no session to take up

    @property
    def url(self) -> str:
        return f"inprocess://{self.name}"

    @property
    def connected(self) -> bool:
        return not self.closed

    @property
    def connects(self) -> int:
        return 1

    def connect(self, timeout: float = 30.0) -> InProcessTransport:
        return self

    def publish(self, topic: str, payload: bytes, *, retain: bool = False, qos: int = 1) -> None:
        if self.closed:
            raise RuntimeError(f"transport '{self.name}' is closed")
        self.broker._publish(topic, payload, retain)

    def subscribe(self, pattern: str, handler: Handler) -> None:
        self.broker._subscribe(_Subscription(pattern, handler, self))

    def pump(self, timeout: float = 0.0, max_messages: int = 1000) -> int:
        """Deliver up to `max_messages` of the broker's queue; with nothing queued, wait `timeout` (nothing can
        arrive meanwhile: the broker has one thread), as a connection waits for its next message."""
        n = self.broker.pump(max_messages)
        if n and self.before_ack is not None:
            self.before_ack()
        elif not n and timeout > 0:
            time.sleep(timeout)
        return n

    def close(self, timeout: float = 5.0, send_will: bool = False) -> None:
        self.closed = True


def _shared(pattern: str) -> tuple[str | None, str]:
    """(group, filter) of a `$share/group/filter` subscription; (None, pattern) for any other."""
    if pattern.startswith("$share/"):
        _, group, rest = pattern.split("/", 2)
        return group, rest
    return None, pattern

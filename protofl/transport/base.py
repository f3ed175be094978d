"""The transport interface and MQTT-style topic matching."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

Handler = Callable[[str, bytes], None]


class Transport(Protocol):
    """Publish/subscribe of byte payloads with MQTT semantics (retained messages, `+`/`#` filters): what an agent,
    the aggregator's shell and a shard need of their connection."""

    def publish(self, topic: str, payload: bytes, *, retain: bool = False, qos: int = 1) -> None: ...

    def subscribe(self, pattern: str, handler: Handler) -> None: ...

    def close(self) -> None: ...


class Connection(Transport, Protocol):
    """A transport that a service owns and drives from its one thread (the aggregator service, a shard service):
    it is connected once, delivers what arrived on that thread when pumped, says whether (and how often) it got a
    connection, and lets the service make a batch durable before any of it is acknowledged. The service is handed
    one (built by its CLI: `service.server_transport`, `shard_service.shard_transport`); `MqttTransport` (real runs)
    and `InProcessTransport` (tests, one-process runs) are ones.

    - `manual_ack`: a message is acknowledged only after its handlers returned (and `before_ack`), so what a handler
      made durable first is all that is acknowledged: a durable service refuses a connection without it.
    - `before_ack`: called once per pumped batch before its acknowledgements (group commit: one fsync a batch).
    - `resume_session`: the first connection takes up the broker session a previous process left (set before
      `connect`, by a service that resumed from its state dir).
    - `connects`: connections made so far; one more than last seen means the broker connection came back."""

    manual_ack: bool
    before_ack: Callable[[], None] | None
    resume_session: bool

    @property
    def url(self) -> str: ...

    @property
    def connected(self) -> bool: ...

    @property
    def connects(self) -> int: ...

    def connect(self, timeout: float = 30.0) -> Connection: ...

    def pump(self, timeout: float = 0.0, max_messages: int = 1000) -> int: ...

    def close(self, timeout: float = 5.0, send_will: bool = False) -> None: ...


def topic_matches(pattern: str, topic: str) -> bool:
    """MQTT filter matching: `+` one level, `#` the rest (including the parent level)."""
    p_parts = pattern.split("/")
    t_parts = topic.split("/")
    for i, part in enumerate(p_parts):
        if part == "#":
            return True
        if i >= len(t_parts):
            return False
        if part != "+" and part != t_parts[i]:
            return False
    return len(p_parts) == len(t_parts)

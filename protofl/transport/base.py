"""The transport interface and MQTT-style topic matching."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

Handler = Callable[[str, bytes], None]


class Transport(Protocol):
    """Publish/subscribe of byte payloads with MQTT semantics (retained messages, `+`/`#` filters)."""

    def publish(self, topic: str, payload: bytes, *, retain: bool = False, qos: int = 1) -> None: ...

    def subscribe(self, pattern: str, handler: Handler) -> None: ...

    def close(self) -> None: ...


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

"""Transports move opaque bytes between topics; they know nothing of prototypes or adapters.

`Transport` is the one interface; `InProcessBroker` (fast simulation) and the MQTT client
(real runs) implement it, so the same agent and aggregator objects run over either.
"""

from protofl.transport.base import Handler, Transport, topic_matches
from protofl.transport.inprocess import InProcessBroker, InProcessTransport

__all__ = ["Handler", "Transport", "topic_matches", "InProcessBroker", "InProcessTransport"]

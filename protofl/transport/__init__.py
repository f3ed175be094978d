"""Transports move opaque bytes between topics; they know nothing of prototypes or adapters.

`Transport` is the one interface (publish, subscribe), and `Connection` the whole of it that a service drives
(connect, pump, acknowledgements); `InProcessBroker` (fast simulation) and the MQTT client (real runs) implement
both, so the same agent, aggregator and services run over either.
"""

from protofl.transport.base import Connection, Handler, Transport, topic_matches
from protofl.transport.inprocess import InProcessBroker, InProcessTransport

__all__ = ["Connection", "Handler", "Transport", "topic_matches", "InProcessBroker", "InProcessTransport"]

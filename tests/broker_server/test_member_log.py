"""What a member writes reaches the server's log bounded, on one line, and at most 30 lines a minute (issue 43)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from broker_server.core.member_log import LINES_PER_MINUTE, MemberLog
from protofl.errors import WireError
from protofl.names import MAX_LABEL, MAX_TEXT, printable
from protofl.wire import Envelope, Join, Metrics, Status, decode_message, pack_envelope


def test_printable_keeps_a_line_one_line_and_short() -> None:
    assert printable("round 3 failed: out of memory") == "round 3 failed: out of memory"
    assert printable("a\nb\r\x1b[2J\u2028c\u202ed") == "a?b??[2J?c?d"
    long = printable("x" * 10_000, 50)
    assert long == "x" * 50 + "... (10000 characters)"


def test_member_log_allows_its_lines_per_minute_then_counts_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    limited = MemberLog(logging.getLogger("test.member_log"), clock=lambda: now[0])
    with caplog.at_level(logging.INFO, "test.member_log"):
        logged = [limited(logging.WARNING, "dev-a", "line %d", i) for i in range(1000)]
        assert sum(logged) == LINES_PER_MINUTE
        assert limited(logging.WARNING, "dev-b", "another member")  # each member has its own
        now[0] = 61.0
        assert limited(logging.WARNING, "dev-a", "after a minute")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == LINES_PER_MINUTE + 3
    assert messages[-2].startswith(f"{1000 - LINES_PER_MINUTE} more log line(s) about dev-a in 61 s were left out")
    assert messages[-1] == "after a minute"
    assert limited.left_out == 1000 - LINES_PER_MINUTE


def test_member_strings_are_bounded_on_the_wire() -> None:
    def status(detail: str) -> bytes:
        return pack_envelope(Envelope(1, "status", "f", 0, "", "d", "m", {"state": "online", "detail": detail}))

    assert isinstance(decode_message(status("x" * MAX_TEXT))[1], Status)
    with pytest.raises(WireError, match="detail: 1025 characters"):
        decode_message(status("x" * (MAX_TEXT + 1)))
    with pytest.raises(WireError, match="arch"):
        Join(arch="a" * (MAX_LABEL + 1), n_samples=1)
    with pytest.raises(WireError, match="extra key"):
        Metrics(n_local=1, correct_local=0, n_test=1, correct_test=0, extra={"k" * (MAX_LABEL + 1): 1.0})
    with pytest.raises(WireError, match="keys, over the limit"):
        Metrics(n_local=1, correct_local=0, n_test=1, correct_test=0, extra={f"k{i}": 1.0 for i in range(257)})
    ok = Metrics(n_local=1, correct_local=0, n_test=1, correct_test=0, extra={"acc": float(np.float32(0.5))})
    assert ok.extra == {"acc": 0.5}


def test_the_transport_holds_a_bounded_backlog_per_topic() -> None:
    import paho.mqtt.client as paho

    from protofl.transport.mqtt import INBOX_TOPIC_BYTES, INBOX_TOPIC_MESSAGES, MqttTransport

    t = MqttTransport("mqtt://127.0.0.1:1", "server", deliver="pump", manual_ack=True)

    def arrive(topic: str, nbytes: int, qos: int = 0) -> None:
        msg = paho.MQTTMessage(mid=1, topic=topic.encode())
        msg.payload, msg.qos = b"x" * nbytes, qos
        t._on_message(t._client, None, msg)

    for _ in range(2000):  # 2000 x 60 KB from one member: 117 MiB, never handled meanwhile
        arrive("fed/up/dev-a", 60_000)
    arrive("fed/up/dev-b", 60_000)  # another member is not held up by it
    for _ in range(INBOX_TOPIC_MESSAGES):  # a few messages of any size always wait
        arrive("fed/up/dev-c", 30 * 2**20)
    kept = t._inbox.qsize()
    assert kept <= INBOX_TOPIC_BYTES // 60_000 + 1 + 1 + INBOX_TOPIC_MESSAGES
    assert t.stats.inbox_dropped == 2000 - (INBOX_TOPIC_BYTES // 60_000)
    arrive("fed/up/dev-a", 60_000, qos=1)  # over the bound at QoS 1: only its acknowledgement waits
    handled: list[bytes] = []
    t.subscribe("fed/up/+", lambda topic, payload: handled.append(payload))
    acks: list[tuple[int, int, int]] = []

    def ack(mid: int, qos: int) -> paho.MQTTErrorCode:
        acks.append((mid, qos, 0))
        return paho.MQTTErrorCode.MQTT_ERR_SUCCESS

    t._client.ack = ack  # type: ignore[method-assign]
    while t.pump(max_messages=10_000):
        pass
    assert len(handled) == kept and acks == [(1, 1, 0)]
    arrive("fed/up/dev-a", 60_000)  # drained: its next message is taken
    assert t._inbox.qsize() == 1


def test_the_transport_holds_a_bounded_backlog_in_all() -> None:
    """Many members each within their topic's bound add up: the inbox's total is bounded too (QoS 0 floods), while
    a QoS 1 message the server acknowledges itself still waits (the broker's in-flight window bounds those)."""
    import paho.mqtt.client as paho

    from protofl.transport.mqtt import MqttTransport

    t = MqttTransport("mqtt://127.0.0.1:1", "server", deliver="pump", manual_ack=True)
    t.inbox_total_bytes = 4 * 2**20

    def arrive(topic: str, nbytes: int, qos: int = 0) -> None:
        msg = paho.MQTTMessage(mid=1, topic=topic.encode())
        msg.payload, msg.qos = b"x" * nbytes, qos
        t._on_message(t._client, None, msg)

    for member in range(200):  # 200 members x 10 x 60 KB at QoS 0: 114 MiB, each topic inside its own bound
        for _ in range(10):
            arrive(f"fed/metrics/dev-{member}", 60_000)
    assert t._held_total <= t.inbox_total_bytes
    assert t.stats.inbox_dropped == 2000 - t.inbox_total_bytes // 60_000
    arrive("fed/up/dev-0", 60_000, qos=1)  # a round's upload is not cut by the flood
    assert t._held_total > t.inbox_total_bytes
    handled: list[str] = []
    t.subscribe("fed/+/+", lambda topic, payload: handled.append(topic))
    t._client.ack = lambda mid, qos: paho.MQTTErrorCode.MQTT_ERR_SUCCESS  # type: ignore[method-assign]
    while t.pump(max_messages=10_000):
        pass
    assert handled[-1] == "fed/up/dev-0" and t._held_total == 0

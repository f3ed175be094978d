"""Membership (issue 14): presence / last will, --max-clients, strangers cost nothing."""

from __future__ import annotations

import socket
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np

from broker_server.core.rounds import OFFLINE_GRACE_S
from broker_server.core.shell import Aggregator
from broker_server.ops.broker import MosquittoBroker
from broker_server.ops.security import load_or_create
from broker_server.service import AggregatorService, server_transport
from broker_server.settings import Admission, Broker, Federation
from protofl import topics
from protofl.presets import make_config
from protofl.transport import InProcessBroker
from protofl.transport.broker_url import parse_broker_url
from protofl.wire import Join, Message, ProtoSet, ProtoUpload, Status, encode_message

FED = "mem"


def federation(n_expected: int | None = None, **kw: object) -> tuple[InProcessBroker, Aggregator]:
    cfg = make_config(
        "fedproto", rounds=3, num_classes=2, proto_dim=2, adapter_rank=1, min_clients=2, round_timeout=60.0
    )
    broker = InProcessBroker()
    agg = Aggregator(cfg, FED, broker.connect("server"), clock=lambda: 0.0, **kw)  # type: ignore[arg-type]
    agg.start()
    return broker, agg


def send(broker: InProcessBroker, cid: str, msg: Message, round_: int = 0, phase: str = "", topic: str = "") -> None:
    payload = encode_message(msg, fed=FED, sender=cid, round=round_, phase=phase)
    broker.connect(cid).publish(topic or topics.up(FED, cid), payload)
    broker.pump()


def upload(broker: InProcessBroker, cid: str, round_: int) -> None:
    ps = ProtoSet(classes=np.array([0]), values=np.ones((1, 2), np.float32), counts=np.array([3]))
    send(broker, cid, ProtoUpload(local=ps, public=None, n_samples=3), round_, "train")


def presence(broker: InProcessBroker, cid: str, state: str) -> None:
    send(broker, cid, Status(state=state, detail=""), topic=topics.presence(FED, cid))


def test_an_offline_device_leaves_the_round_which_closes_at_quorum_and_it_comes_back() -> None:
    broker, agg = federation()
    for c in ("a", "b", "c"):
        send(broker, c, Join(arch="cnn", n_samples=3))
    assert agg.round == 1
    upload(broker, "a", 1)
    upload(broker, "b", 1)
    assert agg.round == 1  # still waiting for c
    presence(broker, "c", "offline")  # c's last will: it keeps its place for the grace period
    assert agg.round == 1
    agg.tick(now=OFFLINE_GRACE_S)  # still offline when the grace runs out: the round stops waiting for it
    assert agg.round == 2 and agg.records[0].closed_by == "quorum" and agg.records[0].clients == ["a", "b"]
    assert agg.machine.phase is not None and agg.machine.phase.expected == {"a", "b"}
    presence(broker, "c", "online")  # reconnected: expected again in the open round
    assert agg.machine.phase.expected == {"a", "b", "c"}
    for c in ("a", "b", "c"):
        upload(broker, c, 2)
    assert agg.records[1].clients == ["a", "b", "c"]
    # Someone else's presence, or a stranger's, changes nothing.
    send(broker, "a", Status(state="offline", detail=""), topic=topics.presence(FED, "b"))
    presence(broker, "zz", "offline")
    assert set(agg.clients) == {"a", "b", "c"} and agg.dropped == {"invalid": 1}


def waiting_for_c() -> tuple[InProcessBroker, Aggregator]:
    """Round 1 of a, b and c, with a's and b's uploads in: it waits for c."""
    broker, agg = federation()
    for c in ("a", "b", "c"):
        send(broker, c, Join(arch="cnn", n_samples=3))
    upload(broker, "a", 1)
    upload(broker, "b", 1)
    return broker, agg


def test_a_revoked_device_leaves_at_once_and_what_it_sent_after_is_dropped_and_counted() -> None:
    from broker_server.ops.enrol import revoked_presence

    broker, agg = waiting_for_c()
    agg.on_presence(topics.presence(FED, "c"), revoked_presence(FED, "c"))  # as a fleet's run server says it
    # No grace: the round closes at quorum without it at once.
    assert agg.round == 2 and agg.records[0].closed_by == "quorum" and agg.records[0].clients == ["a", "b"]
    assert "c" not in agg.clients and agg.machine.phase is not None and agg.machine.phase.expected == {"a", "b"}
    upload(broker, "c", 2)  # an upload the broker had queued when it cut the device off
    assert agg.dropped == {"unknown_client": 1}
    upload(broker, "a", 2)
    upload(broker, "b", 2)
    assert agg.records[1].clients == ["a", "b"]


def test_a_device_back_within_the_grace_keeps_its_place() -> None:
    # A flaky link: the connection drops (last will), the device reconnects at once and delivers.
    broker, agg = waiting_for_c()
    presence(broker, "c", "offline")
    presence(broker, "c", "online")
    agg.tick(now=10 * OFFLINE_GRACE_S)
    assert agg.round == 1 and agg.machine.phase is not None and agg.machine.phase.expected == {"a", "b", "c"}
    upload(broker, "c", 1)
    assert agg.records[0].clients == ["a", "b", "c"] and agg.records[0].closed_by == "quorum"


def test_max_clients_holds_under_2000_valid_joins_at_bounded_memory() -> None:
    broker, agg = federation(max_clients=5)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i in range(2000):
        send(broker, f"dev-{i}", Join(arch="cnn", n_samples=3))
    grown = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert sorted(agg.clients) == [f"dev-{i}" for i in range(5)]
    assert agg.dropped == {"max_clients": 1995}
    # What is left is the 5 joins and the drop counter, not 2000 joins (~0.4 KB each): well under 200 KB,
    # most of it the in-process broker's per-connection objects of this test.
    assert grown < 600_000, grown
    send(broker, "dev-0", Join(arch="cnn", n_samples=3))  # a member joining again is no new client
    assert len(agg.clients) == 5


def test_2000_joins_with_invalid_credentials_change_nothing(
    start_mosquitto: Callable[..., MosquittoBroker], tmp_path: Path
) -> None:
    auth = load_or_create(tmp_path / "sec", FED, ["dev-a"])
    broker = start_mosquitto(persistence=False, allow_anonymous=False, extra_config=auth.mosquitto_lines())
    cfg = make_config("fedproto", rounds=1, num_classes=2, proto_dim=2, adapter_rank=1, min_clients=1)
    server = parse_broker_url(broker.url).with_auth(auth.secrets.server.username, auth.secrets.server.password)
    service = AggregatorService(
        Federation(cfg, FED), server_transport(Broker(server), FED), admission=Admission(sorted(auth.secrets.devices))
    )
    service.start(connect_timeout=10)
    rss = _rss(broker)
    refused = 0
    try:
        for i in range(2000):
            refused += _connect_refused(broker.port, f"fake-{i}", "wrong")
        service.step(0.2)
        assert refused == 2000
        assert service.aggregator.clients == {} and service.aggregator.dropped == {}
        assert service.aggregator.round == 0
        assert _rss(broker) - rss < 4 * 2**20  # the broker kept nothing of them
    finally:
        service.close()


def _connect_refused(port: int, user: str, password: str) -> bool:
    """A raw MQTT 3.1.1 CONNECT with a user name and password; True if the broker refused it."""

    def s(x: str) -> bytes:
        return struct.pack("!H", len(x)) + x.encode()

    body = s("MQTT") + bytes([4, 0xC2]) + struct.pack("!H", 30) + s(user) + s(user) + s(password)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(bytes([0x10, len(body)]) + body)
        ack = sock.recv(4)
    return len(ack) == 4 and ack[0] == 0x20 and ack[3] in (4, 5)  # bad user name or password / not authorized


def _rss(broker: MosquittoBroker) -> int:
    assert broker.proc is not None
    for line in Path(f"/proc/{broker.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0

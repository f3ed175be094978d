"""The MQTT transport against a real Mosquitto (MQTT 5) and the embedded amqtt broker (3.1.1)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from broker_server.ops.broker import AmqttBroker, LocalBroker, MosquittoBroker, free_port
from protofl.errors import ConfigError
from protofl.transport.broker_url import BrokerOptions, parse_broker_url
from protofl.transport.mqtt import Backoff, MqttTransport, PayloadTooLarge, TransportError, Will, packet_size
from tests.conftest import EVENT_WAIT_S


class Inbox:
    """Collects (topic, payload) from a handler; `wait_for` polls with a deadline."""

    def __init__(self) -> None:
        self.items: list[tuple[str, bytes]] = []
        self.lock = threading.Lock()

    def __call__(self, topic: str, payload: bytes) -> None:
        with self.lock:
            self.items.append((topic, payload))

    def wait_for(self, pred: Callable[[list[tuple[str, bytes]]], bool], timeout: float = EVENT_WAIT_S) -> list:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                if pred(self.items):
                    return list(self.items)
            time.sleep(0.02)
        raise AssertionError(f"timed out; got {self.items}")


def fast_backoff() -> Backoff:
    return Backoff(initial=0.05, maximum=0.5)


# -- URLs and options (no broker) ----------------------------------------------------------------


def test_broker_urls() -> None:
    assert parse_broker_url("mqtt://example.org").port == 1883
    o = parse_broker_url("mqtts://dev%40lab:s3cret@broker.local")
    assert (o.host, o.port, o.tls, o.username, o.password) == ("broker.local", 8883, True, "dev@lab", "s3cret")
    assert o.url == "mqtts://broker.local:8883"  # never prints the password
    assert parse_broker_url("10.0.0.5:1884").url == "mqtt://10.0.0.5:1884"
    for bad, words in (
        ("http://x", "scheme must be mqtt://, mqtts:// or unix://"),
        ("mqtt://x:99999", "port"),
        ("mqtt://x/topic", "no path"),
        ("mqtt://", "no host"),
        ("unix://sock", "unix:///absolute"),
    ):
        with pytest.raises(ConfigError, match=words):
            parse_broker_url(bad)


def test_unix_socket_urls_and_the_federation_ca(tmp_path) -> None:
    # The server's own connection to its broker: a socket path, no TLS (its directory keeps others out).
    o = parse_broker_url("unix:///var/lib/protofl/broker/mosquitto.sock").with_auth("srv", "pw")
    assert (o.unix_path, o.url, o.username) == (
        "/var/lib/protofl/broker/mosquitto.sock",
        "unix:///var/lib/protofl/broker/mosquitto.sock",
        "srv",
    )
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    with pytest.raises(ConfigError, match="unix socket connection takes no TLS"):
        o.with_auth(tls_ca=str(ca))
    # A device's credentials file carries the federation CA: TLS on, names not matched, --tls-ca wins.
    dev = parse_broker_url("mqtt://10.0.0.5:1883").with_federation_ca("PEM", "--credentials d.json")
    assert dev.tls and not dev.tls_check_hostname and dev.url == "mqtts://10.0.0.5:1883"
    assert dev.ca_description == "the federation CA in --credentials d.json"
    own = parse_broker_url("mqtts://h").with_auth(tls_ca=str(ca)).with_federation_ca("PEM", "d.json")
    assert own.tls_ca_pem is None and own.tls_check_hostname and own.ca_description == f"the CA of --tls-ca {ca}"


def test_auth_and_tls_options_are_checked(tmp_path) -> None:
    with pytest.raises(ConfigError, match="--tls-ca .*no such file"):
        BrokerOptions().with_auth(tls_ca=str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigError, match="--password given without --username"):
        BrokerOptions().with_auth(password="x")
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    with pytest.raises(ConfigError, match="both --tls-cert and --tls-key"):
        BrokerOptions().with_auth(tls_cert=str(ca))
    o = BrokerOptions().with_auth(username="u", password="p", tls_ca=str(ca))
    assert o.tls and o.url.startswith("mqtts://") and o.username == "u"


def test_backoff_grows_with_jitter_and_caps() -> None:
    b = Backoff(initial=1.0, maximum=8.0, jitter=0.5)
    delays = [b.next() for _ in range(6)]
    # attempt n waits initial * 2**n (capped at 8) times a factor in [0.5, 1]
    for n, d in enumerate(delays):
        base = min(8.0, 2.0**n)
        assert base * 0.5 <= d <= base
    b.reset()
    assert b.next() <= 1.0


def test_packet_size_counts_header_topic_and_packet_id() -> None:
    # 1 type byte + 1 length byte + (2 + 3 topic + 2 packet id + 5 payload) = 14
    assert packet_size("a/b", 5, qos=1, mqtt5=False) == 14
    assert packet_size("a/b", 5, qos=1, mqtt5=True) == 15  # + property length
    assert packet_size("a/b", 200, qos=0, mqtt5=False) == 1 + 2 + 205  # two length bytes


def test_unreachable_broker_says_what_to_do() -> None:
    port = free_port()
    t = MqttTransport(f"mqtt://127.0.0.1:{port}", "lonely", backoff=fast_backoff())
    with pytest.raises(
        TransportError,
        match=rf"cannot reach broker at mqtt://127.0.0.1:{port}: .*refused.*"
        r"is it running\? \(start one with protofl-server start\)",
    ):
        t.connect(timeout=1.0)


# -- against real brokers ------------------------------------------------------------------------


@pytest.fixture(params=["mosquitto", "amqtt"])
def broker(request: pytest.FixtureRequest) -> Iterator[LocalBroker]:
    if request.param == "mosquitto":
        yield request.getfixturevalue("mosquitto")
    else:
        b = AmqttBroker().start()
        yield b
        b.stop()


def test_pubsub_retained_and_wildcards(broker: LocalBroker) -> None:
    inbox = Inbox()
    pub = MqttTransport(broker.url, "pub", backoff=fast_backoff()).connect(10)
    # amqtt only speaks 3.1.1: "auto" must fall back by itself (it refuses or ignores an MQTT 5 CONNECT)
    assert pub.protocol == ("5" if broker.kind == "mosquitto" else "3.1.1")
    pub.publish("t/fed/config", b"cfg", retain=True)
    assert pub.flush(5)
    sub = MqttTransport(broker.url, "sub", deliver="pump", backoff=fast_backoff()).connect(10)
    sub.subscribe("t/fed/+", inbox)

    def pump_until(n: int) -> None:
        end = time.monotonic() + 10
        while len(inbox.items) < n and time.monotonic() < end:
            sub.pump(0.1)

    pump_until(1)  # the retained message proves the subscription is in place at the broker
    pub.publish("t/fed/up", b"\x00\x01binary")
    pub.publish("t/other/up", b"not for us")
    pump_until(2)
    assert inbox.items == [("t/fed/config", b"cfg"), ("t/fed/up", b"\x00\x01binary")]
    pub.close()
    sub.close()


def test_oversize_payload_is_refused_before_sending(start_mosquitto: Callable[..., MosquittoBroker]) -> None:
    broker = start_mosquitto(max_packet_size=4096, persistence=False)
    inbox = Inbox()
    t = MqttTransport(broker.url, "big", backoff=fast_backoff()).connect(10)
    assert t.max_packet_size == 4096  # advertised by mosquitto in CONNACK (MQTT 5)
    t.subscribe("x/#", inbox)
    with pytest.raises(PayloadTooLarge, match=r"over the broker's maximum packet size of 4096 bytes"):
        t.publish("x/big", b"\x00" * 5000)
    t.publish("x/small", b"ok")  # still connected: the oversize packet never left
    inbox.wait_for(lambda items: ("x/small", b"ok") in items)
    assert t.stats.disconnects == 0
    t.close()


def test_slow_handler_does_not_block_the_network_loop(mosquitto: MosquittoBroker) -> None:
    release = threading.Event()
    seen = threading.Event()

    def slow(topic: str, payload: bytes) -> None:
        seen.set()
        release.wait(10)  # a training step that takes a while

    t = MqttTransport(mosquitto.url, "slow", deliver="thread", backoff=fast_backoff()).connect(10)
    t.subscribe("s/#", slow)
    t.publish("s/go", b"1")
    assert seen.wait(EVENT_WAIT_S)
    # While the handler is busy, QoS 1 publishes are still acknowledged: the network loop runs on.
    for _ in range(20):
        t.publish("s/more", b"x")
    assert t.flush(5)
    release.set()
    t.close()


def test_reconnect_resubscribes_and_reasserts_retained(start_mosquitto: Callable[..., MosquittoBroker]) -> None:
    broker = start_mosquitto(persistence=False)  # a restart forgets retained messages and sessions
    inbox = Inbox()
    will = Will("r/status", b"offline")
    owner = MqttTransport(broker.url, "owner", will=will, backoff=fast_backoff()).connect(10)
    owner.publish("r/config", b"v1", retain=True)
    owner.publish("r/status", b"online", retain=True)
    watcher = MqttTransport(broker.url, "watcher", backoff=fast_backoff()).connect(10)
    watcher.subscribe("r/#", inbox)
    inbox.wait_for(lambda items: len(items) == 2)

    broker.restart()  # same port; every client has to find its way back alone
    assert owner.wait_connected(15) and watcher.wait_connected(15)
    # The watcher gets the re-asserted retained messages again (live or on re-subscribing): both ways
    # prove its subscription is back.
    inbox.wait_for(lambda items: len(items) >= 4)
    late = Inbox()
    newcomer = MqttTransport(broker.url, "newcomer", backoff=fast_backoff()).connect(10)
    newcomer.subscribe("r/#", late)
    # The owner re-published its retained messages; the watcher's subscription survived.
    late.wait_for(lambda items: {("r/config", b"v1"), ("r/status", b"online")} <= set(items))
    owner.publish("r/event", b"after restart")
    inbox.wait_for(lambda items: ("r/event", b"after restart") in items)
    assert owner.stats.connects == 2 and watcher.stats.connects == 2
    for t in (owner, watcher, newcomer):
        t.close()


def test_closed_transport_refuses_to_publish(mosquitto: MosquittoBroker) -> None:
    t = MqttTransport(mosquitto.url, "short-lived").connect(10)
    t.close()
    with pytest.raises(TransportError, match="closed"):
        t.publish("a", b"b")


def test_refused_credentials_say_so(start_mosquitto: Callable[..., MosquittoBroker]) -> None:
    broker = start_mosquitto(persistence=False, allow_anonymous=False)
    t = MqttTransport(parse_broker_url(broker.url).with_auth(username="dev"), "anon", backoff=fast_backoff())
    with pytest.raises(
        TransportError,
        match=r"refused the connection \((Not authorized|Bad user name or password)\); "
        r"check --username/--password",
    ):
        t.connect(timeout=2.0)


def test_a_receive_maximum_widens_the_window_of_unacknowledged_deliveries(mosquitto: MosquittoBroker) -> None:
    # Issue 48: the server acknowledges an upload only after its journal's group commit; the broker delivers at
    # most its max_inflight_messages (20) unacknowledged unless the MQTT 5 CONNECT asks for more, so one fsync
    # covered at most 20 uploads. Asking 100: 100 are delivered before any is acknowledged.
    reader = MqttTransport(
        mosquitto.url, "reader", deliver="pump", manual_ack=True, receive_maximum=100, backoff=fast_backoff()
    ).connect(10)
    reader.before_ack = lambda: None
    reader.subscribe("w/#", lambda _t, _p: None)
    sender = MqttTransport(mosquitto.url, "sender", backoff=fast_backoff()).connect(10)
    try:
        for i in range(150):
            sender.publish(f"w/{i}", b"x")
        end = time.monotonic() + 15
        while reader._inbox.qsize() < 100 and time.monotonic() < end:
            time.sleep(0.01)
        assert reader._inbox.qsize() >= 100, f"{reader._inbox.qsize()} delivered unacknowledged"
        assert reader.pump(max_messages=1000) >= 100  # acknowledged now: the rest follow
    finally:
        sender.close()
        reader.close()
    with pytest.raises(ValueError, match="1 to 65535"):
        MqttTransport(mosquitto.url, "bad", receive_maximum=0)

"""The generated credentials, password file and ACL, against a real Mosquitto (issue 14's probes)."""

from __future__ import annotations

import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from broker_server.ops.broker import MosquittoBroker
from broker_server.ops.security import FederationSecrets, load_or_create, mosquitto_hash, read_allow_list, server_user
from protofl import topics
from protofl.errors import ConfigError
from protofl.transport.broker_url import parse_broker_url
from protofl.transport.credentials import read_device_credentials
from protofl.transport.mqtt import Backoff, MqttTransport, TransportError
from tests.conftest import EVENT_WAIT_S

FED = "sec"


class Inbox:
    def __init__(self) -> None:
        self.got: list[tuple[str, bytes]] = []
        self.cv = threading.Condition()

    def __call__(self, topic: str, payload: bytes) -> None:
        with self.cv:
            self.got.append((topic, payload))
            self.cv.notify_all()

    def wait_for(self, payload: bytes, timeout: float = EVENT_WAIT_S) -> None:
        end = time.monotonic() + timeout
        with self.cv:
            while not any(p == payload for _, p in self.got):
                if not self.cv.wait(max(0.0, end - time.monotonic())):
                    raise AssertionError(f"{payload!r} not received; got {self.got}")

    def payloads(self) -> list[bytes]:
        with self.cv:
            return [p for _, p in self.got]


def connect(url: str, user: str | None, password: str | None, timeout: float = 5) -> MqttTransport:
    opts = parse_broker_url(url).with_auth(user, password)
    return MqttTransport(opts, user or "anon", backoff=Backoff(initial=0.1, maximum=0.5)).connect(timeout)


@pytest.fixture
def secured(start_mosquitto: Callable[..., MosquittoBroker], tmp_path: Path):
    auth = load_or_create(tmp_path / "security", FED, ["dev-a", "dev-b"])
    broker = start_mosquitto(persistence=False, allow_anonymous=False, extra_config=auth.mosquitto_lines())
    return broker, auth


def test_hash_is_mosquittos_pbkdf2_format() -> None:
    # $7$ = PBKDF2-HMAC-SHA512; a fixed salt makes the hash reproducible, 12 salt bytes -> 16 base64 chars.
    h = mosquitto_hash("secret", salt=b"\x00" * 12)
    assert h.startswith("$7$101$AAAAAAAAAAAAAAAA$") and h == mosquitto_hash("secret", salt=b"\x00" * 12)
    assert h != mosquitto_hash("secret2", salt=b"\x00" * 12)


def test_credentials_are_kept_across_restarts_and_files_are_private(tmp_path: Path) -> None:
    first = load_or_create(tmp_path / "s", FED, ["dev-a"])
    again = load_or_create(tmp_path / "s", FED, ["dev-a", "dev-b"])
    assert again.secrets.server_password == first.secrets.server_password
    assert again.secrets.devices["dev-a"] == first.secrets.devices["dev-a"]
    assert again.new_devices == ("dev-b",)
    for path in (again.password_file, tmp_path / "s" / "credentials.json", again.device_file("dev-b")):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    cred, fed = read_device_credentials(again.device_file("dev-b"))
    assert (cred.username, cred.password, fed) == ("dev-b", again.secrets.devices["dev-b"], FED)
    # The password file holds hashes only.
    assert again.secrets.devices["dev-a"] not in again.password_file.read_text()
    with pytest.raises(ConfigError, match="federation 'sec', not 'other'"):
        load_or_create(tmp_path / "s", "other")
    with pytest.raises(ConfigError, match="server's user name"):
        FederationSecrets.create(FED, [server_user(FED)])


def test_allow_list_file(tmp_path: Path) -> None:
    f = tmp_path / "allow.txt"
    f.write_text("# field devices\nrpi-07\n\njetson-1  # lab\n")
    assert read_allow_list(f) == ["rpi-07", "jetson-1"]
    f.write_text("bad/id\n")
    with pytest.raises(ConfigError, match="not a valid name"):
        read_allow_list(f)


def test_anonymous_and_wrong_password_are_refused(secured) -> None:
    broker, auth = secured
    with pytest.raises(TransportError, match="refused the connection"):
        connect(broker.url, None, None, timeout=2)
    with pytest.raises(TransportError, match="check --username/--password"):
        connect(broker.url, "dev-a", "not-the-password", timeout=2)


def test_acl_devices_write_only_their_own_topics_and_cannot_read_uploads(secured) -> None:
    broker, auth = secured
    s = auth.secrets
    server = connect(broker.url, s.server.username, s.server.password)
    dev_a = connect(broker.url, "dev-a", s.devices["dev-a"])
    dev_b = connect(broker.url, "dev-b", s.devices["dev-b"])
    try:
        at_server, at_b = Inbox(), Inbox()
        server.subscribe(f"{topics.ROOT}/{FED}/#", at_server)
        dev_b.subscribe(f"{topics.ROOT}/{FED}/up/#", at_b)  # a device trying to read others' uploads
        dev_b.subscribe(topics.server_status(FED), at_b)
        dev_b.subscribe(topics.round_(FED), at_b)
        server.publish(topics.round_(FED), b"real round", retain=True)
        # The broker handles one client's packets in order: the round reaching the server (on its own
        # subscription) and dev-b (on its last one) means every subscription above is in place.
        at_server.wait_for(b"real round")
        at_b.wait_for(b"real round")
        # dev-a impersonates dev-b and the server; the broker must drop all of it.
        dev_a.publish(topics.up(FED, "dev-b"), b"spoofed upload")
        dev_a.publish(topics.round_(FED), b"hostile round", retain=True)
        dev_a.publish(topics.config(FED), b"hostile config", retain=True)
        dev_a.publish(topics.server_status(FED), b"hostile status", retain=True)
        dev_a.publish(topics.presence(FED, "dev-b"), b"hostile presence", retain=True)
        dev_a.publish(topics.up(FED, "dev-a"), b"own upload")  # allowed; after the others, so a fence
        at_server.wait_for(b"own upload")  # dev-a's messages reach the server in the order sent
        # A fence for dev-b: the broker queues its messages in the order it handles them, and this status
        # is published after the server got dev-a's upload, so anything of dev-a's that reached dev-b
        # (its upload, the hostile status) is in its inbox before the fence.
        server.publish(topics.server_status(FED), b"fence")
        at_b.wait_for(b"fence")
        got = at_server.payloads()
        assert not {
            b"spoofed upload",
            b"hostile round",
            b"hostile config",
            b"hostile status",
            b"hostile presence",
        } & set(got), got
        # dev-b saw the real round and nothing on up/#, not even dev-a's legitimate upload.
        assert at_b.payloads() == [b"real round", b"fence"]
        # The retained round is still the server's: a new subscriber gets it.
        late = Inbox()
        dev_b.subscribe(topics.round_(FED), late)
        late.wait_for(b"real round")
        assert b"hostile round" not in late.payloads()
    finally:
        for t in (server, dev_a, dev_b):
            t.close(timeout=1)


def test_a_device_cannot_take_over_another_devices_session(secured) -> None:
    # The broker replaces the client id by the user name, so dev-a's credentials used with client id
    # "dev-b" do not disconnect dev-b.
    broker, auth = secured
    s = auth.secrets
    server = connect(broker.url, s.server.username, s.server.password)
    dev_b = connect(broker.url, "dev-b", s.devices["dev-b"])
    opts = parse_broker_url(broker.url).with_auth("dev-a", s.devices["dev-a"])
    intruder = MqttTransport(opts, "dev-b").connect(5)
    try:
        server.publish(topics.round_(FED), b"probe", retain=True)
        server.flush()
        # A round trip on dev-b's connection, begun after the broker accepted the intruder (a takeover
        # would have closed that connection first): the probe arrives on it, not on a reconnection.
        probe = Inbox()
        dev_b.subscribe(topics.round_(FED), probe)
        probe.wait_for(b"probe")
        assert dev_b.connected and dev_b.stats.disconnects == 0
    finally:
        intruder.close(timeout=1)
        dev_b.close(timeout=1)
        server.close(timeout=1)


def test_join_takes_its_identity_and_federation_from_the_credentials_file(tmp_path: Path) -> None:
    from edge_agent.join_cli import resolve_identity

    auth = load_or_create(tmp_path / "s", FED, ["dev-a"])
    f = auth.device_file("dev-a")
    assert resolve_identity(None, None, None, f, None) == ("dev-a", "dev-a", auth.secrets.devices["dev-a"], FED)
    with pytest.raises(ConfigError, match="for federation 'sec', not 'other'; pass --fed sec"):
        resolve_identity(None, None, None, f, "other")
    with pytest.raises(ConfigError, match="use --client-id dev-a"):
        resolve_identity("dev-b", None, None, f, None)
    with pytest.raises(ConfigError, match="no device id"):
        resolve_identity(None, None, None, None, None)
    assert resolve_identity("x", None, None, None, None) == ("x", None, None, "default")


def test_the_monitor_reads_status_only_publishes_nothing_and_takes_no_devices_place(secured) -> None:
    # `protofl-server status --broker` logs in as the generated monitor (issue 26): it reads the retained
    # server/status and server/summary, nothing of a device's or the round's, and the broker drops every
    # publish of its; its user name is its client id, so even asking for a device's id takes no session.
    broker, auth = secured
    s = auth.secrets
    assert s.monitor.username == "protofl-monitor-sec" and s.monitor.username not in s.devices
    server = connect(broker.url, s.server.username, s.server.password)
    dev_a = connect(broker.url, "dev-a", s.devices["dev-a"])
    monitor = connect(broker.url, s.monitor.username, s.monitor.password)
    try:
        at_server, at_monitor = Inbox(), Inbox()
        server.subscribe(f"{topics.ROOT}/{FED}/#", at_server)
        monitor.subscribe("#", at_monitor)  # everything it could ever see
        server.publish(topics.server_status(FED), b"status", retain=True)
        server.publish(topics.server_summary(FED), b"summary", retain=True)
        at_monitor.wait_for(b"summary")
        # What it must not read: uploads, presence, the round, the config.
        dev_a.publish(topics.up(FED, "dev-a"), b"upload")
        dev_a.publish(topics.presence(FED, "dev-a"), b"presence", retain=True)
        server.publish(topics.round_(FED), b"round", retain=True)
        server.publish(topics.config(FED), b"config", retain=True)
        at_server.wait_for(b"presence")  # dev-a's two, in order, and the server's own before its fence
        server.publish(topics.server_status(FED), b"fence 1")
        at_monitor.wait_for(b"fence 1")  # queued after anything the broker routed to it above
        assert at_monitor.payloads() == [b"status", b"summary", b"fence 1"]
        # What it must not write: anything, its "own" device topics included.
        mine = s.monitor.username
        targets = [
            topics.up(FED, mine),
            topics.up(FED, "dev-a"),
            topics.presence(FED, mine),
            topics.round_(FED),
            topics.config(FED),
            topics.public(FED),
            topics.server_status(FED),
            topics.server_summary(FED),
            f"{topics.ROOT}/{FED}/anything",
        ]
        for topic in targets:
            monitor.publish(topic, b"from the monitor", retain=True)
        assert monitor.flush(5)  # every publish acknowledged: the broker has handled (and dropped) them all
        server.publish(topics.server_status(FED), b"fence 2")
        at_server.wait_for(b"fence 2")
        assert b"from the monitor" not in at_server.payloads()
        late = Inbox()  # the retained messages are still the server's
        monitor.subscribe(topics.server_summary(FED), late)
        late.wait_for(b"summary")
        # Asking for a device's client id: the broker gives it its user name instead; dev-a stays.
        impostor = MqttTransport(parse_broker_url(broker.url).with_auth(mine, s.monitor.password), "dev-a").connect(5)
        try:
            probe = Inbox()
            dev_a.subscribe(topics.server_status(FED), probe)  # a round trip begun after the impostor connected
            probe.wait_for(b"status")
            assert dev_a.connected and dev_a.stats.disconnects == 0
        finally:
            impostor.close(timeout=1)
    finally:
        for t in (server, dev_a, monitor):
            t.close(timeout=1)


def test_monitor_credentials_are_written_kept_and_no_device_may_take_its_name(tmp_path: Path) -> None:
    first = load_or_create(tmp_path / "s", FED, ["dev-a"])
    again = load_or_create(tmp_path / "s", FED, ["dev-a"])
    assert again.secrets.monitor == first.secrets.monitor
    assert stat.S_IMODE(first.monitor_file.stat().st_mode) == 0o600
    cred, fed = read_device_credentials(first.monitor_file)
    assert (cred, fed) == (first.secrets.monitor, FED)
    with pytest.raises(ConfigError, match="monitor's user name"):
        FederationSecrets.create(FED, ["protofl-monitor-sec"])

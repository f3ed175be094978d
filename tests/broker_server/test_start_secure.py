"""`protofl-server start` / `broker-config` secure by default, and broker readiness (issue 14)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from broker_server.cli import app
from broker_server.core.shell import Aggregator
from broker_server.ops.broker import PACKET_HEADROOM, MosquittoBroker, PortInUse, free_port
from protofl import topics
from protofl.presets import make_config
from protofl.transport import InProcessBroker
from protofl.transport.broker_url import parse_broker_url
from protofl.transport.mqtt import Backoff, MqttTransport, TransportError
from protofl.wire import Join, Limits, encode_message
from tests.conftest import EVENT_WAIT_S

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO))
DATA = "synthetic:n=300,n_test=50"


def server_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "broker_server.cli", "start", "--preset", "fedproto", *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=timeout,
    )


@pytest.fixture
def squatter() -> Iterator[int]:
    """Something that is not our broker, listening on a port (and accepting connections)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def test_a_port_squatter_makes_the_broker_fail_naming_the_port(squatter: int, tmp_path: Path) -> None:
    broker = MosquittoBroker(port=squatter, workdir=tmp_path)
    with pytest.raises(PortInUse, match=f"port {squatter} on 127.0.0.1 is already in use"):
        broker.start()
    assert broker.proc is None


def test_start_with_a_port_squatter_fails_with_a_clear_message(squatter: int, tmp_path: Path) -> None:
    out = server_cli("--port", str(squatter), "--fed", "squat", "--state-dir", str(tmp_path / "state"))
    assert out.returncode == 2, out.stderr
    assert f"port {squatter} on 127.0.0.1 is already in use" in out.stderr and "--port 0" in out.stderr
    # Checked before anything is written: no credentials for a federation that never started.
    assert not (tmp_path / "state" / "security").exists()


def test_start_checks_its_tls_flags_before_starting(tmp_path: Path) -> None:
    for args, words in (
        (["--tls", "maybe"], "--tls must be auto, on or off"),
        (["--tls", "on", "--insecure"], "hands devices the federation CA"),
        (["--client-ca", __file__, "--insecure"], "hands devices the federation CA"),
        (["--tls", "off", "--client-ca", __file__], "--tls off contradicts"),
        (["--tls", "on", "--broker", "mqtt://127.0.0.1:1"], "--tls applies to the local broker"),
    ):
        out = server_cli("--port", "0", "--fed", "flags", *args)
        assert out.returncode == 2 and words in out.stderr, (args, out.stderr)


def test_start_refuses_the_unauthenticated_embedded_broker_and_bad_listen(tmp_path: Path) -> None:
    out = server_cli("--local-broker", "amqtt", "--port", "0", "--fed", "noauth")
    assert out.returncode == 2 and "enforces no passwords or ACL" in out.stderr and "--insecure" in out.stderr
    out = server_cli("--listen", "0.0.0.0", "--fed", "noauth")
    assert out.returncode == 2 and "--listen '0.0.0.0': expected HOST:PORT" in out.stderr


def test_broker_config_writes_password_acl_and_device_files(tmp_path: Path) -> None:
    allow = tmp_path / "allow.txt"
    allow.write_text("rpi-07\njetson-1\n")
    result = CliRunner().invoke(
        app, ["broker-config", "--out", str(tmp_path / "sec"), "--fed", "lab", "--allow", str(allow)]
    )
    assert result.exit_code == 0, result.output
    assert f"password_file {tmp_path / 'sec' / 'passwd'}" in result.output
    assert "allow_anonymous false" in result.output and "max_packet_size " in result.output
    acl = (tmp_path / "sec" / "acl").read_text()
    assert "pattern write protofl/lab/up/%u" in acl and "user protofl-server-lab" in acl
    users = [line.split(":")[0] for line in (tmp_path / "sec" / "passwd").read_text().splitlines()]
    assert users == ["protofl-server-lab", "protofl-monitor-lab", "jetson-1", "rpi-07"]
    assert json.loads((tmp_path / "sec" / "devices" / "rpi-07.json").read_text())["username"] == "rpi-07"


def test_the_aggregator_ignores_ids_that_are_not_members() -> None:
    # A broker that does not enforce the ACL (an operator's own) still cannot get a stranger into the
    # round: the aggregator drops it before decoding, as a counted drop with its reason.
    cfg = make_config("fedproto", rounds=1, num_classes=3, proto_dim=2, adapter_rank=1, min_clients=1)
    broker = InProcessBroker()
    agg = Aggregator(cfg, "m", broker.connect("server"), members=["a"])
    agg.start()
    intruder = broker.connect("x")
    for i in range(2000):
        intruder.publish(
            topics.up("m", f"x{i}"), encode_message(Join(arch="cnn", n_samples=1), fed="m", sender=f"x{i}")
        )
    broker.pump()
    assert agg.clients == {} and agg.round == 0 and agg.dropped == {"not_member": 2000}
    broker.connect("a").publish(topics.up("m", "a"), encode_message(Join(arch="cnn", n_samples=1), fed="m", sender="a"))
    broker.pump()
    assert list(agg.clients) == ["a"] and agg.round == 1


@pytest.mark.slow
def test_secure_start_end_to_end_with_device_credentials(tmp_path: Path) -> None:
    # The default start, serving other machines (--listen 0.0.0.0:PORT): a Mosquitto with generated
    # passwords, ACL and TLS (the federation CA travels in the devices' files); devices join with their
    # files (mqtt:// or mqtts://: the file's CA switches TLS on); an anonymous client is refused meanwhile.
    port, state = free_port(), tmp_path / "state"
    allow = tmp_path / "allow.txt"
    allow.write_text("dev-0\ndev-1\n")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker_server.cli",
            "start",
            "--preset",
            "fedproto",
            "--listen",
            f"0.0.0.0:{port}",
            "--fed",
            "secure",
            "--rounds",
            "1",
            "--min-clients",
            "2",
            "--round-timeout",
            "60",
            "--state-dir",
            str(state),
            "--allow",
            str(allow),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=ENV,
        text=True,
    )
    devices: list[subprocess.Popen[str]] = []
    try:
        creds = state / "security" / "devices"
        end = time.monotonic() + 30
        while not (creds / "dev-1.json").exists() and time.monotonic() < end:
            time.sleep(0.1)
        devices = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "edge_agent.cli",
                    "join",
                    "--broker",
                    f"mqtt://127.0.0.1:{port}",
                    "--credentials",
                    str(creds / f"dev-{i}.json"),
                    "--data",
                    DATA,
                    "--partition",
                    f"{i}/2",
                    "--threads",
                    "1",
                    "--connect-timeout",
                    "30",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=ENV,
                text=True,
            )
            for i in range(2)
        ]
        ca = json.loads((creds / "dev-0.json").read_text())["ca"]
        anon = MqttTransport(
            parse_broker_url(f"mqtt://127.0.0.1:{port}").with_federation_ca(ca, "dev-0.json"),
            "anon",
            backoff=Backoff(0.2, 1.0),
        )
        with pytest.raises(TransportError, match="refused the connection"):
            anon.connect(timeout=15)
        out, _ = server.communicate(timeout=120)
        dev_out = [d.communicate(timeout=EVENT_WAIT_S)[0] for d in devices]
    finally:
        for p in (server, *devices):
            if p.poll() is None:
                p.kill()
    assert server.returncode == 0, out
    assert "round 1/1: 2 clients (quorum)" in out and "dropped uploads none" in out, out
    conf = (state / "broker" / "mosquitto.conf").read_text()
    assert f"listener {port} 0.0.0.0" in conf and "allow_anonymous false" in conf
    # The broker's packet limit is the aggregator's decoder limit (fedproto: the codec's default), plus a header.
    assert f"max_packet_size {Limits().max_message_bytes + PACKET_HEADROOM}\n" in conf
    assert f"mosquitto listening on mqtts://0.0.0.0:{port} and unix://" in out and "without TLS" not in out, out
    assert (state / "security" / "tls" / "ca.crt").read_text() == ca
    for d, o in zip(devices, dev_out, strict=True):
        assert d.returncode == 0 and "federation finished after 1 trained round(s)" in o, o


def test_a_fleets_device_files_are_written_in_one_pass_and_a_later_device_beside_them(tmp_path: Path) -> None:
    # Issue 48: a new fleet's files go into a new directory renamed into place once (a crashed pass's leftover is
    # cleared); a device added later gets its own file beside the others, which stay as they were.
    import stat

    from broker_server.ops.security import BrokerAuth, FederationSecrets

    sec = tmp_path / "sec"
    sec.mkdir()
    (sec / "devices.new").mkdir()
    (sec / "devices.new" / "stale.json").write_text("{}")
    secrets = FederationSecrets.create("lab", [f"d{i}" for i in range(50)])
    BrokerAuth(sec, secrets).provision()
    files = sorted(p.name for p in (sec / "devices").iterdir())
    assert files == sorted(f"d{i}.json" for i in range(50)) and not (sec / "devices.new").exists()
    d7 = sec / "devices" / "d7.json"
    assert stat.S_IMODE(d7.stat().st_mode) == 0o600
    assert json.loads(d7.read_text())["password"] == secrets.device("d7").password
    before = d7.stat().st_mtime_ns
    added = secrets.add_devices(["late"])
    BrokerAuth(sec, secrets, new_devices=tuple(added)).provision()
    assert json.loads((sec / "devices" / "late.json").read_text())["username"] == "late"
    assert d7.stat().st_mtime_ns == before and len(list((sec / "devices").iterdir())) == 51

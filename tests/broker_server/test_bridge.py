"""Site brokers bridged to the core (`protofl-server broker-config --bridge`, broker_server/scaleout/bridge.py, issue
27).

Real processes throughout: the server's default secured `start` (its spawned Mosquitto, generated passwords,
ACL and TLS), the site broker run as `mosquitto -c` on the generated config, devices with their generated
credentials files.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from broker_server.cli import app
from broker_server.ops.broker import MosquittoBroker, find_mosquitto, free_port
from broker_server.ops.pki import FederationTls
from broker_server.ops.security import prepare
from protofl.transport.broker_url import BrokerOptions, parse_broker_url
from protofl.transport.credentials import read_device_file
from protofl.transport.mqtt import MqttTransport
from tests.conftest import EVENT_WAIT_S

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO))
DATA = "synthetic:n=300,n_test=50"
CORE_IDS = ["dev-0", "dev-1"]
SITE_IDS = ["dev-2", "dev-3"]


@pytest.fixture(autouse=True)
def mosquitto_enters_tmp_path(tmp_path: Path) -> None:
    """As root, broker-config hands a site's files to user mosquitto, and the site broker drops to it: let it
    enter the test's directory (pytest makes its own 0700)."""
    if os.geteuid() == 0:
        for path in (tmp_path, *tmp_path.parents):
            if path == Path(tempfile.gettempdir()):
                break
            path.chmod(path.stat().st_mode | 0o001)


def device_options(url: str, creds: Path) -> BrokerOptions:
    """What `protofl-edge join --broker URL --credentials FILE` connects with."""
    found = read_device_file(creds)
    options = parse_broker_url(url).with_auth(found.credentials.username, found.credentials.password)
    return options.with_federation_ca(found.ca_pem, str(creds)) if found.ca_pem else options


def bridge_cli(*args: str) -> str:
    result = CliRunner().invoke(app, ["broker-config", *args])
    assert result.exit_code == 0, result.output
    return result.output


class SiteProcess:
    """`mosquitto -c SITE/mosquitto.conf`: the generated file as an operator runs it."""

    def __init__(self, directory: Path, port: int) -> None:
        binary = find_mosquitto()
        assert binary is not None
        self.log = directory / "mosquitto.log"
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [binary, "-c", str(directory / "mosquitto.conf")], stdout=out, stderr=subprocess.STDOUT
            )
        self.port = port

    def wait_bridged(self, timeout: float = 20) -> None:
        """Until the bridge says it connected to the core (the site logs its notification)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.proc.poll() is None, self.log.read_text()
            if "Connecting bridge" in self.log.read_text():
                return
            time.sleep(0.05)
        raise AssertionError(self.log.read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(10)


def run_federation(
    tmp: Path, fed: str, bridged: bool, pre_aggregate: bool = False
) -> tuple[dict[str, np.ndarray], str]:
    """Four devices, two rounds of fedproto, every device on the core or two at a bridged site (`pre_aggregate`:
    whose uploads a site pre-aggregator folds, `protofl-server shard --site`); returns the server's model and its
    output."""
    from edge_agent.ops.local_data import DataSpec
    from edge_agent.ops.runner import DeviceRunner, RunnerOptions

    tmp.mkdir()
    state, site_dir = tmp / "state", tmp / "site"
    core_port, site_port = free_port(), free_port()
    allow = tmp / "allow.txt"
    allow.write_text("\n".join(CORE_IDS + SITE_IDS) + "\n")
    if bridged:
        (tmp / "site.txt").write_text("\n".join(SITE_IDS) + "\n")
        bridge_cli(
            "--bridge",
            "site-a",
            "--fed",
            fed,
            "--core",
            f"mqtts://127.0.0.1:{core_port}",
            "--core-dir",
            str(state / "security"),
            "--out",
            str(site_dir),
            "--allow",
            str(tmp / "site.txt"),
            "--listen",
            f"127.0.0.1:{site_port}",
            "--tls",
            "on",
            *(["--pre-aggregate"] if pre_aggregate else []),
        )
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker_server.cli",
            "start",
            "--preset",
            "fedproto",
            "--port",
            str(core_port),
            "--tls",
            "on",
            "--fed",
            fed,
            "--rounds",
            "2",
            "--min-clients",
            "4",
            "--round-timeout",
            "60",
            "--state-dir",
            str(state),
            "--allow",
            str(allow),
            *(["--sites", "site-a"] if pre_aggregate else []),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=ENV,
        text=True,
    )
    site = pre = None
    runners: list[DeviceRunner] = []
    errors: list[BaseException] = []
    try:
        creds = state / "security" / "devices"
        end = time.monotonic() + 60
        while not (creds / f"{CORE_IDS[-1]}.json").exists() and server.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        where = {i: (f"mqtt://127.0.0.1:{core_port}", creds / f"{i}.json") for i in CORE_IDS + SITE_IDS}
        if bridged:
            site = SiteProcess(site_dir, site_port)
            site.wait_bridged()
            if pre_aggregate:  # as the operator runs it, with the file broker-config wrote
                pre = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "broker_server.cli",
                        "shard",
                        "--site",
                        "site-a",
                        "--fed",
                        fed,
                        "--broker",
                        f"mqtt://127.0.0.1:{site_port}",
                        "--credentials",
                        str(site_dir / "site-aggregator.json"),
                        "--state-dir",
                        str(tmp / "pre"),
                    ],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    env=ENV,
                    text=True,
                )
            where.update({i: (f"mqtt://127.0.0.1:{site_port}", site_dir / "devices" / f"{i}.json") for i in SITE_IDS})
        for index, cid in enumerate(CORE_IDS + SITE_IDS):
            url, file = where[cid]
            runners.append(
                DeviceRunner(
                    device_options(url, file),
                    fed,
                    cid,
                    DataSpec(DATA, partition=(index, 4)),
                    RunnerOptions(connect_timeout=30),
                )
            )

        def run(r: DeviceRunner) -> None:
            try:
                r.run(timeout=150)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in runners]
        for t in threads:
            t.start()
        out, _ = server.communicate(timeout=180)
        for t in threads:
            t.join(30)
        if pre is not None:  # it stops when the federation's last round has closed
            pre_out, _ = pre.communicate(timeout=60)
            assert pre.returncode == 0, pre_out
    finally:
        for r in runners:
            r.stop()
        for proc in (pre, server):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        if site is not None:
            site.stop()
    assert not errors, errors
    assert server.returncode == 0, out
    with np.load(state / "server_model.npz") as z:
        return {k: z[k] for k in z.files}, out


@pytest.mark.slow
@pytest.mark.mosquitto
@pytest.mark.usefixtures("one_torch_thread")
def test_devices_at_a_bridged_site_federate_as_if_on_the_core(tmp_path: Path) -> None:
    expected, out_core = run_federation(tmp_path / "core", "flat", bridged=False)
    got, out = run_federation(tmp_path / "bridged", "sites", bridged=True)
    # broker-config --bridge --pre-aggregate: the site's uploads are folded at the site (a real `shard --site`
    # process) and only its partials cross the bridge; were the uploads forwarded too, the coordinator (which folds
    # the core's own uploads) would fold them a second time and the result would differ.
    pre, out_pre = run_federation(tmp_path / "pre", "presite", bridged=True, pre_aggregate=True)
    assert "topic protofl/presite/up/+ out" not in (tmp_path / "pre" / "site" / "mosquitto.conf").read_text()
    for line in ("round 1/2: 4 clients (quorum)", "round 2/2: 4 clients (quorum)", "dropped uploads none"):
        assert line in out and line in out_core and line in out_pre, (out, out_pre)
    for result in (got, pre):
        assert sorted(result) == sorted(expected)
        for name in expected:  # the same uploads, folded in another order: float32 tolerance
            np.testing.assert_allclose(result[name], expected[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.mosquitto
def test_a_site_devices_will_reaches_the_server_through_the_bridge(tmp_path: Path) -> None:
    # The core as `start` serves it (generated passwords, ACL, TLS); the site from the generated config. The
    # server's request on a site device's own down/<id> reaches it (and not another device); the device killed
    # with SIGKILL: its will is published by the site broker and carried up by the bridge.
    core_dir, site_dir, port, site_port = tmp_path / "security", tmp_path / "site", free_port(), free_port()
    bridge_cli(
        "--bridge",
        "lab",
        "--fed",
        "w",
        "--core",
        f"mqtts://127.0.0.1:{port}",
        "--core-dir",
        str(core_dir),
        "--out",
        str(site_dir),
        "--devices",
        "2",
        "--listen",
        f"127.0.0.1:{site_port}",
    )
    auth = prepare(core_dir, "w")  # what start does at its next start: the bridge's user is in the files
    tls = FederationTls(core_dir / "tls")
    core = MosquittoBroker(
        port=port,
        workdir=tmp_path / "core",
        allow_anonymous=False,
        tls=tls.listener(),
        extra_config=auth.mosquitto_lines()[1:],
    ).start()
    site = SiteProcess(site_dir, site_port)
    seen: list[tuple[str, bytes]] = []
    server = None
    try:
        site.wait_bridged()
        secret = auth.secrets.server
        server = MqttTransport(
            parse_broker_url(f"mqtts://127.0.0.1:{port}")
            .with_auth(secret.username, secret.password)
            .with_federation_ca(tls.ca_pem(), "test"),
            secret.username,
            deliver="thread",
        ).connect(10)
        server.subscribe("protofl/w/presence/+", lambda topic, payload: seen.append((topic, payload)))
        device = subprocess.Popen(
            [
                sys.executable,
                "-c",
                DEVICE,
                f"mqtt://127.0.0.1:{site_port}",
                str(site_dir / "devices" / "lab-device-1.json"),
            ],
            stdout=subprocess.PIPE,
            env=ENV,
            text=True,
        )
        assert device.stdout is not None and device.stdout.readline().strip() == "online"
        wait_for(lambda: ("protofl/w/presence/lab-device-1", b"online") in seen, "the device's presence")
        server.publish("protofl/w/down/lab-device-2", b"for another device")
        server.publish("protofl/w/down/lab-device-1", b"send again")
        assert device.stdout.readline().strip() == "down send again"
        device.kill()  # no DISCONNECT: the site broker publishes its will
        device.wait()
        wait_for(lambda: ("protofl/w/presence/lab-device-1", b"gone") in seen, "the device's will")
    finally:
        if server is not None:
            server.close()
        site.stop()
        core.cleanup()


def test_a_bridge_cannot_publish_as_another_sites_or_the_cores_device(tmp_path: Path) -> None:
    # Issue 43: the core's ACL let a site's bridge user write up/+ and presence/+, so one compromised site
    # could upload as any member. Against the core's real Mosquitto, as the north site's bridge user: another
    # site's device and the core's own are refused, its own site's devices go through.
    core_dir, port = tmp_path / "security", free_port()
    bridge_cli("--out", str(core_dir), "--fed", "w", "--devices", "1")
    for site in ("north", "south"):
        bridge_cli(
            "--bridge",
            site,
            "--fed",
            "w",
            "--core",
            f"mqtt://127.0.0.1:{port}",
            "--core-dir",
            str(core_dir),
            "--out",
            str(tmp_path / site),
            "--devices",
            "1",
            "--listen",
            f"127.0.0.1:{free_port()}",
        )
    auth = prepare(core_dir, "w")  # what start does with the core's directory
    core = MosquittoBroker(
        port=port, workdir=tmp_path / "core", allow_anonymous=False, extra_config=auth.mosquitto_lines()[1:]
    ).start()
    seen: list[str] = []
    transports: list[MqttTransport] = []
    try:
        secret = auth.secrets.server
        server = MqttTransport(
            parse_broker_url(core.url).with_auth(secret.username, secret.password), secret.username, deliver="thread"
        ).connect(10)
        transports.append(server)
        server.subscribe("protofl/w/up/+", lambda topic, payload: seen.append(topic))
        server.subscribe("protofl/w/presence/+", lambda topic, payload: seen.append(topic))
        bridge = auth.secrets.bridge("north")
        north = MqttTransport(parse_broker_url(core.url).with_auth(bridge.username, bridge.password), "x").connect(10)
        transports.append(north)
        forged = [
            "protofl/w/up/south-device-1",
            "protofl/w/presence/south-device-1",
            "protofl/w/up/device-1",
            "protofl/w/presence/device-1",
        ]

        def own(topic: str) -> bool:  # sent again until the server's subscriptions are in place
            north.publish(topic, b"own")
            north.flush(10)
            time.sleep(0.1)
            return topic in seen

        wait_for(lambda: own("protofl/w/presence/north-device-1"), f"the site's own device: {seen}")
        for topic in forged:
            with contextlib.suppress(Exception):  # MQTT 5 may say "not authorized"; 3.1.1 drops it quietly
                north.publish(topic, b"forged")
        wait_for(lambda: own("protofl/w/up/north-device-1"), f"the site's own upload: {seen}")  # after them
        time.sleep(0.5)
        assert not set(forged) & set(seen), seen
    finally:
        for t in transports:
            t.close()
        core.cleanup()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: what broker-config writes when run as root")
def test_a_site_broker_written_by_root_drops_to_the_mosquitto_user(tmp_path: Path) -> None:
    import pwd

    core, site, site_port = tmp_path / "core", tmp_path / "site", free_port()
    common = ["--fed", "lab", "--core", "mqtt://127.0.0.1:1", "--core-dir", str(core), "--devices", "1"]
    listen = ["--listen", f"127.0.0.1:{site_port}"]
    hidden = tmp_path / "hidden"
    hidden.mkdir(mode=0o700)
    hidden.chmod(0o700)
    refused = CliRunner().invoke(
        app, ["broker-config", "--bridge", "north", *common, "--out", str(hidden / "s"), *listen]
    )
    assert refused.exit_code != 0 and f"cannot enter {hidden};" in " ".join(refused.output.split()), refused.output
    bridge_cli("--bridge", "north", *common, "--out", str(site), *listen)
    conf = (site / "mosquitto.conf").read_text()
    assert "\nuser mosquitto\n" in conf and "user root" not in conf
    mosquitto = pwd.getpwnam("mosquitto").pw_uid
    assert site.stat().st_uid == mosquitto and (site / "passwd").stat().st_uid == mosquitto
    assert (site / "devices" / "north-device-1.json").stat().st_uid == 0  # the devices' files stay root's
    proc = SiteProcess(site, site_port)
    try:
        end = time.monotonic() + 10
        while time.monotonic() < end:
            assert proc.proc.poll() is None, proc.log.read_text()
            with contextlib.suppress(OSError):
                with socket.create_connection(("127.0.0.1", site_port), timeout=1):
                    break
            time.sleep(0.1)
        status = Path(f"/proc/{proc.proc.pid}/status").read_text()
        uid = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
        assert set(uid) == {str(mosquitto)}, status  # real, effective, saved: root is gone
    finally:
        proc.stop()


DEVICE = """
import sys, time
from pathlib import Path
from protofl.transport.mqtt import MqttTransport, Will
from tests.broker_server.test_bridge import device_options
options = device_options(sys.argv[1], Path(sys.argv[2]))
t = MqttTransport(options, options.username, will=Will("protofl/w/presence/lab-device-1", b"gone")).connect(10)
t.subscribe("protofl/w/down/+", lambda topic, payload: print("down", payload.decode(), flush=True))
t.publish("protofl/w/presence/lab-device-1", b"online", retain=True)
t.flush(10)
print("online", flush=True)
time.sleep(120)
"""


def wait_for(pred: Callable[[], object], what: str, timeout: float = EVENT_WAIT_S) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_broker_config_bridge_refuses_bad_input_and_changes_nothing(tmp_path: Path) -> None:
    runner = CliRunner()
    core = tmp_path / "core"
    base = ["broker-config", "--out", str(tmp_path / "site"), "--devices", "2"]
    cases = (
        (["--core", "mqtt://h:1"], "--core configure a site broker: add --bridge SITE"),
        (["--bridge", "a"], "--bridge needs --core URL"),
        (["--bridge", "a b", "--core", "mqtt://h:1", "--core-dir", str(core)], "not a valid name"),
        (["--bridge", "a", "--core", "unix:///tmp/x.sock", "--core-dir", str(core)], "over the network"),
        (
            ["--bridge", "a", "--core", "mqtt://h:1", "--core-dir", str(core), "--listen", "0.0.0.0"],
            "expected HOST:PORT",
        ),
        (["--bridge", "a", "--core", "mqtt://h:1", "--core-dir", str(core), "--tls", "maybe"], "--tls must be"),
        (
            ["--bridge", "a", "--core", "mqtts://h:1", "--core-dir", str(core), "--core-ca", str(tmp_path / "no.crt")],
            "no such file",
        ),
        (["--bridge", "a", "--core", "mqtt://h:1", "--core-dir", str(tmp_path)], "holds no credentials.json"),
    )
    for args, words in cases:
        result = runner.invoke(app, [*base, *args])
        assert result.exit_code == 2 and words in " ".join(result.output.split()), (args, result.output)
    assert not core.exists() and not (tmp_path / "site").exists()
    # No devices for the site: refused before anything is written.
    result = runner.invoke(
        app,
        [
            "broker-config",
            "--out",
            str(tmp_path / "site"),
            "--bridge",
            "a",
            "--core",
            "mqtt://h:1",
            "--core-dir",
            str(core),
        ],
    )
    assert result.exit_code == 2 and "--allow FILE" in result.output
    assert not core.exists()
    # A core directory of another federation.
    bridge_cli("--out", str(core), "--fed", "one", "--devices", "1")
    result = runner.invoke(
        app, [*base, "--bridge", "a", "--fed", "two", "--core", "mqtt://h:1", "--core-dir", str(core)]
    )
    assert result.exit_code == 2 and "federation 'one', not 'two'" in result.output


def test_broker_config_bridge_writes_both_sides(tmp_path: Path) -> None:
    core, site = tmp_path / "core", tmp_path / "site"
    bridge_cli("--out", str(core), "--fed", "lab", "--devices", "1")
    out = bridge_cli(
        "--bridge",
        "north",
        "--fed",
        "lab",
        "--core",
        "mqtts://core.example:8883",
        "--core-dir",
        str(core),
        "--out",
        str(site),
        "--devices",
        "2",
        "--listen",
        "0.0.0.0:1884",
    )
    assert f"mosquitto -c {site / 'mosquitto.conf'}" in out and "--broker mqtts://HOST:1884" in out
    conf = (site / "mosquitto.conf").read_text()
    for line in (
        "connection protofl-lab-north",
        "address core.example:8883",
        "remote_username protofl-bridge-lab-north",
        f"bridge_cafile {site / 'core-ca.crt'}",
        "topic protofl/lab/up/+ out 1",
        "topic protofl/lab/presence/+ out 1",
        "topic protofl/lab/round in 1",
        "topic protofl/lab/config in 1",
        "topic protofl/lab/server/status in 1",
        "listener 1884 0.0.0.0",
        f"password_file {site / 'passwd'}",
        "allow_anonymous false",
        "cleansession false",
    ):
        assert f"\n{line}\n" in conf, line
    assert oct((site / "mosquitto.conf").stat().st_mode & 0o777) == "0o600"  # it holds the bridge's password
    # The core knows the bridge (ACL limited to the federation's device topics) and the site's devices.
    acl = (core / "acl").read_text()
    assert (
        "user protofl-bridge-lab-north\n"
        "topic write protofl/lab/up/north-device-1\ntopic write protofl/lab/presence/north-device-1\n"
        "topic write protofl/lab/up/north-device-2\ntopic write protofl/lab/presence/north-device-2\n"
        "topic read protofl/lab/down/+\n"
    ) in acl
    assert "topic write protofl/lab/up/+" not in acl  # its own devices only (issue 43)
    core_users = [line.split(":")[0] for line in (core / "passwd").read_text().splitlines()]
    assert core_users == [
        "protofl-server-lab",
        "protofl-monitor-lab",
        "protofl-bridge-lab-north",
        "device-1",
        "north-device-1",
        "north-device-2",
    ]
    assert [line.split(":")[0] for line in (site / "passwd").read_text().splitlines()] == [
        "north-device-1",
        "north-device-2",
    ]
    # The site serves TLS (beyond loopback) with a certificate the federation CA signed: the devices' files
    # carry that CA, as the core's do; the core's certificate now names the host the bridge dials.
    dev = read_device_file(site / "devices" / "north-device-1.json")
    assert dev.ca_pem == (core / "tls" / "ca.crt").read_text() == (site / "tls" / "ca.crt").read_text()
    from broker_server.ops.pki import certificate_names

    assert "core.example" in certificate_names(core / "tls" / "broker.crt")
    # Again: the same bridge password (the running site keeps working), no new devices.
    password = conf.split("remote_password ")[1].split()[0]
    bridge_cli(
        "--bridge",
        "north",
        "--fed",
        "lab",
        "--core",
        "mqtts://core.example:8883",
        "--core-dir",
        str(core),
        "--out",
        str(site),
        "--devices",
        "2",
        "--listen",
        "0.0.0.0:1884",
    )
    assert f"remote_password {password}\n" in (site / "mosquitto.conf").read_text()


def test_start_counts_site_devices_in_its_queue_but_not_in_its_open_files(tmp_path: Path) -> None:
    # 500 devices at a bridged site, 100 on the core, a hard open-file limit of 256: the core's broker serves
    # 100 connections (fits), while its queue for the aggregator must hold the whole fleet's burst (600).
    import resource

    from broker_server.ops.capacity import queue_for_fleet

    state = tmp_path / "state"
    bridge_cli(
        "--bridge",
        "far",
        "--fed",
        "cap",
        "--core",
        "mqtt://127.0.0.1:1",
        "--core-dir",
        str(state / "security"),
        "--out",
        str(tmp_path / "site"),
        "--devices",
        "500",
        "--listen",
        "127.0.0.1:1884",
    )

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker_server.cli",
            "start",
            "--preset",
            "fedproto",
            "--port",
            "0",
            "--fed",
            "cap",
            "--devices",
            "100",
            "--min-clients",
            "600",
            "--state-dir",
            str(state),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=ENV,
        text=True,
        preexec_fn=limited,
    )
    lines: list[str] = []
    try:
        assert server.stdout is not None
        for line in server.stdout:
            lines.append(line)
            if "waiting for 600 client(s)" in line or "error" in line:
                break
    finally:
        server.terminate()
        server.wait(30)
    out = "".join(lines)
    assert f"queues up to {queue_for_fleet(600, 1)} messages for the aggregator" in out and "fleet of 600" in out, out
    assert "waiting for 600 client(s)" in out, out


def test_broker_config_bridge_pre_aggregate_writes_the_pre_aggregators_side(tmp_path: Path) -> None:
    core, site = tmp_path / "core", tmp_path / "site"
    bridge_cli("--out", str(core), "--fed", "lab", "--devices", "1")
    args = [
        "--bridge",
        "north",
        "--fed",
        "lab",
        "--core",
        "mqtt://core.example:1883",
        "--core-dir",
        str(core),
        "--out",
        str(site),
        "--devices",
        "2",
        "--listen",
        "127.0.0.1:1884",
    ]
    out = bridge_cli(*args, "--pre-aggregate")
    agg_file = site / "site-aggregator.json"
    assert (
        f"protofl-server shard --site north --fed lab --broker mqtt://127.0.0.1:1884 --credentials {agg_file}" in out
        and "start ... --sites north" in out
    )
    conf = (site / "mosquitto.conf").read_text()
    for line in (
        "topic protofl/lab/presence/+ out 1",
        "topic protofl/lab/shards/progress/site-north out 1",
        "topic protofl/lab/shards/partial/site-north out 1",
        "topic protofl/lab/shards/phase in 1",
        "topic protofl/lab/shards/close in 1",
        "topic protofl/lab/round in 1",
    ):
        assert f"\n{line}\n" in conf, line
    assert "protofl/lab/up/+" not in conf  # the uploads stay at the site
    # The pre-aggregator: a user of the site broker with a shard's rights there, and its credentials file.
    me = read_device_file(agg_file).credentials
    assert me.username == "protofl-site-lab-north"
    assert [line.split(":")[0] for line in (site / "passwd").read_text().splitlines()] == [
        "north-device-1",
        "north-device-2",
        "protofl-site-lab-north",
    ]
    site_acl = (site / "acl").read_text()
    assert "user protofl-site-lab-north\ntopic read protofl/lab/up/+\n" in site_acl
    # The core: the bridge user writes the pre-aggregator's topics, not the uploads; kept across a restart's rewrite.
    core_acl = (core / "acl").read_text()
    bridge_block = core_acl.split("user protofl-bridge-lab-north\n")[1].split("\n\n")[0]
    assert "topic write protofl/lab/shards/partial/site-north" in bridge_block
    assert "protofl/lab/up/" not in bridge_block
    prepare(core, "lab")  # what `start` does with the core's directory
    assert (core / "acl").read_text() == core_acl
    # The same password again (a running pre-aggregator keeps working); without the flag the site forwards again.
    bridge_cli(*args, "--pre-aggregate")
    assert read_device_file(agg_file).credentials.password == me.password
    bridge_cli(*args)
    assert not agg_file.exists() and "topic protofl/lab/up/+ out 1" in (site / "mosquitto.conf").read_text()
    forwarding = (core / "acl").read_text().split("user protofl-bridge-lab-north\n")[1].split("\n\n")[0]
    assert "topic write protofl/lab/up/north-device-1" in forwarding  # its own devices' uploads only
    assert "topic write protofl/lab/up/+" not in forwarding


@pytest.mark.slow
@pytest.mark.mosquitto
@pytest.mark.usefixtures("one_torch_thread")
def test_a_site_brokers_drops_reach_the_server_and_its_devices_send_again(tmp_path: Path) -> None:
    # The core as `start` serves it; a site broker (generated config) holding one message for its bridge. The
    # core broker is stopped (SIGSTOP) while the site's 16 devices join: the site acknowledges every join and
    # drops what its bridge cannot hold (16 joins + 16 presence > 20 in flight + 1 queued). Once the core runs
    # again, the site's $SYS counter comes up the bridge; the server says so, asks the devices it has not heard
    # from to join again, and both rounds close at quorum with every device.
    import json

    from edge_agent.ops.local_data import DataSpec
    from edge_agent.ops.runner import DeviceRunner, RunnerOptions
    from protofl import topics
    from tests.broker_server.test_lossless import _status, _text, _wait

    n, fed, state, site_dir = 16, "sitedrops", tmp_path / "state", tmp_path / "site"
    core_port, site_port = free_port(), free_port()
    ids = [f"site-device-{i}" for i in range(1, n + 1)]
    (tmp_path / "site.txt").write_text("\n".join(ids) + "\n")
    bridge_cli(
        "--bridge",
        "north",
        "--fed",
        fed,
        "--core",
        f"mqtt://127.0.0.1:{core_port}",
        "--core-dir",
        str(state / "security"),
        "--out",
        str(site_dir),
        "--allow",
        str(tmp_path / "site.txt"),
        "--listen",
        f"127.0.0.1:{site_port}",
        "--broker-queue",
        "1",
    )
    assert (
        "topic dropped out 1 $SYS/broker/publish/messages/ protofl/sitedrops/sites/north/"
        in (site_dir / "mosquitto.conf").read_text()
    )
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker_server.cli",
            "start",
            "--preset",
            "fedproto",
            "--port",
            str(core_port),
            "--fed",
            fed,
            "--rounds",
            "2",
            "--allow",
            str(tmp_path / "site.txt"),
            "--min-clients",
            str(n),
            "--round-timeout",
            "120",
            "--state-dir",
            str(state),
            "--verbose",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=ENV,
    )
    site, runners, core_pid, stopped = None, [], 0, False
    try:
        _wait(lambda: "devices join with" in _text(tmp_path / "server.log"), 60, "the server's broker")
        core_pid = int((state / "broker" / "mosquitto.pid").read_text())
        site = SiteProcess(site_dir, site_port)
        site.wait_bridged()
        # The federation's retained config has reached the site (devices join once they read it there).
        first = device_options(f"mqtt://127.0.0.1:{site_port}", site_dir / "devices" / f"{ids[0]}.json")
        probe = MqttTransport(first, ids[0]).connect(10)
        seen = threading.Event()
        probe.subscribe(topics.config(fed), lambda t, p: seen.set())
        assert seen.wait(30), "the config never reached the site"
        probe.close()
        os.kill(core_pid, signal.SIGSTOP)
        stopped = True
        data = f"synthetic:n={20 * n},n_test={4 * n}"
        for i, cid in enumerate(ids):
            runners.append(
                DeviceRunner(
                    device_options(f"mqtt://127.0.0.1:{site_port}", site_dir / "devices" / f"{cid}.json"),
                    fed,
                    cid,
                    DataSpec(data, partition=(i, n), seed=1),
                    RunnerOptions(connect_timeout=30),
                )
            )
        threads = [threading.Thread(target=r.run, kwargs={"timeout": 180}, daemon=True) for r in runners]
        for t in threads:
            t.start()
        _wait(
            lambda: "Outgoing messages are being dropped for client" in _text(site.log),
            60,
            "the site broker to drop what its bridge cannot hold",
        )
        os.kill(core_pid, signal.SIGCONT)
        stopped = False
        for t in threads:
            t.join(180)
        assert server.wait(60) == 0
    finally:
        if stopped:
            os.kill(core_pid, signal.SIGCONT)
        for r in runners:
            r.stop()
        if server.poll() is None:
            server.kill()
        if site is not None:
            site.stop()
        log.close()
    out = _text(tmp_path / "server.log")
    rounds = [json.loads(line) for line in (state / "rounds.jsonl").read_text().splitlines()]
    assert [(r["round"], len(r["clients"]), r["closed_by"]) for r in rounds] == [(1, n, "quorum"), (2, n, "quorum")]
    final = _status(state / "status.json")
    assert final["broker_dropped"] > 0 and final["resend_requests"] > 0, final
    assert "site broker 'north' dropped" in out and "to re-send" in out, out

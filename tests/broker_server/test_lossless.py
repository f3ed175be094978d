"""Nothing lost at any size (issue 27): the broker's queue sized from the fleet, the open-file limit checked
against it, drops the broker reports detected and surfaced, and the devices that lost a message asked to
send it again; restarts keep the credentials they already wrote."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from broker_server.core.rounds import RoundMachine
from broker_server.ops.broker import MosquittoBroker
from broker_server.ops.capacity import (
    DEFAULT_QUEUE,
    MOSQUITTO_INFLIGHT,
    held_bytes,
    inflight_window,
    queue_for_fleet,
    resend_window,
)
from broker_server.ops.resend import Ask, BrokerDrops, Resender, owed
from broker_server.ops.security import (
    hash_matches,
    monitor_user,
    prepare,
    read_hashes,
    server_user,
)
from edge_agent.ops.local_data import DataSpec
from edge_agent.ops.resend import ResendRequests
from edge_agent.ops.runner import DeviceRunner, RunnerOptions
from protofl.presets import make_config
from protofl.transport.broker_url import parse_broker_url
from protofl.transport.credentials import read_device_credentials
from protofl.wire import Join, Resend, Status, encode_message
from protofl.wire.codec import Envelope, pack_envelope

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")


# -- the queue and the open-file limit ------------------------------------------------------------
def test_the_queue_is_sized_from_the_fleet_and_never_below_the_old_default() -> None:
    assert queue_for_fleet(10, 1) == DEFAULT_QUEUE
    assert queue_for_fleet(12_000, 1) == 12_000 * 4 * 2  # upload + presence, join, metrics; twice over
    # The re-sends that may be outstanding fill half of what the broker holds (queue + the window in flight).
    assert resend_window(1, 1, window=20) == 5 and resend_window(96_000, 1, window=20) == 24_005
    assert resend_window(1, 1) == (1 + inflight_window()) // 4
    # In bytes: the queue and each reader's window (the server, or each shard) of the largest message.
    assert held_bytes(1000, 2048, readers=4, window=100) == (1000 + 400) * 2048
    assert inflight_window(None) == MOSQUITTO_INFLIGHT and inflight_window(300) == 300


def test_the_server_window_can_be_set_for_a_measurement_and_a_bad_one_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from broker_server.ops.capacity import RECEIVE_MAXIMUM_ENV, server_receive_maximum
    from protofl.errors import ConfigError

    monkeypatch.setenv(RECEIVE_MAXIMUM_ENV, "200")
    assert server_receive_maximum() == 200 and inflight_window() == 200
    assert resend_window(1000, 1) == (1000 + 200) // 4
    for bad in ("0", "70000", "many"):
        monkeypatch.setenv(RECEIVE_MAXIMUM_ENV, bad)
        with pytest.raises(ConfigError, match="1 to 65535"):
            server_receive_maximum()


def test_broker_config_prints_the_queue_for_its_fleet_and_the_sys_interval(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from broker_server.cli import app

    out = CliRunner().invoke(app, ["broker-config", "--out", str(tmp_path / "a"), "--devices", "3000"])
    assert out.exit_code == 0 and "max_queued_messages 30000\n" in out.output and "sys_interval 1\n" in out.output
    out = CliRunner().invoke(app, ["broker-config", "--out", str(tmp_path / "b"), "--broker-queue", "0"])
    assert out.exit_code == 2 and "--broker-queue must be at least 1" in out.output and not (tmp_path / "b").exists()


def _limited(soft: int, hard: int) -> Callable[[], None]:
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_start_refuses_a_fleet_beyond_the_hard_open_file_limit_before_writing_anything(tmp_path: Path) -> None:
    state = tmp_path / "state"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "broker_server.cli",
            "start",
            "--preset",
            "fedproto",
            "--port",
            "0",
            "--devices",
            "500",
            "--state-dir",
            str(state),
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
        preexec_fn=_limited(256, 256),
    )
    assert out.returncode == 2, out.stdout + out.stderr
    err = out.stderr
    assert "open-file limit too low for the fleet" in err and "needs 564 open files for 500 device" in err, err
    assert "hard limit (RLIMIT_NOFILE) is 256" in err and "ulimit -Hn 564" in err and "site brokers" in err, err
    assert not state.exists()  # refused before anything was written


def test_the_soft_open_file_limit_is_raised_to_the_hard_limit_for_the_broker_to_inherit() -> None:
    hard = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 4096)
    code = (
        "import resource; from broker_server.ops.capacity import raise_open_files; got = raise_open_files(1000); "
        "print(got.raised_from, resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
        preexec_fn=_limited(128, hard),
        check=True,
    )
    assert out.stdout.split() == ["128", str(hard)], out.stdout + out.stderr


# -- reading the broker's counter, and whom to ask ---------------------------------------------------
def test_the_dropped_counter_is_read_as_new_drops_with_its_resets_and_garbage_ignored() -> None:
    drops = BrokerDrops()
    assert drops.observe(b"40") == 0  # the baseline: drops before this server listened are not its business
    assert drops.observe(b"45") == 5 and drops.observe(b"45") == 0
    assert drops.observe(b"3") == 3  # a restarted broker counts from zero again
    for junk in (b"-1", b"12abc", b"", b"9" * 40, b"\xff\xfe"):
        assert drops.observe(junk) == 0
    assert drops.total == 8
    # A site broker's counter comes up its bridge, maybe first after the drops: counted from zero.
    site = BrokerDrops(from_zero=True)
    assert site.observe(b"7") == 7 and site.observe(b"7") == 0 and site.total == 7


def _machine(ids: list[str]) -> RoundMachine:
    cfg = make_config(
        "fedproto", rounds=2, num_classes=2, proto_dim=2, adapter_rank=1, min_clients=len(ids), round_timeout=600.0
    )
    machine = RoundMachine(cfg, lambda msg, r, p: b"x", clock=lambda: 0.0)
    machine.start()
    return machine


def _join(machine: RoundMachine, cid: str) -> None:
    from broker_server.core.rounds import Received
    from protofl.wire import unpack_envelope

    env = unpack_envelope(encode_message(Join(arch="", n_samples=3), fed="f", sender=cid))
    inp = Received(env, Join(arch="", n_samples=3), 10)
    machine.accepts(inp)
    machine.apply(inp)


def test_the_owed_uploads_come_first_then_the_missing_joins_of_members() -> None:
    ids = ["a", "b", "c"]
    machine = _machine(ids[:2])
    for cid in ("a", "b"):
        _join(machine, cid)
    assert machine.round == 1
    got = owed(machine, ids)
    assert got == [Ask("a", "uploads", 1, "train"), Ask("b", "uploads", 1, "train"), Ask("c", "join")]


def test_a_closed_rounds_missing_metrics_are_owed_after_the_uploads_and_joins() -> None:
    ids = ["a", "b", "c"]
    machine = _machine(ids[:2])
    for cid in ("a", "b"):
        _join(machine, cid)
    got = owed(machine, ids, {1: {"b"}, 0: set()})
    assert got[-1] == Ask("b", "metrics", 1) and got[:3] == owed(machine, ids)
    # An episode asks for a closed round's metrics whatever phase its drops were seen in, within its window.
    r = Resender(window=2, settle=0.0)
    r.progress(0.0)
    r.alarm(2, "train")
    owing = [
        Ask("d1", "uploads", 1, "train"),
        Ask("d1", "metrics", 1),
        Ask("d2", "metrics", 1),
        Ask("d3", "metrics", 1),
    ]
    assert r.due(owing, 1.0) == owing[1:3]
    assert r.due(owing[2:], 1.1) == [owing[3]]  # d1's metrics came: its place in the window is free
    assert r.due([], 1.2) == [] and not r.active  # everything asked for came: the episode is over


def test_a_rounds_line_waits_for_the_metrics_asked_again_up_to_its_hold() -> None:
    from broker_server.core.progress import HOLD_S, RoundProgress
    from broker_server.core.rounds import RoundRecord
    from protofl.wire import Metrics

    shown: list[tuple[int, list[str]]] = []
    progress = RoundProgress(lambda rec, metrics: shown.append((rec.round, sorted(metrics))), grace=5.0)
    progress.round_end(RoundRecord(round=1, clients=["a", "b"], started=0.0, ended=100.0, closed_by="quorum"))
    progress.add_metrics("a", 1, Metrics(1, 1, 0, 0))
    assert progress.awaited() == {1: (100.0, {"b"})}
    assert progress.poll(106.0, hold=True) == 0  # past the grace, but b's metrics are being asked for
    progress.add_metrics("b", 1, Metrics(1, 0, 0, 0))
    assert progress.poll(106.1, hold=True) == 1 and shown == [(1, ["a", "b"])] and progress.awaited() == {}
    progress.round_end(RoundRecord(round=2, clients=["a", "b"], started=100.0, ended=200.0, closed_by="quorum"))
    assert progress.poll(200.0 + 5.0 + HOLD_S, hold=True) == 1 and shown[-1] == (2, [])  # not forever


def test_requests_are_flow_controlled_by_a_window_and_scoped_to_the_phase_of_the_drops() -> None:
    owing = [Ask(f"d{i}", "uploads", 3, "train") for i in range(10)] + [Ask("late", "join")]
    r = Resender(window=4, quiet=2.0, max_age=30.0, attempts=2, settle=0.5)
    assert r.due(owing, 0.0) == []  # no drops, nobody is asked
    r.progress(-1.0)
    r.alarm(3, "train")
    assert r.due(owing, -0.8) == []  # the backlog behind the counter is still coming: wait for it
    assert r.due(owing, 0.0) == owing[:4]
    assert r.due(owing, 0.1) == []  # the window is full until answers come
    answered = owing[2:]  # d0 and d1 sent their uploads
    assert r.due(answered, 0.2) == owing[4:6]
    for t in (1.0, 2.0, 3.0, 10.0):  # a slow drain: while anything arrives, nothing expires
        r.progress(t)
        assert r.due(answered, t + 0.5) == []
    # Quiet for 2 s: d2..d5's answers are not coming; they are asked again, before anyone new.
    assert r.due(answered, 12.0) == owing[2:6]
    assert r.due(answered, 14.0) == owing[6:10]  # their last attempt (2) is spent: the others' turn
    # The next phase's devices (still training) are not asked for what the drops did not touch.
    assert r.due([Ask("d9", "uploads", 4, "train"), Ask("late", "join")], 16.0) == [Ask("late", "join")]
    assert r.due([Ask("late", "join")], 18.0) == [Ask("late", "join")]
    assert r.due([Ask("late", "join")], 20.0) == [] and not r.active and r.requests == 16


def test_a_device_honours_only_the_servers_bounded_requests_once_per_interval() -> None:
    req = ResendRequests("f", "d1", min_interval=1.0)

    def msg(m: object, sender: str = "server", fed: str = "f") -> bytes:
        return encode_message(m, fed=fed, sender=sender, round=2, phase="train")  # type: ignore[arg-type]

    got = req.read(msg(Resend("uploads")), 10.0)
    assert got is not None and got[1].ask == "uploads" and (got[0].round, got[0].phase) == (2, "train")
    assert req.read(msg(Resend("uploads")), 10.5) is None  # once per interval for the same request
    assert req.read(msg(Resend("join")), 10.5) is not None
    assert req.read(msg(Resend("metrics")), 10.5) is not None
    assert req.read(msg(Resend("uploads")), 11.1) is not None
    for hostile in (
        msg(Resend("uploads"), sender="d2"),
        msg(Resend("uploads"), fed="other"),
        msg(Status("x")),
        b"\x00" * 10,
        # packed by hand: the typed constructor refuses a state this long on the sending side already
        pack_envelope(Envelope(1, "status", "f", 0, "", "server", "m1", {"state": "x" * 5000, "detail": ""})),
    ):
        assert req.read(hostile, 20.0) is None
    assert req.refused == 5 and req.honoured == 4


# -- restarts keep the credentials they wrote -------------------------------------------------------
def test_a_restart_hashes_and_writes_only_new_devices(tmp_path: Path) -> None:
    d = tmp_path / "sec"
    first = prepare(d, "f", ["a", "b"]).provision("CA1")
    hashes = read_hashes(first.password_file)
    files = {cid: first.device_file(cid).stat().st_mtime_ns for cid in ("a", "b")}
    second = prepare(d, "f", ["a", "b", "c"]).provision("CA1")
    again = read_hashes(second.password_file)
    assert second.new_devices == ("c",)
    assert {u: again[u] for u in hashes} == hashes  # the same salts: not hashed again
    assert {cid: second.device_file(cid).stat().st_mtime_ns for cid in ("a", "b")} == files
    assert hash_matches(second.secrets.devices["c"], again["c"]) and second.device_file("c").exists()
    # Another CA: every device file carries it; a password file of other secrets is hashed anew.
    third = prepare(d, "f", ["a"]).provision("CA2")
    assert all("CA2" in third.device_file(cid).read_text() for cid in ("a", "b", "c"))
    (d / "credentials.json").unlink()
    fourth = prepare(d, "f", ["a"])
    fresh = read_hashes(fourth.password_file)
    for user, password in (
        (server_user("f"), fourth.secrets.server_password),
        (monitor_user("f"), fourth.secrets.monitor_password),
        ("a", fourth.secrets.devices["a"]),
    ):
        assert hash_matches(password, fresh[user])


# -- the whole path over the real spawned broker ------------------------------------------------------
@pytest.mark.slow
@pytest.mark.mosquitto
def test_broker_queue_exhaustion_is_detected_and_no_upload_is_lost(tmp_path: Path) -> None:
    # The default start (spawned secured Mosquitto, generated credentials, journal) with a queue of one message
    # for the aggregator, which is stopped (SIGSTOP) while its 16 devices upload: the broker acknowledges
    # every upload and drops what it cannot hold (16 uploads and 16 metrics > 20 in flight + 1 queued). Once
    # the server runs again it sees the drops ($SYS), says so (log, status.json) and asks the devices it has
    # not heard from to re-send: the round closes at quorum with every device, not at its deadline, and its
    # line waits for the metrics asked for again.
    n, fed, state = 16, "lossless", tmp_path / "state"
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
            "0",
            "--fed",
            fed,
            "--rounds",
            "2",
            "--devices",
            str(n),
            "--min-clients",
            str(n),
            "--round-timeout",
            "120",
            "--broker-queue",
            "1",
            "--state-dir",
            str(state),
            "--verbose",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=ENV,
    )
    runners: list[DeviceRunner] = []
    stopped = False
    try:
        creds = state / "security" / "devices"
        _wait(
            lambda: (creds / f"device-{n}.json").exists() and "devices join with" in _text(tmp_path / "server.log"),
            60,
            "the server's credentials and broker",
        )
        url = _text(tmp_path / "server.log").split("join --broker ", 1)[1].split()[0]
        data = f"synthetic:n={20 * n},n_test={4 * n}"
        for i in range(n):
            cred, _ = read_device_credentials(creds / f"device-{i + 1}.json")
            opts = parse_broker_url(url).with_auth(cred.username, cred.password)
            runners.append(
                DeviceRunner(
                    opts,
                    fed,
                    cred.username,
                    DataSpec(data, partition=(i, n), seed=1),
                    RunnerOptions(connect_timeout=30),
                )
            )
        threads = [threading.Thread(target=r.run, kwargs={"timeout": 180}, daemon=True) for r in runners]
        for t in threads:
            t.start()
        status = state / "status.json"
        _wait(lambda: _status(status).get("round") == 1, 90, "round 1 to open")
        os.kill(server.pid, signal.SIGSTOP)
        stopped = True
        broker_log = state / "broker" / "mosquitto.log"
        _wait(
            lambda: all(r.agent is not None and r.agent.stats.rounds_trained >= 1 for r in runners),
            90,
            "every device to train round 1 and upload",
        )
        assert all(r.transport.flush(30) for r in runners)  # every upload acknowledged by the broker
        assert f"Outgoing messages are being dropped for client protofl-server-{fed}" in _text(broker_log)
        resumed = time.time()
        os.kill(server.pid, signal.SIGCONT)
        stopped = False
        for t in threads:
            t.join(180)
        assert server.wait(60) == 0
    finally:
        if stopped:
            os.kill(server.pid, signal.SIGCONT)
        for r in runners:
            r.stop()
        if server.poll() is None:
            server.kill()
        log.close()
    out = _text(tmp_path / "server.log")
    rounds = [json.loads(line) for line in (state / "rounds.jsonl").read_text().splitlines()]
    assert [(r["round"], len(r["clients"]), r["closed_by"]) for r in rounds] == [(1, n, "quorum"), (2, n, "quorum")]
    assert rounds[0]["ended"] - resumed < 30, out  # not its 120 s deadline
    # The metrics the broker dropped with the uploads were asked for again too: each line is over every device.
    assert [r["metrics_from"] for r in rounds] == [n, n], out
    final = _status(state / "status.json")
    assert final["broker_dropped"] > 0 and final["resend_requests"] > 0, final
    assert "the broker dropped" in out and "asked" in out and "to re-send" in out, out


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _status(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _wait(pred: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.mosquitto
def test_only_the_server_writes_a_devices_request_topic_and_reads_the_drop_counter(
    start_mosquitto: Callable[..., MosquittoBroker], tmp_path: Path
) -> None:
    from broker_server.ops.broker import DROPPED_TOPIC
    from broker_server.ops.security import load_or_create
    from protofl import topics
    from tests.broker_server.test_security import Inbox, connect

    fed = "sec"
    auth = load_or_create(tmp_path / "security", fed, ["dev-a", "dev-b"])
    broker = start_mosquitto(persistence=False, allow_anonymous=False, extra_config=auth.mosquitto_lines())
    s = auth.secrets
    server = connect(broker.url, s.server.username, s.server.password)
    dev_a = connect(broker.url, "dev-a", s.devices["dev-a"])
    dev_b = connect(broker.url, "dev-b", s.devices["dev-b"])
    monitor = connect(broker.url, s.monitor.username, s.monitor.password)
    try:
        at_server, at_b, at_a, at_monitor = Inbox(), Inbox(), Inbox(), Inbox()
        server.subscribe(DROPPED_TOPIC, at_server)
        at_server.wait_for(b"0")  # the broker's counter (retained $SYS), readable by the server
        dev_a.subscribe(f"{topics.ROOT}/{fed}/down/#", at_a)  # a device trying to read others' requests
        dev_a.subscribe(DROPPED_TOPIC, at_a)
        monitor.subscribe(f"{topics.ROOT}/{fed}/down/#", at_monitor)
        monitor.subscribe(topics.server_status(fed), at_monitor)
        server.publish(topics.server_status(fed), b"status", retain=True)
        at_monitor.wait_for(b"status")  # its subscriptions, sent before, are in place
        dev_b.subscribe(topics.down(fed, "dev-b"), at_b)
        b_status = Inbox()
        dev_b.subscribe(topics.server_status(fed), b_status)  # sent after the one above, on one connection:
        b_status.wait_for(b"status")  # its retained status delivered = both subscriptions are in place
        server.publish(topics.down(fed, "dev-b"), b"request from the server")
        at_b.wait_for(b"request from the server")
        dev_a.publish(topics.down(fed, "dev-b"), b"forged request")  # the broker drops it
        assert dev_a.flush(5)
        server.publish(topics.down(fed, "dev-a"), b"fence")  # after dev-a's forgery was handled
        at_a.wait_for(b"fence")
        server.publish(topics.down(fed, "dev-b"), b"fence")
        at_b.wait_for(b"fence")
        assert at_b.payloads() == [b"request from the server", b"fence"]
        assert at_a.payloads() == [b"fence"]  # its own requests only; no counter, nobody else's requests
        server.publish(topics.server_status(fed), b"monitor fence")  # after every request above
        at_monitor.wait_for(b"monitor fence")
        assert at_monitor.payloads() == [b"status", b"monitor fence"]  # no device's requests
    finally:
        for t in (server, dev_a, dev_b, monitor):
            t.close(timeout=1)

"""Sharded aggregators for real: `protofl-server start --shards 2` (the default secured spawned Mosquitto,
generated credentials, shards as child processes on a shared subscription) against numpy devices, each
with its own credentials file; a shard killed with SIGKILL mid-round is restarted, resumes from its
journal, and the federation's result is still one aggregator's (the same start without --shards)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker_server.core.journal import scan
from broker_server.ops.broker import free_port
from protofl.transport.broker_url import parse_broker_url
from protofl.transport.credentials import read_device_file
from protofl.transport.mqtt import Backoff, MqttTransport
from tests.broker_server.shard_helpers import FED, NumpyDevice, config

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO))
DEVICES = 4
ROUNDS = 3


class HeldDevice(NumpyDevice):
    """Answers round messages at once, except in `hold_round`, where it waits for `release`."""

    def __init__(self, *args: Any, hold_round: int = 0) -> None:
        self.hold_round = hold_round
        self.held: list[tuple[str, bytes]] = []
        self.released = threading.Event()
        super().__init__(*args)

    def on_round(self, topic: str, payload: bytes) -> None:
        if self.hold_round and not self.released.is_set() and f"round {self.hold_round}" in self._round_of(payload):
            self.held.append((topic, payload))
            return
        super().on_round(topic, payload)

    @staticmethod
    def _round_of(payload: bytes) -> str:
        from protofl.wire import read_header

        return f"round {read_header(payload).round}" if payload else ""

    def release(self) -> None:
        self.released.set()
        for topic, payload in self.held:
            super().on_round(topic, payload)


def run_federation(tmp: Path, shards: int, kill_mid_round: bool) -> tuple[dict[str, np.ndarray], list[dict], str]:
    port, state = free_port(), tmp / f"state-{shards}"
    cmd = [
        sys.executable,
        "-m",
        "broker_server.cli",
        "start",
        "--preset",
        "fedproto",
        "--fed",
        FED,
        "--port",
        str(port),
        "--rounds",
        str(ROUNDS),
        "--min-clients",
        str(DEVICES),
        "--devices",
        str(DEVICES),
        "--round-timeout",
        "120",
        "--state-dir",
        str(state),
        "--set",
        "num_classes=4",
        "--set",
        "proto_dim=8",
        "--set",
        "adapter_rank=2",
        "--verbose",
    ]
    server = subprocess.Popen(
        cmd + (["--shards", str(shards)] if shards else []),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=ENV,
        text=True,
    )
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(server.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    transports: list[MqttTransport] = []
    try:
        creds = state / "security" / "devices"
        # A device joins once the federation is announced (a real one waits for the retained config).
        wait(lambda: any("waiting for 4 client(s)" in line for line in out), 60, "the federation's announcement", out)
        cfg = config("fedproto")  # the plan the server's --set gives (num_classes 4, proto_dim 8)
        devices = []
        for i in range(DEVICES):
            name, t = connect_device(creds, port, i)
            transports.append(t)
            devices.append(HeldDevice(name, i, cfg, t, hold_round=2 if i >= 2 and kill_mid_round else 0))
        for d in devices:
            d.join()
        if kill_mid_round:
            # Round 2: devices 1 and 2 have uploaded and a shard has journaled some of it; SIGKILL that shard,
            # then the rest upload (some into the dead shard's session, which waits for its restart).
            journals = [state / "shards" / f"shard-{i}" / "journal.log" for i in range(shards)]
            wait(lambda: sum(len(uploads(j, 2)) for j in journals) == 2, 60, "round 2's first uploads", out)
            victim = next(i for i, j in enumerate(journals) if uploads(j, 2))
            pid = shard_pid(out, victim)
            os.kill(pid, signal.SIGKILL)
            wait(lambda: any(f"shard {victim} (pid {pid}) died" in line for line in out), 30, "the restart", out)
        for d in devices[2:]:
            d.release()
        server.wait(120)
        reader.join(5)
    finally:
        close_all(transports, [server])
    text = "".join(out)
    assert server.returncode == 0, text
    model = dict(np.load(state / "server_model.npz"))
    rounds = [json.loads(line) for line in (state / "rounds.jsonl").read_text().splitlines()]
    return model, rounds, text


def connect_device(creds: Path, port: int, i: int) -> tuple[str, MqttTransport]:
    """Device i+1 connected to the federation's broker with its generated credentials."""
    found = read_device_file(creds / f"device-{i + 1}.json")
    name = found.credentials.username
    opts = parse_broker_url(f"mqtt://127.0.0.1:{port}").with_auth(name, found.credentials.password)
    return name, MqttTransport(opts, name, backoff=Backoff(0.1, 1.0)).connect(10)


def close_all(transports: list[MqttTransport], procs: list[subprocess.Popen[Any]]) -> None:
    """A test's clean-up, whatever happened: the devices' connections, then any process still running."""
    for t in transports:
        t.close()
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def uploads(journal: Path, round_: int) -> list[str]:
    if not journal.exists():
        return []
    return [r.client for r in scan(journal.read_bytes())[0] if r.round == round_]


def shard_pid(out: list[str], index: int) -> int:
    for line in out:
        m = re.search(r"aggregator shard\(s\) running \(pids ([\d ]+);", line)
        if m:
            return int(m.group(1).split()[index])
    raise AssertionError("no shard pids in the server's log")


def wait(pred: Any, timeout: float, what: str, out: list[str]) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}:\n{''.join(out)}")


@pytest.mark.slow
def test_a_shard_killed_mid_round_resumes_and_the_result_is_one_aggregators(tmp_path: Path) -> None:
    one, one_rounds, _ = run_federation(tmp_path, 0, kill_mid_round=False)
    two, two_rounds, text = run_federation(tmp_path, 2, kill_mid_round=True)
    assert (
        "resumed round 2 train"
        in (tmp_path / "state-2" / "shards").joinpath(f"shard-{0}.log").read_text()
        + (tmp_path / "state-2" / "shards" / "shard-1.log").read_text()
    )
    assert set(one) == set(two)
    for key in one:
        np.testing.assert_allclose(one[key], two[key], rtol=1e-5, atol=1e-6, err_msg=key)
    strip = ("started", "ended", "local_acc", "global_acc", "local_proto_acc", "global_proto_acc")
    assert [{k: v for k, v in r.items() if k not in strip} for r in one_rounds] == [
        {k: v for k, v in r.items() if k not in strip} for r in two_rounds
    ]
    assert "dropped uploads none" in text, text


@pytest.mark.slow
def test_a_site_pre_aggregator_behind_a_real_mosquitto_bridge(tmp_path: Path) -> None:
    """A site Mosquitto bridged to the core Mosquitto with `site.bridge_topics` (uploads stay at the site): the
    site's pre-aggregator (`ShardService --site`) folds its three devices' uploads, the coordinator the two
    core devices' and merges the site's partial; the result is one aggregator's."""
    from broker_server.ops.broker import MosquittoBroker
    from broker_server.scaleout.shard_service import ShardService, shard_transport
    from broker_server.scaleout.site import bridge_topics
    from broker_server.service import AggregatorService, server_transport
    from broker_server.settings import Broker, Federation, Pacing, Sharding, ShardSettings
    from tests.broker_server.mqtt_helpers import ServiceThread
    from tests.broker_server.shard_helpers import assert_close, model_state, record_state
    from tests.broker_server.test_shards import CLIENTS, federate

    cfg = config("fedproto")
    one, _ = federate(cfg, 0)
    core = MosquittoBroker(workdir=tmp_path / "core").start()
    site = None
    transports: list[MqttTransport] = []
    try:
        site = MosquittoBroker(
            workdir=tmp_path / "site",
            extra_config=[
                f"connection protofl-{FED}-a",
                f"address 127.0.0.1:{core.port}",
                "bridge_protocol_version mqttv311",
                "try_private true",
                "cleansession false",
                "notifications false",
                *bridge_topics(FED, "a"),
            ],
        ).start()
        pre_settings = ShardSettings(FED, tmp_path / "pre", site="a", fsync=False)
        pre = ShardService(pre_settings, shard_transport(pre_settings, Broker(parse_broker_url(site.url))))
        pre.start(10)
        pre_thread = threading.Thread(target=pre.run, daemon=True)
        pre_thread.start()
        service = AggregatorService(
            Federation(cfg, FED, expected_clients=CLIENTS),
            server_transport(Broker(parse_broker_url(core.url)), FED),
            sharding=Sharding(sites=["a"]),
            pacing=Pacing(log_grace=0.1),
        )
        server = ServiceThread(service, timeout=120).start()  # returns once the site's hello came over the bridge
        for i, name in enumerate(CLIENTS):
            t = MqttTransport(parse_broker_url((core if i < 2 else site).url), name, backoff=Backoff(0.1, 1.0))
            transports.append(t.connect(10))
            NumpyDevice(name, i, cfg, t).join_when_announced()
        server.join(120)
        pre_thread.join(10)
        assert service.finished and not service.aggregator.dropped, service.aggregator.dropped
        assert pre.shard.folded == 3 * cfg.rounds and not pre.shard.dropped, pre.shard.dropped
        assert_close(model_state(one.model), model_state(service.aggregator.model))
        assert [record_state(r) for r in one.records] == [record_state(r) for r in service.aggregator.records]
        service.close()
        pre.close()
    finally:
        for t in transports:
            t.close()
        for b in (site, core):
            if b is not None:
                b.stop()


@pytest.mark.slow
@pytest.mark.parametrize("end", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "stopped"])
def test_a_shard_gone_for_good_loses_nothing_once_its_session_expires(tmp_path: Path, end: signal.Signals) -> None:
    """A remote shard (`--no-spawn-shards`, nobody restarts it) is SIGKILLed (or stopped: SIGTERM, a clean
    DISCONNECT that asks for its will all the same) for good after the joins, before
    round 1's uploads. The broker hands each member of the shared subscription its share whether it is
    connected or not, so part of round 1's uploads wait in the dead shard's session. When that session expires
    (its `--shard-timeout`, 2 s here) the broker publishes the shard's will; the coordinator asks the devices
    that owe round 1 to send again, and the live shard, alone in the group now, gets those and every later
    upload: every round closes with all 8 devices (--min-clients 8: nothing may be missing), long before the
    deadline. With an hour's session and no will, round 1 never completed."""
    devices, timeout, deadline = 8, "2", 60.0
    port, state = free_port(), tmp_path / "state"
    cmd = [
        sys.executable,
        "-m",
        "broker_server.cli",
        "start",
        "--preset",
        "fedproto",
        "--fed",
        FED,
        "--port",
        str(port),
        "--rounds",
        "3",
        "--min-clients",
        str(devices),
        "--devices",
        str(devices),
        "--round-timeout",
        f"{deadline:g}",
        "--state-dir",
        str(state),
        "--set",
        "num_classes=4",
        "--set",
        "proto_dim=8",
        "--set",
        "adapter_rank=2",
        "--shards",
        "2",
        "--no-spawn-shards",
        "--shard-timeout",
        timeout,
        "--verbose",
    ]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(server.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    shards: list[subprocess.Popen[bytes]] = []
    transports: list[MqttTransport] = []
    try:
        wait(lambda: (state / "security" / "shards" / "shard-1.json").exists(), 60, "the shards' credentials", out)
        for i in range(2):
            with (tmp_path / f"shard-{i}.log").open("wb") as log:
                shards.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "broker_server.cli",
                            "shard",
                            "--broker",
                            f"mqtt://127.0.0.1:{port}",
                            "--fed",
                            FED,
                            "--index",
                            str(i),
                            "--credentials",
                            str(state / "security" / "shards" / f"shard-{i}.json"),
                            "--state-dir",
                            str(tmp_path / f"shard-{i}"),
                            "--shard-timeout",
                            timeout,
                        ],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=ENV,
                    )
                )
        wait(lambda: any(f"waiting for {devices} client(s)" in line for line in out), 60, "the announcement", out)
        cfg = config("fedproto")
        held = []
        for i in range(devices):
            name, t = connect_device(state / "security" / "devices", port, i)
            transports.append(t)
            held.append(HeldDevice(name, i, cfg, t, hold_round=1))
        for d in held:
            d.join()
        wait(lambda: all(d.held for d in held), 60, "round 1 at every device", out)
        shards[1].send_signal(end)  # its machine is gone (or its operator stopped it): no restart
        assert shards[1].wait(30) == (0 if end == signal.SIGTERM else -signal.SIGKILL)
        for d in held:
            d.release()
        wait(lambda: server.poll() is not None, deadline + 60, "the federation's end", out)
        reader.join(5)
    finally:
        close_all(transports, [*shards, server])
    text = "".join(out)
    assert server.returncode == 0, text
    assert "shard-1 is gone: its session at the broker ended" in text, text
    rounds = [json.loads(line) for line in (state / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2, 3], rounds
    for r in rounds:
        assert len(r["clients"]) == devices, (r, text)
        assert r["ended"] - r["started"] < deadline / 2, (r, text)  # complete, not closed by the deadline

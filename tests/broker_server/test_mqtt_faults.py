"""Faults over a real Mosquitto: a device killed mid-round, a broker restarted mid-run, hostile uploads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from broker_server.core.shell import Aggregator
from broker_server.ops.broker import MosquittoBroker
from broker_server.service import AggregatorService, server_transport
from broker_server.settings import Broker, Federation, Pacing
from broker_server.simulation import SimulationSpec, prepare
from edge_agent.ops.local_data import DataSpec
from edge_agent.ops.runner import DeviceRunner, RunnerOptions
from protofl import topics
from protofl.presets import make_config
from protofl.transport import InProcessBroker
from protofl.transport.broker_url import parse_broker_url
from protofl.transport.mqtt import MqttTransport
from protofl.wire import Join, ProtoSet, ProtoUpload, encode_message
from tests.broker_server.mqtt_helpers import ServiceThread, Watcher, fast_backoff
from tests.pipelines import NO_FLOOR

REPO = Path(__file__).resolve().parents[2]
DATA = "synthetic:n=1500,n_test=100"


def join_process(url: str, fed: str, i: int, n: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "edge_agent.cli",
        "join",
        "--broker",
        url,
        "--fed",
        fed,
        "--client-id",
        f"client-{i:03d}",
        "--data",
        DATA,
        "--partition",
        f"{i}/{n}",
        "--seed",
        "4",
        "--threads",
        "1",
        "--device",
        "cpu",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with log.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


@pytest.mark.slow
@pytest.mark.mosquitto
def test_killed_agent_leaves_the_round_at_once_then_rejoins(mosquitto: MosquittoBroker, tmp_path: Path) -> None:
    # kill -9 of one of three devices: its last will ("offline") takes it out of the round's expected set,
    # so the round closes at quorum in seconds, not at its 60 s deadline; restarted, it joins again.
    fed, n, timeout = "killtest", 3, 60.0
    # the step floor off (tests/pipelines.py NO_FLOOR): rounds go on until the restarted device is back in one
    spec = SimulationSpec(preset="fedproto", dataset=DATA, clients=n, rounds=30, seed=4, overrides=NO_FLOOR)
    cfg = prepare(spec).cfg
    cfg = cfg.replace(min_clients=2, round_timeout=timeout)
    ids = [f"client-{i:03d}" for i in range(n)]
    watcher = Watcher(mosquitto.url, fed)
    service = AggregatorService(
        Federation(cfg, fed, expected_clients=ids), server_transport(Broker(parse_broker_url(mosquitto.url)), fed)
    )
    runner = ServiceThread(service, timeout=120).start()
    procs = [join_process(mosquitto.url, fed, i, n, tmp_path / f"{i}.log") for i in range(n)]
    records = service.aggregator.records
    try:
        # Kill client-001 the moment round 2 opens: it is training, its upload not sent yet.
        watcher.wait(lambda w: (2, "train") in w.rounds, 90, "round 2")
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        watcher.wait(lambda w: "offline" in w.presence.get("client-001", []), 10, "the last will of client-001")
        watcher.wait(lambda w: (4, "train") in w.rounds, 20, "rounds 2 and 3 to close at quorum")
        procs[1] = join_process(mosquitto.url, fed, 1, n, tmp_path / "1.log")  # the device comes back
        end = time.monotonic() + 60
        while not any("client-001" in r.clients for r in records[3:]) and time.monotonic() < end:
            time.sleep(0.2)
        service.stop()
        runner.thread.join(10)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        service.close()
        watcher.close()
    r1, r2, r3 = records[:3]
    assert r1.clients == ids and r1.closed_by == "quorum"
    for r in (r2, r3):
        assert r.clients == ["client-000", "client-002"] and r.closed_by == "quorum", r
        assert r.ended - r.started < timeout / 3, r
    # Restarted, it re-joined, resumed from the retained round message and took part in a later round.
    back = [r for r in records[3:] if "client-001" in r.clients]
    assert back and back[0].clients == ids and back[0].closed_by == "quorum", records


@pytest.mark.slow
@pytest.mark.mosquitto
def test_broker_restart_mid_run_everyone_reconnects(start_mosquitto, tmp_path: Path) -> None:
    # No persistence: the restarted broker has forgotten retained messages, sessions and subscriptions.
    broker: MosquittoBroker = start_mosquitto(persistence=False)
    fed, n = "restart", 3
    spec = SimulationSpec(
        preset="tinyproto", dataset="synthetic:n=600,n_test=100", clients=n, rounds=4, seed=1, overrides=NO_FLOOR
    )
    cfg = prepare(spec).cfg.replace(min_clients=1, round_timeout=8.0)
    opts = parse_broker_url(broker.url)
    watcher = Watcher(broker.url, fed)
    ids = [f"client-{i:03d}" for i in range(n)]
    transport = server_transport(Broker(opts), fed)
    transport.backoff = fast_backoff()
    service = AggregatorService(Federation(cfg, fed, expected_clients=ids), transport)
    runner = ServiceThread(service, timeout=120).start()
    devices = [
        DeviceRunner(opts, fed, f"client-{i:03d}", DataSpec(spec.dataset, partition=(i, n), seed=1), RunnerOptions())
        for i in range(n)
    ]
    results: dict[str, object] = {}
    threads = [
        threading.Thread(target=lambda d=d: results.__setitem__(d.client_id, d.run(timeout=120)), daemon=True)
        for d in devices
    ]
    for t in threads:
        t.start()
    try:
        watcher.wait(lambda w: (2, "train") in w.rounds, 60, "round 2")
        broker.stop()
        time.sleep(1.0)
        broker.start()  # same port, same config
        runner.join(120)
        for t in threads:
            t.join(30)
    finally:
        for d in devices:
            d.stop()
        service.close()
        watcher.close()
    assert service.finished and len(service.aggregator.records) == 4
    assert service.transport.connects >= 2  # the aggregator reconnected by itself ...
    for d in devices:  # ... and so did every device, and each saw the federation to its end
        assert d.transport.stats.connects >= 2
        assert d.agent is not None and d.agent.finished and d.fatal is None
    assert all(len(r.clients) >= 1 for r in service.aggregator.records)


# -- hostile and stale uploads ----------------------------------------------------------------


def _upload(client: str, round_: int, seed: int, sender: str | None = None) -> bytes:
    rng = np.random.default_rng(seed)
    protos = ProtoSet(
        classes=np.arange(3), values=rng.normal(size=(3, 8)).astype(np.float32), counts=np.asarray([5, 6, 7]), dt="f4"
    )
    return encode_message(
        ProtoUpload(local=protos, public=None, n_samples=18),
        fed="drops",
        sender=sender or client,
        round=round_,
        phase="train",
    )


def _join(client: str) -> bytes:
    return encode_message(Join(arch="", n_samples=18, profile="", agent_version="test"), fed="drops", sender=client)


@pytest.mark.mosquitto
def test_past_duplicate_and_spoofed_uploads_are_dropped_and_change_nothing(mosquitto: MosquittoBroker) -> None:
    cfg = make_config(
        "fedproto", rounds=2, min_clients=2, proto_dim=8, adapter_rank=4, num_classes=3, round_timeout=60.0
    )
    ids = ["c0", "c1"]
    # Reference: the same honest uploads through the in-process aggregator.
    broker = InProcessBroker()
    ref = Aggregator(cfg, "drops", broker.connect("server"), expected_clients=ids)
    ref.start()
    dev = broker.connect("dev")
    for c in ids:
        dev.publish(topics.up("drops", c), _join(c))
    for r in (1, 2):
        for k, c in enumerate(ids):
            dev.publish(topics.up("drops", c), _upload(c, r, seed=10 * r + k))
    broker.pump()
    assert ref.finished and ref.dropped == {}

    service = AggregatorService(
        Federation(cfg, "drops", expected_clients=ids),
        server_transport(Broker(parse_broker_url(mosquitto.url)), "drops"),
        pacing=Pacing(log_grace=0.5),
    )
    runner = ServiceThread(service, timeout=60).start()
    agg = service.aggregator
    client = MqttTransport(mosquitto.url, "attacker", backoff=fast_backoff()).connect(10)
    # The server's retained config is published after its subscriptions, on the same connection: once it is
    # here, the broker has them (service.start does not wait for the SUBACK; a join sent before could reach no
    # subscriber on a loaded machine).
    announced = threading.Event()
    client.subscribe(topics.config("drops"), lambda t, p: announced.set())
    assert announced.wait(20), "the server never announced the federation"

    def send(topic_client: str, payload: bytes, until: Callable[[], bool]) -> None:
        client.publish(topics.up("drops", topic_client), payload)
        end = time.monotonic() + 10
        while not until():
            assert time.monotonic() < end, f"aggregator did not process the message (dropped {agg.dropped})"
            time.sleep(0.01)

    def joined(cid: str) -> Callable[[], bool]:
        return lambda: cid in agg.clients

    def received() -> dict[str, set[str]]:
        """Who sent what in the open phase (nothing between phases)."""
        phase = agg.machine.phase
        return {} if phase is None else {k: {u.value for u in v} for k, v in phase.received.items()}

    try:
        for c in ids:
            send(c, _join(c), joined(c))
        send("c0", _upload("c0", 1, seed=10), lambda: "c0" in received())
        before = received()
        send("c0", _upload("c0", 1, seed=10), lambda: agg.dropped.get("duplicate") == 1)
        # c0's upload published on c1's topic: the topic's client id differs from the sender
        send("c1", _upload("c0", 1, seed=99, sender="c0"), lambda: agg.dropped.get("sender_mismatch") == 1)
        assert received() == before == {"c0": {"protos"}}
        send("c1", _upload("c1", 1, seed=11), lambda: agg.round == 2)
        # round 1 is over: a replay of a round-1 upload is stale
        send("c0", _upload("c0", 1, seed=10), lambda: agg.dropped.get("stale") == 1)
        send("c0", _upload("c0", 2, seed=20), lambda: "c0" in received())
        send("c1", _upload("c1", 2, seed=21), lambda: agg.finished)
        runner.join(30)
    finally:
        client.close()
        service.close()
    assert agg.dropped == {"duplicate": 1, "sender_mismatch": 1, "stale": 1}
    assert [r.clients for r in agg.records] == [ids, ids]
    got, want = (a.model.rules.state_values()["prototypes"] for a in (agg, ref))
    assert sorted(got) == sorted(want) == [0, 1, 2]
    for k in want:  # same uploads in the same order: bit-identical
        np.testing.assert_array_equal(got[k], want[k])


def test_agents_are_started_on_the_simulations_device() -> None:
    from broker_server.simulation.mqtt import join_args

    spec = SimulationSpec(preset="fedproto", dataset=DATA, clients=3, device="cuda")
    args = join_args(spec, parse_broker_url("mqtt://127.0.0.1:1883"), "5", 2)
    assert args[args.index("--device") + 1] == "cuda"
    assert args[args.index("--client-id") + 1] == "client-002" and args[args.index("--partition") + 1] == "2/3"


@pytest.mark.mosquitto
def test_a_simulation_that_runs_out_of_time_names_every_sides_drops(mosquitto: MosquittoBroker) -> None:
    from broker_server.simulation import run_simulation

    # 1000 rounds cannot finish in 3 s; the agents are threads, so their drops can be read.
    spec = SimulationSpec(
        preset="fedproto",
        dataset="synthetic:n=400,n_test=50",
        clients=2,
        rounds=1000,
        seed=1,
        archs=("mlp",),
        transport="mqtt",
        agents="thread",
        timeout=3,
        broker=parse_broker_url(mosquitto.url),
    )
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 3 s") as err:
        run_simulation(spec)
    assert "dropped by the aggregator: none; by the agents: none" in str(err.value)
    assert time.monotonic() - start < 30  # the agent threads were stopped, not waited for

"""The device loop (`DeviceRunner`, `protofl-edge join`): data shares, join gating, errors."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
from typer.testing import CliRunner

from broker_server.ops.broker import MosquittoBroker, free_port
from broker_server.service import AggregatorService, server_transport
from broker_server.settings import Broker, Federation
from broker_server.simulation import SimulationSpec, prepare
from edge_agent.cli import app
from edge_agent.core.outcome import Outcome, Send
from edge_agent.ops.local_data import DataSpec, dataset_spec, load_client_data, parse_partition
from edge_agent.ops.runner import DeviceRunner, RunnerOptions
from protofl import topics
from protofl.errors import ConfigError, DataError
from protofl.transport.broker_url import parse_broker_url
from protofl.transport.link_proxy import LinkProxy, LinkShape
from protofl.transport.mqtt import MqttTransport
from protofl.wire import Status, decode_message
from tests.broker_server.mqtt_helpers import ServiceThread, fast_backoff
from tests.conftest import EVENT_WAIT_S
from tests.wire_helpers import decode_as

DATA = "synthetic:n=600,n_test=100"


def test_partition_share_is_the_simulators() -> None:
    spec = SimulationSpec(preset="protofl", dataset=DATA, clients=4, alpha=0.3, seed=7, test_limit=50, train_limit=500)
    fed = prepare(spec)
    for i in (0, 3):
        mine = load_client_data(
            DataSpec(DATA, partition=(i, 4), alpha=0.3, test_limit=50, train_limit=500), fed.cfg, f"client-{i:03d}"
        )
        part = fed.split.clients[i]
        np.testing.assert_array_equal(mine.x_train, fed.train.normalized(part.train))
        np.testing.assert_array_equal(mine.y_test, fed.train.y[part.test])
        np.testing.assert_array_equal(mine.x_global, fed.test.normalized())  # first 50 test samples


def test_whole_dataset_split_locally_without_partition() -> None:
    cfg = prepare(SimulationSpec(preset="fedproto", dataset=DATA, clients=2)).cfg
    data = load_client_data(DataSpec(DATA), cfg, "rpi-07")
    assert len(data.y_train) + len(data.y_test) == 600 and len(data.y_train) == 450
    assert data.x_global is None  # a field device reports accuracy on its own held-out data only


def test_data_arguments_are_checked(tmp_path) -> None:
    assert parse_partition("3/20") == (3, 20)
    for bad in ("3", "20/20", "a/b", "-1/4"):
        with pytest.raises(ConfigError, match="--partition"):
            parse_partition(bad)
    (tmp_path / "d.npz").write_bytes(b"")
    assert dataset_spec(str(tmp_path / "d.npz")) == f"npz:{tmp_path / 'd.npz'}"
    assert dataset_spec(str(tmp_path)) == f"idx:{tmp_path}"
    with pytest.raises(DataError, match="not a dataset spec"):
        dataset_spec("/no/such/place")
    cfg = prepare(SimulationSpec(preset="fedproto", dataset=DATA, clients=2)).cfg.replace(num_classes=5)
    with pytest.raises(DataError, match="expects 5 classes"):
        load_client_data(DataSpec(DATA), cfg, "x")


@pytest.mark.mosquitto
def test_device_waits_for_the_server_then_joins_and_finishes(mosquitto: MosquittoBroker) -> None:
    fed = "gate"
    opts = parse_broker_url(mosquitto.url)
    seen: list[tuple[str, bytes]] = []
    arrived = {topic: threading.Event() for topic in (f"protofl/{fed}/spy-ready", topics.presence(fed, "client-000"))}
    done = threading.Event()  # the device's last presence ("done") reached the spy

    def spied(topic: str, payload: bytes) -> None:
        if topic in arrived and not arrived[topic].is_set():
            arrived[topic].set()
        seen.append((topic, payload))
        if topic == topics.presence(fed, "client-000") and payload and decode_as(Status, payload).state == "done":
            done.set()

    spy = MqttTransport(opts, "spy", backoff=fast_backoff()).connect(10)
    spy.subscribe(f"protofl/{fed}/#", spied)
    spy.publish(f"protofl/{fed}/spy-ready", b"ready")  # its own message back: the subscription is in place
    assert arrived[f"protofl/{fed}/spy-ready"].wait(EVENT_WAIT_S), "the spy's subscription never took effect"
    seen.clear()
    device = DeviceRunner(opts, fed, "client-000", DataSpec(DATA, partition=(0, 2), seed=3), RunnerOptions())
    result: dict[str, object] = {}
    t = threading.Thread(target=lambda: result.setdefault("agent", device.run(timeout=60)), daemon=True)
    t.start()
    assert arrived[topics.presence(fed, "client-000")].wait(EVENT_WAIT_S), "the device never announced itself"
    # No server yet: the device announced itself and waits (the join order is checked at the end).
    assert decode_message(seen[0][1])[1] == Status(state="online", detail="")

    cfg = prepare(SimulationSpec(preset="tinyproto", dataset=DATA, clients=2, rounds=2, seed=3)).cfg
    service = AggregatorService(Federation(cfg.replace(min_clients=1), fed), server_transport(Broker(opts), fed))
    runner = ServiceThread(service, timeout=60).start()
    runner.join(60)
    t.join(EVENT_WAIT_S)
    service.close()
    # The device's "done" presence may reach the spy after the device returned (a loaded machine): wait for it.
    assert done.wait(EVENT_WAIT_S), "the device never said it was done"
    spy.close()
    agent = result["agent"]
    assert agent is not None and agent.finished and agent.stats.rounds_trained == 2  # type: ignore[attr-defined]
    assert [len(r.clients) for r in service.aggregator.records] == [1, 1]
    ups = [decode_message(p)[0].kind for tp, p in seen if tp == topics.up(fed, "client-000")]
    assert ups[0] == "join" and ups.count("join") == 1
    # No join into the void, however late: mosquitto delivers to the spy in the order it handled the
    # messages, so a join sent before the server spoke would come before the server's first message.
    server_topics = {topics.server_status(fed), topics.config(fed)}
    first_server = next(i for i, (tp, _) in enumerate(seen) if tp in server_topics)
    first_join = next(i for i, (tp, _) in enumerate(seen) if tp == topics.up(fed, "client-000"))
    assert seen[0][0] == topics.presence(fed, "client-000") and first_server < first_join
    last_presence = [p for tp, p in seen if tp == topics.presence(fed, "client-000")][-1]
    assert decode_as(Status, last_presence).state == "done"


def test_join_cli_errors_say_what_to_do() -> None:
    cli = CliRunner()
    r = cli.invoke(app, ["join", "--client-id", "bad id!", "--data", DATA])
    assert r.exit_code == 2 and "--client-id 'bad id!'" in r.output
    port = free_port()
    r = cli.invoke(
        app,
        ["join", "--broker", f"mqtt://127.0.0.1:{port}", "--client-id", "c1", "--data", DATA, "--connect-timeout", "1"],
    )
    assert r.exit_code == 2
    assert f"cannot reach broker at mqtt://127.0.0.1:{port}" in r.output and "protofl-server start" in r.output
    r = cli.invoke(app, ["join", "--broker", "http://x", "--client-id", "c1", "--data", DATA])
    assert r.exit_code == 2 and "mqtt://, mqtts:// or unix://" in r.output


@pytest.mark.mosquitto
def test_a_round_is_said_uploaded_only_once_the_broker_acknowledged_it(
    mosquitto: MosquittoBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """Handed to a connected socket is not uploaded: the line comes with the broker's PUBACK; a round whose
    acknowledgement never came (the link cut before it) is said so when the device leaves, never "uploaded". On
    main the line said "uploaded" whenever the transport still looked connected (a device frozen, revoked and
    thawed said it uploaded a round the broker never had)."""
    caplog.set_level(logging.INFO, logger="protofl.edge")
    shape = LinkShape(up_bytes_per_s=1e7, down_bytes_per_s=1e7, rtt_s=1.0)  # an acknowledgement is >= 1 s away
    with LinkProxy(("127.0.0.1", mosquitto.port), shape) as link:
        runner = DeviceRunner(parse_broker_url(f"mqtt://{link.address}"), "acks", "dev-1", DataSpec(DATA))
        runner.transport.connect(EVENT_WAIT_S)

        def round_(n: int) -> None:
            up = Send(topics.up("acks", "dev-1"), b"\x01" * 200, "protos", n, "train")
            runner.carry(Outcome(sends=(up,), trained=True))

        def said() -> list[str]:
            return [r.getMessage() for r in caplog.records if r.name == "protofl.edge"]

        round_(1)
        assert not [x for x in said() if "uploaded" in x], said()  # on its way: no PUBACK can have come yet
        assert runner.transport.flush(EVENT_WAIT_S)
        runner._confirm()
        assert said() == ["dev-1: trained, uploaded 200 bytes (protos 200 B)"], said()
        round_(2)
        link.cut(60)  # the link goes before the broker could acknowledge it
        runner.transport.close(timeout=0)
        runner._confirm(final=True)
        assert said()[1:] == [
            "dev-1: trained, 200 bytes (protos 200 B) sent but never acknowledged: the broker may not hold them"
        ], said()

"""An outage in the middle of an upload, over a shaping proxy and a real Mosquitto.

Two devices; client-001 talks through a slow link (10 kB/s up). Once its upload is under way (bytes of
it have reached the broker, the message is not complete) the link goes down:
- for a moment: the device reconnects and the round gets its upload (closed at quorum, both clients);
- for longer than the deadline: the round closes at its deadline without it.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from broker_server.ops.broker import MosquittoBroker
from broker_server.service import AggregatorService, server_transport
from broker_server.settings import Broker, Federation
from broker_server.simulation import SimulationSpec, prepare
from edge_agent.ops.local_data import DataSpec
from edge_agent.ops.runner import DeviceRunner, RunnerOptions
from protofl.transport.broker_url import parse_broker_url
from protofl.transport.link_proxy import LinkProxy, LinkShape
from tests.broker_server.mqtt_helpers import ServiceThread, Watcher

DATA = "synthetic:n=600,n_test=50"
IDS = ["client-000", "client-001"]


def run_with_cut(
    mosquitto: MosquittoBroker, fed: str, cut_s: float, deadline: float
) -> tuple[AggregatorService, LinkProxy]:
    cfg = prepare(SimulationSpec(preset="fedproto", dataset=DATA, clients=2, rounds=1, seed=3)).cfg
    cfg = cfg.replace(min_clients=1, round_timeout=deadline)
    broker = parse_broker_url(mosquitto.url)
    proxy = LinkProxy((broker.host, broker.port), LinkShape(up_bytes_per_s=10_000, down_bytes_per_s=1e6)).start()
    watcher = Watcher(mosquitto.url, fed)
    service = AggregatorService(Federation(cfg, fed, expected_clients=IDS), server_transport(Broker(broker), fed))
    thread = ServiceThread(service, timeout=60).start()
    via = [broker, dataclasses.replace(broker, host=proxy.host, port=proxy.port)]  # client-001 behind the proxy
    runners = [
        DeviceRunner(b, fed, cid, DataSpec(DATA, None, (i, 2), 0.5, 3), RunnerOptions(device="cpu"))
        for i, (cid, b) in enumerate(zip(IDS, via, strict=True))
    ]
    threads = [threading.Thread(target=r.run, kwargs={"timeout": 60}, daemon=True) for r in runners]
    try:
        for t in threads:
            t.start()
        watcher.wait(lambda w: (1, "train") in w.rounds, 30, "round 1")
        before = proxy.stats.up.bytes  # connect, presence, join: the upload is next
        end = time.monotonic() + 30
        while proxy.stats.up.bytes < before + 4000:  # ~4 kB of the ~20 kB prototype upload are through
            assert time.monotonic() < end, "client-001's upload never started"
            time.sleep(0.005)
        proxy.cut(cut_s)
        thread.join(60)
    finally:
        for r in runners:
            r.stop()
        for t in threads:
            t.join(10)
        service.close()
        watcher.close()
        proxy.close()
    return service, proxy


@pytest.mark.slow
@pytest.mark.mosquitto
def test_a_short_outage_mid_upload_is_survived(mosquitto: MosquittoBroker) -> None:
    service, proxy = run_with_cut(mosquitto, "cut-short", cut_s=0.5, deadline=20.0)
    (rec,) = service.aggregator.records
    assert proxy.stats.cuts == 1 and proxy.stats.connections >= 2  # cut, then reconnected
    assert rec.clients == IDS and rec.closed_by == "quorum"  # the upload came through after all


@pytest.mark.slow
@pytest.mark.mosquitto
def test_an_outage_past_the_deadline_closes_the_round_without_the_upload(mosquitto: MosquittoBroker) -> None:
    service, proxy = run_with_cut(mosquitto, "cut-long", cut_s=30.0, deadline=4.0)
    (rec,) = service.aggregator.records
    assert proxy.stats.cuts == 1
    assert rec.clients == ["client-000"] and rec.closed_by == "deadline"
    assert rec.ended - rec.started >= 4.0

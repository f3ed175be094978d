"""The aggregator service is handed its connection (protofl.transport.Connection): over the in-process broker it
runs a federation as over MQTT, journal and all, and ends where one bare aggregator ends; no broker process."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker_server.core.durable import journal_records
from broker_server.service import AggregatorService
from broker_server.settings import Durability, Federation, Pacing
from protofl.transport import Connection, InProcessBroker
from tests.broker_server.shard_helpers import FED, NumpyDevice, assert_close, config, model_state, record_state
from tests.broker_server.test_shards import CLIENTS, federate


@pytest.mark.parametrize("durable", [False, True], ids=["memory", "state-dir"])
def test_the_service_runs_over_an_in_process_connection(tmp_path: Path, durable: bool) -> None:
    cfg = config("fedproto")
    one, _ = federate(cfg, 0)
    broker = InProcessBroker()
    transport: Connection = broker.connect("server")
    service = AggregatorService(
        Federation(cfg, FED, expected_clients=CLIENTS),
        transport,
        durability=Durability(tmp_path if durable else None),
        pacing=Pacing(tick=0.01, log_grace=0.0),
    )
    service.start()
    for i, c in enumerate(CLIENTS):
        NumpyDevice(c, i, cfg, broker.connect(c)).join()
    service.run(timeout=60)
    service.close()
    agg = service.aggregator
    assert service.finished and not agg.dropped, agg.dropped
    assert_close(model_state(one.model), model_state(agg.model))
    assert [record_state(r) for r in one.records] == [record_state(r) for r in agg.records]
    if durable:  # every join and upload journaled once
        assert len(journal_records(tmp_path / "aggregator")) == len(CLIENTS) * (1 + cfg.rounds)


def test_a_durable_service_refuses_a_connection_that_acknowledges_before_the_journal(tmp_path: Path) -> None:
    transport = InProcessBroker().connect("server")
    transport.manual_ack = False
    with pytest.raises(ValueError, match="acknowledges an upload only once it is journaled"):
        AggregatorService(Federation(config("fedproto"), FED), transport, durability=Durability(tmp_path))

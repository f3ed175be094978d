"""Issue 48: the live snapshot kept up per member off the folding thread. The rows the watch thread keeps (only the
members whose inputs were applied are taken again on the folding thread) are the rows a full rebuild gives, through
joins, uploads, a device going offline and phases closing, with one aggregator and with shards; the encoding that
keeps each unchanged row's bytes gives `Snapshot.encode`'s bytes."""

from __future__ import annotations

from typing import Any

import pytest

from broker_server.core.shell import Aggregator
from broker_server.scaleout.coordinator import Coordinator
from broker_server.scaleout.shard import Shard, shard_id
from broker_server.watch.live import LiveWatch
from protofl import topics
from protofl.transport import InProcessBroker
from protofl.wire import Status, encode_message
from tests.broker_server.shard_helpers import FED, NumpyDevice, config
from tests.conftest import EVENT_WAIT_S

CLIENTS = [f"c{i}" for i in range(6)]


@pytest.mark.parametrize("shards", [0, 2])
def test_the_incremental_rows_are_a_full_rebuilds_rows(shards: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("broker_server.watch.live.FULL_S", float("inf"))  # no periodic full rebuild: the rows kept
    cfg = config("tinyproto")  # 4 clients open a round: the 6 join
    broker = InProcessBroker()
    agg: Any
    workers: list[Shard] = []
    if shards:
        agg = Coordinator(cfg, FED, broker.connect("server"), shards=shards, members=[*CLIENTS, "never"])
        workers = [Shard(FED, broker.connect(shard_id(i)), shard=shard_id(i)) for i in range(shards)]
    else:
        agg = Aggregator(cfg, FED, broker.connect("server"), members=[*CLIENTS, "never"])
    watch = LiveWatch(agg)
    for part in (agg, *workers):
        part.start()
    for i, c in enumerate(CLIENTS):
        NumpyDevice(c, i, cfg, broker.connect(c)).join()
    away = broker.connect("away")
    now, checked, handled, gone = 1000.0, 0, 0, False
    while True:
        n = broker.pump(max_messages=3)
        handled += n
        if handled > 12 and not gone:  # one device's last will: it is offline, keeping its place
            gone = True
            offline = encode_message(Status(state="offline"), fed=FED, sender=CLIENTS[-1])
            away.publish(topics.presence(FED, CLIENTS[-1]), offline, retain=True)
        version = watch.board.version
        now += 1000.0
        watch.after_step(n, now=now)
        _, body = watch.board.wait_newer(version, timeout=EVENT_WAIT_S)
        snap = watch.board.latest()
        assert snap is not None
        assert snap.members == watch.observer.members(), f"after {handled} messages"
        assert body == snap.encode()
        checked += 1
        if n == 0:
            break
    states = {m.id: m.state for m in snap.members}
    assert states[CLIENTS[-1]] in ("offline", "left") and states["never"] == "not joined", states
    assert agg.round > 1 and sum(m.uploads for m in snap.members) > len(CLIENTS), (agg.round, snap.members)
    watch.stopped()
    assert watch._thread is not None and not watch._thread.is_alive()

"""Sharded aggregators (docs/design.md, "Scale-out"): 2 and 3 shards on a shared subscription, merged by
their coordinator, reach one aggregator's result for every preset (float tolerance), through the real
messages (encoded uploads, shard progress, partials as versioned msgpack) on the in-process broker; and
what a sharded federation refuses."""

from __future__ import annotations

from typing import Any

import pytest

from protofl.algorithms.robust import ClipPolicy
from protofl.mergeable import NotMergeable
from tests.test_external_technique import installed  # noqa: F401  (a fixture)

from broker_server.coordinator import Coordinator
from broker_server.shard import Shard, shard_id
from broker_server.shell import Aggregator
from protofl.presets import PRESETS
from protofl.transport import InProcessBroker
from tests.broker_server.shard_helpers import FED, NumpyDevice, assert_close, config, model_state, record_state

CLIENTS = [f"d{i}" for i in range(5)]


def federate(cfg: Any, shards: int, policy: ClipPolicy | None = None,
             twice: bool = False) -> tuple[Any, list[Shard]]:
    broker = InProcessBroker()
    workers: list[Shard] = []
    if shards == 0:
        agg: Any = Aggregator(cfg, FED, broker.connect("server"), expected_clients=CLIENTS, policy=policy)
    else:
        agg = Coordinator(cfg, FED, broker.connect("server"), shards=shards, expected_clients=CLIENTS, policy=policy)
        workers = [Shard(FED, broker.connect(shard_id(i)), shard=shard_id(i)) for i in range(shards)]
    agg.start()
    for w in workers:
        w.start()
    devices = [NumpyDevice(c, i, cfg, broker.connect(c)) for i, c in enumerate(CLIENTS)]
    for d in devices:
        d.twice = twice
        d.join()
    broker.pump()
    assert agg.finished, f"round {agg.round}, dropped {agg.dropped}"
    assert all(d.done for d in devices)
    return agg, workers


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_two_and_three_shards_give_one_aggregators_result(preset: str) -> None:
    cfg = config(preset)
    one, _ = federate(cfg, 0)
    assert not one.dropped
    for n in (2, 3):
        coord, shards = federate(cfg, n)
        assert not coord.dropped and not any(s.dropped for s in shards), (coord.dropped, [s.dropped for s in shards])
        assert sum(s.folded for s in shards) == sum(len(one.machine.plan.sends(p)) for p in one.machine.plan.phases) \
            * len(CLIENTS) * cfg.rounds
        assert all(s.folded for s in shards)  # every shard had a share
        assert_close(model_state(one.model), model_state(coord.model), f"{preset}/{n} shards")
        assert [record_state(r) for r in one.records] == [record_state(r) for r in coord.records]


@pytest.mark.parametrize("preset", ["fedproto", "fedavg"])
def test_coordinate_wise_median_is_merged_exactly(preset: str) -> None:
    """`--robust median` keeps every row: the shards' rows together are the one aggregator's rows."""
    cfg, policy = config(preset), ClipPolicy(robust="median")
    one, _ = federate(cfg, 0, policy)
    coord, _ = federate(cfg, 3, policy)
    assert_close(model_state(one.model), model_state(coord.model), preset)


def test_a_copy_on_another_shard_is_counted_once() -> None:
    """Every upload sent twice lands on two shards: the coordinator counts the first, the other shard's
    partial is folded again without it, and the result is still one aggregator's."""
    cfg = config("fedproto")
    one, _ = federate(cfg, 0)
    coord, shards = federate(cfg, 2, twice=True)
    # each copy reached the other shard: refused by the coordinator (or, the phase closed meanwhile, as late)
    assert coord.dropped.get("duplicate", 0) + coord.dropped.get("closing", 0) == len(CLIENTS) * cfg.rounds
    assert coord.dropped.get("duplicate", 0) > 0 and not any(s.dropped for s in shards)
    assert_close(model_state(one.model), model_state(coord.model))
    assert [record_state(r) for r in one.records] == [record_state(r) for r in coord.records]


@pytest.mark.usefixtures("installed")
def test_a_technique_that_is_not_mergeable_is_refused_with_its_reason() -> None:
    from protofl.presets import make_config
    cfg = make_config("fedproto", median_prototypes=True, num_classes=4, proto_dim=8, adapter_rank=2)
    with pytest.raises(NotMergeable, match="median_proto.*cannot run on sharded aggregators"):
        Coordinator(cfg, FED, InProcessBroker().connect("server"), shards=2)


def test_a_shard_restarted_mid_round_resumes_from_its_journal(tmp_path: Any) -> None:
    """Shard 0 stops mid-round (its connection gone, its object dropped, as a SIGKILL leaves it); a new
    one on the same state dir folds its journal again and says again what it has: nothing is lost, nothing
    counted twice (tests/broker_server/test_shards_mqtt.py does it with real processes and Mosquitto)."""
    cfg = config("fedproto")
    one, _ = federate(cfg, 0)
    broker = InProcessBroker()
    coord = Coordinator(cfg, FED, broker.connect("server"), shards=2, expected_clients=CLIENTS)
    shards = [Shard(FED, broker.connect(shard_id(i)), shard=shard_id(i), state_dir=tmp_path / str(i)) for i in (0, 1)]
    coord.start()
    for s in shards:
        s.start()
    devices = [NumpyDevice(c, i, cfg, broker.connect(c)) for i, c in enumerate(CLIENTS)]
    for d in devices:
        d.join()
    restarted = False
    while broker.pump(1):
        phase = coord.machine.phase
        if not restarted and coord.round == 2 and phase is not None and shards[0].accepted \
                and len(phase.received) == 2:
            shards[0].transport.close()
            shards[0].close()
            shards[0] = Shard(FED, broker.connect("shard-0-again"), shard=shard_id(0), state_dir=tmp_path / "0")
            shards[0].start()
            assert shards[0].where == (2, "train") and shards[0].accepted  # from its journal
            restarted = True
    assert restarted and coord.finished, coord.dropped
    assert not coord.dropped
    assert_close(model_state(one.model), model_state(coord.model))
    assert [record_state(r) for r in one.records] == [record_state(r) for r in coord.records]


@pytest.mark.parametrize("when", ["mid_phase", "closing"])
def test_a_coordinator_restarted_from_its_journal_finishes_the_same(tmp_path: Any, when: str) -> None:
    """The coordinator (with its journal and checkpoint) dies mid-phase, or while it waits for the partials;
    restarted, it replays the shards' progress (and merged partials), asks again, and ends as one aggregator."""
    from broker_server.durable import DurableState

    cfg = config("fedproto")
    one, _ = federate(cfg, 0)
    broker = InProcessBroker()

    def coordinator(name: str) -> tuple[Coordinator, DurableState]:
        c = Coordinator(cfg, FED, broker.connect(name), shards=2, expected_clients=CLIENTS)
        durable = DurableState(tmp_path / "agg", FED)
        durable.bind(c)
        c.start(resume=durable.restore())
        return c, durable

    coord, durable = coordinator("server")
    shards = [Shard(FED, broker.connect(shard_id(i)), shard=shard_id(i)) for i in (0, 1)]
    for s in shards:
        s.start()
    for i, c in enumerate(CLIENTS):
        NumpyDevice(c, i, cfg, broker.connect(c)).join()
    restarted = False
    while broker.pump(1):
        phase = coord.machine.phase
        ready = phase is not None and coord.round == 2 and (
            len(phase.received) == 3 if when == "mid_phase" else bool(phase.closing))
        if not restarted and ready:
            coord.transport.close()
            durable.close()
            coord, durable = coordinator("server-again")
            assert coord.round == 2 and coord.machine.phase is not None
            restarted = True
    durable.close()
    assert restarted and coord.finished, coord.dropped
    assert_close(model_state(one.model), model_state(coord.model))
    assert [record_state(r)[:5] for r in one.records] == [record_state(r)[:5] for r in coord.records]

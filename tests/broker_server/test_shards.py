"""Sharded aggregators (docs/design.md, "Scale-out"): 2 and 3 shards on a shared subscription, merged by
their coordinator, reach one aggregator's result for every preset (float tolerance), through the real
messages (encoded uploads, shard progress, partials as versioned msgpack) on the in-process broker; and
what a sharded federation refuses."""

from __future__ import annotations

from typing import Any

import pytest

from broker_server.core.shell import Aggregator
from broker_server.scaleout.coordinator import Coordinator
from broker_server.scaleout.shard import Shard, shard_id
from broker_server.watch.observer import FederationObserver
from protofl.algorithms.robust import ClipPolicy
from protofl.mergeable import NotMergeable
from protofl.presets import PRESETS
from protofl.transport import InProcessBroker, InProcessTransport
from tests.broker_server.shard_helpers import FED, NumpyDevice, assert_close, config, model_state, record_state
from tests.test_external_technique import installed  # noqa: F401  (a fixture)

CLIENTS = [f"d{i}" for i in range(5)]


def federate(
    cfg: Any, shards: int, policy: ClipPolicy | None = None, twice: bool = False, observe: bool = False
) -> tuple[Any, list[Shard]]:
    broker = InProcessBroker()
    workers: list[Shard] = []
    if shards == 0:
        agg: Any = Aggregator(cfg, FED, broker.connect("server"), expected_clients=CLIENTS, policy=policy)
    else:
        agg = Coordinator(cfg, FED, broker.connect("server"), shards=shards, expected_clients=CLIENTS, policy=policy)
        workers = [Shard(FED, broker.connect(shard_id(i)), shard=shard_id(i)) for i in range(shards)]
    if observe:
        agg.observer = FederationObserver(agg)
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
        assert (
            sum(s.folded for s in shards)
            == sum(len(one.machine.plan.sends(p)) for p in one.machine.plan.phases) * len(CLIENTS) * cfg.rounds
        )
        assert all(s.folded for s in shards)  # every shard had a share
        assert_close(model_state(one.model), model_state(coord.model), f"{preset}/{n} shards")
        assert [record_state(r) for r in one.records] == [record_state(r) for r in coord.records]


def test_watchers_see_the_uploads_the_shards_folded() -> None:
    """What `status` and /metrics show (the service thread's observer) counts the shards' uploads as one
    aggregator's: per kind, per member, with each member's last upload."""
    cfg = config("refprotofl")
    one, _ = federate(cfg, 0, observe=True)
    coord, _ = federate(cfg, 2, observe=True)
    assert coord.observer.accepted == one.observer.accepted and sum(coord.observer.accepted.values()) > 0
    ours = {
        m.id: (m.uploads, m.last_upload.round, m.last_upload.kind, m.last_upload.bytes)
        for m in coord.observer.members()
    }
    assert ours == {
        m.id: (m.uploads, m.last_upload.round, m.last_upload.kind, m.last_upload.bytes) for m in one.observer.members()
    }


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
        if not restarted and coord.round == 2 and phase is not None and shards[0].accepted and len(phase.received) == 2:
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


def durable_coordinator(
    cfg: Any, broker: InProcessBroker, name: str, tmp_path: Any, **kwargs: Any
) -> tuple[Coordinator, Any]:
    """A two-shard coordinator with its journal and checkpoint in tmp_path/agg, resumed from them if any."""
    from broker_server.core.durable import DurableState

    c = Coordinator(cfg, FED, broker.connect(name), shards=2, expected_clients=CLIENTS, **kwargs)
    durable = DurableState(tmp_path / "agg", FED)
    durable.bind(c)
    c.start(resume=durable.restore())
    return c, durable


def two_shards(broker: InProcessBroker) -> list[Shard]:
    shards = [Shard(FED, broker.connect(shard_id(i)), shard=shard_id(i)) for i in (0, 1)]
    for s in shards:
        s.start()
    return shards


@pytest.mark.parametrize("when", ["mid_phase", "closing"])
def test_a_coordinator_restarted_from_its_journal_finishes_the_same(tmp_path: Any, when: str) -> None:
    """The coordinator (with its journal and checkpoint) dies mid-phase, or while it waits for the partials;
    restarted, it replays the shards' progress (and merged partials), asks again, and ends as one aggregator."""
    from broker_server.core.durable import DurableState

    cfg = config("fedproto")
    one, _ = federate(cfg, 0)
    broker = InProcessBroker()

    def coordinator(name: str) -> tuple[Coordinator, DurableState]:
        return durable_coordinator(cfg, broker, name, tmp_path)

    (coord, durable), _ = coordinator("server"), two_shards(broker)  # the shards live on the broker
    for i, c in enumerate(CLIENTS):
        NumpyDevice(c, i, cfg, broker.connect(c)).join()
    restarted = False
    while broker.pump(1):
        phase = coord.machine.phase
        ready = (
            phase is not None
            and coord.round == 2
            and (len(phase.received) == 3 if when == "mid_phase" else bool(phase.closing))
        )
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


def test_a_shard_that_never_sends_its_partial_is_given_up_on_after_the_shard_timeout(tmp_path: Any) -> None:
    """Shard 1 dies for good (its machine gone) after folding part of round 1: the close waits `shard_timeout`
    for its partial, then closes without its uploads (counted as `shard_lost`, their devices not among the round's
    clients), and the later phases do not wait for it; while no shard has answered it keeps waiting. A coordinator
    restarted from its journal between the loss and the merge decides the same."""
    from broker_server.core.durable import DurableState

    cfg = config("fedproto").replace(min_clients=2)
    broker = InProcessBroker()
    now = [1000.0]

    def coordinator(name: str) -> tuple[Coordinator, DurableState]:
        return durable_coordinator(cfg, broker, name, tmp_path, shard_timeout=60, clock=lambda: now[0])

    (coord, durable), shards = coordinator("server"), two_shards(broker)
    for i, c in enumerate(CLIENTS):
        NumpyDevice(c, i, cfg, broker.connect(c)).join()
    while broker.pump(1):
        gone = shards[1].transport
        if shards[1].accepted and isinstance(gone, InProcessTransport) and not gone.closed:
            gone.close()  # gone with its machine: what it folded, and what was on its way to it
    phase = coord.machine.phase
    assert coord.round == 1 and phase is not None
    lost = {key.split("/")[0] for key, owner in phase.owners.items() if owner == shard_id(1)}
    kept = {key.split("/")[0] for key, owner in phase.owners.items() if owner == shard_id(0)}
    assert lost and kept
    now[0] += cfg.round_timeout + 1  # the uploads it swallowed never come: the deadline closes the phase
    coord.tick()
    assert phase.closing and coord.round == 1
    now[0] += 61
    coord.tick()  # past the shard timeout, but no shard has answered yet: nobody is given up on
    assert not coord.dropped and coord.round == 1
    broker.pump()  # the close out, shard 0's partial back
    coord._merge_if_complete = lambda: None  # type: ignore[method-assign]  # it dies once the loss is journaled
    coord.tick()
    assert coord.dropped.get("shard_lost") == len(lost) and coord.round == 1, coord.dropped
    # The coordinator dies here; restarted from its journal it replays the loss and waits for shard 0 only.
    coord.transport.close()
    durable.close()
    coord, durable = coordinator("server-again")
    phase = coord.machine.phase
    assert coord.round == 1 and phase is not None and shard_id(1) not in phase.owners.values()
    while broker.pump(1):
        pass
    durable.close()
    rec = coord.records[0]
    assert rec.round == 1 and set(rec.clients) == kept, (rec.clients, lost, kept)
    # Every later phase closes on shard 0's partial alone: no more waiting for shard 1.
    assert coord.finished and [len(r.clients) for r in coord.records[1:]] == [len(CLIENTS)] * (cfg.rounds - 1)
    assert not any(d for k, d in coord.dropped.items() if k != "shard_lost")


def bridge(core: InProcessBroker, site: InProcessBroker, lines: list[str]) -> dict[str, int]:
    """Mosquitto's bridge as `site.bridge_topics` configures it, in process: `out` topics from the site broker
    to the core, `in` topics from the core to the site (retained ones kept retained); counts what went up."""
    up: dict[str, int] = {}
    to_core, to_site = core.connect("bridge"), site.connect("bridge")
    for line in lines:
        _, pattern, direction, _ = line.split()

        def forward(topic: str, payload: bytes, direction: str = direction) -> None:
            parts = topic.split("/")
            what = parts[3] if parts[2] == "shards" else parts[2]  # up, presence, round, ..., progress, partial
            if direction == "out":
                up[what] = up.get(what, 0) + 1
            (to_core if direction == "out" else to_site).publish(
                topic, payload, retain=what not in ("up", "relay", "progress")
            )

        (to_site if direction == "out" else to_core).subscribe(pattern, forward)
    return up


@pytest.mark.parametrize("preset", ["fedproto", "refprotofl"])
def test_a_pre_aggregated_site_gives_one_aggregators_result(preset: str) -> None:
    """Two devices on the core broker, three at a site whose pre-aggregator folds their uploads there: over
    the bridge go its progress batches, one partial per phase, the relayed joins and metrics, never an upload;
    the coordinator folds the core's uploads itself and merges the site's partial: one aggregator's result."""
    from broker_server.ops.security import site_shard
    from broker_server.scaleout.site import bridge_topics

    cfg = config(preset)
    one, _ = federate(cfg, 0)
    core, site = InProcessBroker(), InProcessBroker()
    coord = Coordinator(cfg, FED, core.connect("server"), shards=0, sites=["a"], expected_clients=CLIENTS)
    up = bridge(core, site, bridge_topics(FED, "a"))
    pre = Shard(FED, site.connect("pre"), shard=site_shard("a"), batch=True)
    coord.start()
    pre.start()
    devices = [NumpyDevice(c, i, cfg, (core if i < 2 else site).connect(c)) for i, c in enumerate(CLIENTS)]
    for d in devices:
        d.join()
    while core.pump() + site.pump():
        pre.flush()  # as the shard service does after each batch it pumped
    assert coord.finished, (coord.round, coord.dropped, pre.dropped)
    assert not coord.dropped and not pre.dropped
    assert pre.folded == 3 * cfg.rounds * len(coord.machine.plan.phases)
    assert_close(model_state(one.model), model_state(coord.model))
    assert [record_state(r) for r in one.records] == [record_state(r) for r in coord.records]
    phases = cfg.rounds * len(coord.machine.plan.phases)
    assert up.get("up", 0) == 0 and up["partial"] == phases and up["progress"] <= phases


@pytest.mark.usefixtures("installed")
def test_a_technique_that_does_not_merge_is_refused_with_its_reason_before_anything_starts(tmp_path: Any) -> None:
    from typer.testing import CliRunner

    from broker_server.cli import app
    from protofl.presets import make_config

    cfg = make_config("fedproto", median_prototypes=True, num_classes=4, proto_dim=8, adapter_rank=2)
    with pytest.raises(NotMergeable, match="median_proto.*cannot run on sharded aggregators"):
        Coordinator(cfg, FED, InProcessBroker().connect("server"), shards=2)

    run = CliRunner().invoke(
        app,
        ["start", "--preset", "fedproto-median", "--shards", "2", "--port", "0", "--state-dir", str(tmp_path / "s")],
    )
    assert run.exit_code == 2 and "MedianAggregator" in run.output and "run one aggregator" in run.output, run.output
    assert not (tmp_path / "s").exists()  # no broker, no credentials
    bad = CliRunner().invoke(
        app,
        ["shard", "--broker", "mqtt://127.0.0.1:1", "--index", "0", "--site", "a", "--state-dir", str(tmp_path / "x")],
    )
    assert bad.exit_code == 2 and "either --index I" in bad.output, bad.output

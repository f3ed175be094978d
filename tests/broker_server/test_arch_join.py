"""Issue 42: a device of another architecture in a federation of one model is refused at its join, with the reason,
instead of joining as a zombie; a device that gives up on a round leaves it (the round closes at quorum, not at the
deadline); every drop names its reason and its device in the log and in `status`."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from broker_server.core.shell import Aggregator
from broker_server.watch.observer import FederationObserver
from broker_server.watch.render import header
from broker_server.watch.snapshot import Snapshot
from broker_server.watch.sources import Reading
from edge_agent.ops.resend import refusal
from protofl import topics
from protofl.presets import make_config
from protofl.transport import InProcessBroker
from protofl.wire import Join, ProtoUpload, Status
from tests.broker_server.test_membership import FED, send, upload


def federation(preset: str, **kw: object) -> tuple[InProcessBroker, Aggregator]:
    cfg = make_config(
        preset,
        rounds=3,
        num_classes=2,
        proto_dim=2,
        adapter_rank=1,
        min_clients=2,
        round_timeout=60.0,
        archs=("mlp",),
        public_per_class=0,
    )
    broker = InProcessBroker()
    params = np.zeros(8, np.float32) if cfg.federate == "full" else None
    agg = Aggregator(cfg, FED, broker.connect("server"), clock=lambda: 0.0, initial_params=params, **kw)  # type: ignore[arg-type]
    agg.start()
    return broker, agg


def heard(broker: InProcessBroker, cid: str) -> list[bytes]:
    """What `cid` receives on its own `down/` topic (subscribed before its join, as the runner does)."""
    got: list[bytes] = []
    broker.connect(cid).subscribe(topics.down(FED, cid), lambda _t, p: got.append(p))
    return got


def test_a_device_of_another_arch_is_refused_at_join_by_a_federation_of_one_model(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker, agg = federation("fedavg")
    down = heard(broker, "odd")
    with caplog.at_level(logging.WARNING, logger="protofl.server"):
        send(broker, "odd", Join(arch="cnn", n_samples=3))
    assert "odd" not in agg.clients
    assert agg.dropped == {"wrong_arch": 1}
    line = next(r.getMessage() for r in caplog.records if "wrong_arch" in r.getMessage())
    assert "odd" in line and "'mlp'" in line and "cnn" in line, line
    # The device is told why, on its own topic: it stops with the federation's architecture in its message.
    (payload,) = down
    why = refusal(payload, FED)
    assert why is not None and "'mlp'" in why and "--arch mlp" in why, why
    # status names the drop's reason and device.
    snap = FederationObserver(agg).snapshot()
    assert snap.last_drops and snap.last_drops[-1].startswith("wrong_arch from odd: "), snap.last_drops
    assert Snapshot.decode(snap.encode()).last_drops == snap.last_drops
    text = "\n".join(header(Reading(snap, "", "test"), 0.0))
    assert "wrong_arch from odd" in text and "'mlp'" in text, text
    # Its own architecture, or none (the federation's), joins.
    send(broker, "a", Join(arch="mlp", n_samples=3))
    send(broker, "b", Join(arch="", n_samples=3))
    assert set(agg.clients) == {"a", "b"} and agg.round == 1 and agg.dropped == {"wrong_arch": 1}


def test_a_federation_of_prototypes_takes_every_architecture() -> None:
    broker, agg = federation("fedproto")
    send(broker, "a", Join(arch="cnn", n_samples=3))
    send(broker, "b", Join(arch="resnet8", n_samples=3))
    assert set(agg.clients) == {"a", "b"} and agg.dropped == {}


def gave_up(broker: InProcessBroker, cid: str, round_: int, phase: str) -> None:
    """What the runner publishes after its last failed try of a round (edge_agent/ops/runner.py)."""
    detail = f"round {round_} {phase} failed (bad vector); giving up"
    send(broker, cid, Status(state="gave_up", detail=detail), round_, phase, topic=topics.presence(FED, cid))


def test_a_device_that_gives_up_leaves_the_round_which_closes_at_quorum() -> None:
    broker, agg = federation("fedproto")
    for c in ("a", "b", "c"):
        send(broker, c, Join(arch="cnn", n_samples=3))
    assert agg.round == 1
    upload(broker, "a", 1)
    upload(broker, "b", 1)
    assert agg.round == 1  # waits for c
    gave_up(broker, "c", 5, "train")  # another round's give-up: nothing
    assert agg.round == 1
    gave_up(broker, "c", 1, "train")
    assert agg.round == 2 and agg.records[0].closed_by == "quorum" and agg.records[0].clients == ["a", "b"]
    # It is still a client: the next round expects it again.
    assert "c" in agg.clients
    phase = agg.machine.phase
    assert phase is not None and "c" in phase.expected


def test_every_drop_names_its_reason_and_device(caplog: pytest.LogCaptureFixture) -> None:
    broker, agg = federation("fedproto")
    for c in ("a", "b"):
        send(broker, c, Join(arch="cnn", n_samples=3))
    with caplog.at_level(logging.INFO, logger="protofl.server"):
        upload(broker, "a", 1)
        upload(broker, "a", 1)  # a duplicate
        send(broker, "b", ProtoUpload(local=None, public=None, n_samples=3), 1, "train")  # nothing in it
    drops = [r for r in caplog.records if r.getMessage().startswith("dropped")]
    assert len(drops) == sum(agg.dropped.values()) >= 2, [r.getMessage() for r in drops]
    assert any("from a (duplicate" in r.getMessage() for r in drops)
    assert any("from b (" in r.getMessage() for r in drops)
    assert len(agg.last_drops) == len(drops)
    assert any(d.startswith("duplicate from a: ") for d in agg.last_drops), agg.last_drops
    assert any(" from b: " in d for d in agg.last_drops), agg.last_drops

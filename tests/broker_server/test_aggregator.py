"""The aggregator's round state machine over the in-process broker, driven by hand-made uploads.

Every drop test snapshots the server model before the bad upload and checks it is unchanged after.
"""

from __future__ import annotations

import numpy as np
import pytest

from broker_server.core import shell
from broker_server.core.shell import Aggregator
from protofl import topics
from protofl.algorithms.fedproto import MeanPrototypes
from protofl.presets import make_config
from protofl.sparse import SparseVector
from protofl.transport import InProcessBroker
from protofl.wire import (
    Envelope,
    Join,
    Message,
    ParamsUpload,
    ProtoSet,
    ProtoUpload,
    RoundStart,
    decode_message,
    encode_message,
    pack_envelope,
)

FED = "t"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def send(
    broker: InProcessBroker,
    topic_client: str,
    msg: Message,
    *,
    sender: str | None = None,
    round_: int = 0,
    phase: str = "",
) -> None:
    payload = encode_message(msg, fed=FED, sender=sender or topic_client, round=round_, phase=phase)
    broker.connect(topic_client).publish(topics.up(FED, topic_client), payload)
    broker.pump()


def protoset(table: dict[int, list[float]], counts: dict[int, int] | None = None) -> ProtoSet:
    classes = sorted(table)
    return ProtoSet(
        classes=np.array(classes),
        values=np.array([table[c] for c in classes], dtype=np.float32),
        counts=None if counts is None else np.array([counts[c] for c in classes]),
    )


def retained_round(broker: InProcessBroker) -> tuple[Envelope, RoundStart]:
    env, msg = decode_message(broker.retained[topics.round_(FED)])
    assert isinstance(msg, RoundStart)
    return env, msg


def snapshot(agg: Aggregator) -> tuple:
    m = agg.model
    values = m.rules.state_values()
    protos, adapter = values.get("prototypes", {}), values.get("adapter")
    return (
        None if adapter is None else adapter.copy(),
        {c: v.copy() for c, v in protos.items()},
        agg.round,
        None if agg.machine.phase is None else agg.machine.phase.phase,
        None if agg.machine.phase is None else {k: set(v) for k, v in agg.machine.phase.received.items()},
    )


def same(a: tuple, b: tuple) -> bool:
    if (a[0] is None) != (b[0] is None) or (a[0] is not None and not np.array_equal(a[0], b[0])):
        return False
    if a[1].keys() != b[1].keys() or any(not np.array_equal(a[1][c], b[1][c]) for c in a[1]):
        return False
    return a[2:] == b[2:]


@pytest.fixture(params=["fast", "reference"])
def fedproto(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> tuple[InProcessBroker, Aggregator, Clock]:
    """Under both upload readers (msgspec's, where installed, and the reference decoder): the same drops, for
    the same reasons, and the same model."""
    if request.param == "reference":
        monkeypatch.setattr(shell.fast_reader, "usable", lambda limits: False)
    elif not shell.fast_reader.available():
        pytest.skip("msgspec (the `fast` extra) is not installed")
    cfg = make_config(
        "fedproto", rounds=2, num_classes=3, proto_dim=2, adapter_rank=1, min_clients=1, round_timeout=30.0
    )
    broker, clock = InProcessBroker(), Clock()
    agg = Aggregator(cfg, FED, broker.connect("server"), clock=clock, expected_clients=["a", "b"])
    assert agg._fast == (request.param == "fast")
    agg.start()
    for c in ("a", "b"):
        send(broker, c, Join(arch="cnn", n_samples=10))
    return broker, agg, clock


def test_fedproto_round_weighted_prototypes_by_hand(fedproto) -> None:
    broker, agg, _ = fedproto
    env, msg = retained_round(broker)
    assert (env.round, env.phase, msg.targets) == (1, "train", None)  # round 1: no global prototypes yet
    # a: class 0 at (1, 0) from 1 sample, class 1 at (0, 2) from 3 samples; b: class 0 at (4, 0) from 3.
    send(
        broker,
        "a",
        ProtoUpload(local=protoset({0: [1, 0], 1: [0, 2]}, {0: 1, 1: 3}), public=None, n_samples=4),
        round_=1,
        phase="train",
    )
    assert agg.round == 1  # b has not reported yet
    send(
        broker, "b", ProtoUpload(local=protoset({0: [4, 0]}, {0: 3}), public=None, n_samples=3), round_=1, phase="train"
    )
    # g_0 = (1*1 + 3*4)/4 = 3.25 ; g_1 = (0, 2) ; class 2 nobody sent -> absent
    assert agg.round == 2
    protos = agg.model.rules.state(MeanPrototypes).prototypes
    np.testing.assert_allclose(protos[0], [3.25, 0])
    np.testing.assert_allclose(protos[1], [0, 2])
    assert 2 not in protos
    env, msg = retained_round(broker)
    assert env.round == 2 and msg.targets is not None and list(msg.targets.classes) == [0, 1]
    assert agg.records[0].clients == ["a", "b"] and agg.records[0].closed_by == "quorum"
    assert agg.records[0].uplink_bytes > 0 and agg.records[0].downlink_bytes > 0


def test_phase_closes_at_deadline_with_the_clients_that_reported(fedproto) -> None:
    broker, agg, clock = fedproto
    send(
        broker, "a", ProtoUpload(local=protoset({0: [1, 0]}, {0: 2}), public=None, n_samples=2), round_=1, phase="train"
    )
    agg.tick()
    assert agg.round == 1  # deadline not reached
    clock.now += 31
    agg.tick()
    assert agg.round == 2 and agg.records[0].closed_by == "deadline" and agg.records[0].clients == ["a"]


def test_deadline_without_min_clients_waits(fedproto) -> None:
    broker, agg, clock = fedproto
    clock.now += 31
    agg.tick()
    assert agg.round == 1 and not agg.records  # nobody reported: keep waiting, do not advance


@pytest.mark.parametrize(
    "case",
    [
        "stale",
        "duplicate",
        "sender_mismatch",
        "unknown_client",
        "malformed",
        "wrong_phase",
        "invalid_class",
        "invalid_width",
        "nan",
        "no_counts",
    ],
)
def test_bad_uploads_are_dropped_counted_and_change_nothing(fedproto, case: str) -> None:
    broker, agg, _ = fedproto
    good = ProtoUpload(local=protoset({0: [1, 0]}, {0: 2}), public=None, n_samples=2)
    if case == "stale":
        # finish round 1, then resend for round 1
        send(broker, "a", good, round_=1, phase="train")
        send(broker, "b", good, round_=1, phase="train")
    before = snapshot(agg)
    if case == "stale":
        send(broker, "a", good, round_=1, phase="train")
    elif case == "duplicate":
        send(broker, "a", good, round_=1, phase="train")
        before = snapshot(agg)
        send(broker, "a", good, round_=1, phase="train")
    elif case == "sender_mismatch":
        send(broker, "a", good, sender="b", round_=1, phase="train")
    elif case == "unknown_client":
        send(broker, "mallory", Join(arch="cnn", n_samples=5))
        send(broker, "mallory", good, round_=1, phase="train")
    elif case == "malformed":
        broker.connect("a").publish(topics.up(FED, "a"), b"\x81\xa1v\x02garbage")
        broker.pump()
    elif case == "wrong_phase":
        send(broker, "a", good, round_=1, phase="proto")
    elif case == "invalid_class":
        send(
            broker,
            "a",
            ProtoUpload(local=protoset({7: [1, 0]}, {7: 2}), public=None, n_samples=2),
            round_=1,
            phase="train",
        )
    elif case == "invalid_width":
        send(
            broker,
            "a",
            ProtoUpload(local=protoset({0: [1, 0, 0]}, {0: 2}), public=None, n_samples=2),
            round_=1,
            phase="train",
        )
    elif case == "nan":
        body = good.to_body()
        body["local"]["v"]["b"] = np.array([[np.nan, 0]], dtype=np.float32).tobytes()
        env = Envelope(v=1, kind="protos", fed=FED, round=1, phase="train", sender="a", msg_id="x", body=body)
        broker.connect("a").publish(topics.up(FED, "a"), pack_envelope(env))
        broker.pump()
    elif case == "no_counts":
        send(broker, "a", ProtoUpload(local=protoset({0: [1, 0]}), public=None, n_samples=2), round_=1, phase="train")
    expected_reason = {
        "invalid_class": "invalid",
        "invalid_width": "invalid",
        "nan": "malformed",
        "no_counts": "invalid",
    }.get(case, case)
    assert agg.dropped.get(expected_reason, 0) >= 1, agg.dropped
    assert same(before, snapshot(agg))


def test_refprotofl_two_phases_and_apud_aggregation_by_hand() -> None:
    cfg = make_config("refprotofl", rounds=1, num_classes=2, proto_dim=4, adapter_rank=1, public_classes=(0,))
    broker = InProcessBroker()
    agg = Aggregator(cfg, FED, broker.connect("server"), expected_clients=["a", "b"])
    agg.start()
    send(broker, "a", Join(arch="cnn", n_samples=10))
    send(broker, "b", Join(arch="cnn", n_samples=30))
    env, msg = retained_round(broker)
    assert (env.round, env.phase) == (1, "proto") and msg.adapter is not None
    theta0 = msg.adapter.copy()
    d = theta0.shape[0]
    # ERPA: class 0 is public -> ext = uniform mean of public protos; class 1 -> n-weighted local protos.
    send(
        broker,
        "a",
        ProtoUpload(public=protoset({0: [2, 0, 0, 0]}), local=protoset({1: [0, 1, 0, 0]}, {1: 1}), n_samples=10),
        round_=1,
        phase="proto",
    )
    send(
        broker,
        "b",
        ProtoUpload(public=protoset({0: [4, 0, 0, 0]}), local=protoset({1: [0, 5, 0, 0]}, {1: 3}), n_samples=30),
        round_=1,
        phase="proto",
    )
    env, msg = retained_round(broker)
    assert (env.round, env.phase) == (1, "train") and msg.targets is not None
    anchors = {int(c): msg.targets.values[i] for i, c in enumerate(msg.targets.classes)}
    np.testing.assert_allclose(anchors[0], [3, 0, 0, 0])  # (2 + 4) / 2, uniform over clients
    np.testing.assert_allclose(anchors[1], [0, 4, 0, 0])  # (1*1 + 3*5) / 4
    # APUD: a sends coordinate 0 = 1.0 (|D_a| = 10), b sends coordinates 0 = 3.0 and 1 = 7.0 (|D_b| = 30).
    send(
        broker,
        "a",
        ParamsUpload(update=SparseVector(d, np.array([0]), np.array([1.0], np.float32)), n_samples=10, base_round=1),
        round_=1,
        phase="train",
    )
    send(
        broker,
        "b",
        ParamsUpload(
            update=SparseVector(d, np.array([0, 1]), np.array([3.0, 7.0], np.float32)), n_samples=30, base_round=1
        ),
        round_=1,
        phase="train",
    )
    new = agg.model.rules.state_values()["adapter"]
    assert new is not None
    assert new[0] == pytest.approx((10 * 1 + 30 * 3) / 40)  # 2.5
    assert new[1] == pytest.approx(7.0)  # only b sent it
    np.testing.assert_array_equal(new[2:], theta0[2:])  # nobody sent these: unchanged
    assert agg.finished
    env, msg = retained_round(broker)
    assert msg.final and env.phase == "done"


def test_adapter_trained_from_an_old_adapter_is_stale() -> None:
    cfg = make_config("refprotofl", rounds=2, num_classes=2, proto_dim=4, adapter_rank=1, public_classes=(0,))
    broker = InProcessBroker()
    agg = Aggregator(cfg, FED, broker.connect("server"), expected_clients=["a"])
    agg.start()
    send(broker, "a", Join(arch="cnn", n_samples=10))
    send(
        broker, "a", ProtoUpload(public=protoset({0: [1, 0, 0, 0]}), local=None, n_samples=10), round_=1, phase="proto"
    )
    d = agg.model.rules.state_values()["adapter"].shape[0]
    before = snapshot(agg)
    send(
        broker,
        "a",
        ParamsUpload(update=SparseVector(d, np.array([0]), np.array([1.0], np.float32)), n_samples=10, base_round=0),
        round_=1,
        phase="train",
    )
    assert agg.dropped == {"stale": 1} and same(before, snapshot(agg))


def test_a_server_without_msgspec_says_its_uploads_take_the_reference_reader(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 60: a server whose venv lacks the `fast` extra spent ~1.8x the CPU per upload without a word."""
    cfg = make_config("tinyproto", rounds=1, num_classes=3, min_clients=1)
    monkeypatch.setattr(shell, "_SAID", [])
    monkeypatch.setattr(shell.fast_reader, "available", lambda: False)
    monkeypatch.setattr(shell.fast_reader, "usable", lambda limits: False)
    with caplog.at_level("WARNING", logger="protofl.server"):
        Aggregator(cfg, FED, InProcessBroker().connect("server"), expected_clients=["a"])
        Aggregator(cfg, FED, InProcessBroker().connect("server"), expected_clients=["a"])
    said = [r.getMessage() for r in caplog.records if "reference reader" in r.getMessage()]
    assert len(said) == 1 and "pip install 'protofl-edge[fast]'" in said[0]  # once a process
    monkeypatch.undo()  # msgspec's reader back: nothing to say
    caplog.clear()
    with caplog.at_level("WARNING", logger="protofl.server"):
        assert Aggregator(cfg, FED, InProcessBroker().connect("server"), expected_clients=["a"])._fast
    assert not [r for r in caplog.records if "reference reader" in r.getMessage()]

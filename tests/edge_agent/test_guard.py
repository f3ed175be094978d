"""A device keeps its working state on a hostile config or round message, and retries a failed round."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from edge_agent.core import agent as agent_module
from edge_agent.core.guard import anchors_problem, config_problem
from edge_agent.ops import runner as runner_module
from protofl import topics
from protofl.config import FederationConfig
from protofl.wire import Config, ProtoSet, RoundStart, encode_message
from tests.conftest import EVENT_WAIT_S
from tests.edge_agent.test_agent import FED, kinds, setup, start_round


def weights(agent) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in agent.model.state_dict().items()}


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def publish_config(broker, server, cfg: FederationConfig) -> None:
    # Built by hand: the hostile values pass FederationConfig's own checks, as in the probe.
    server.publish(
        topics.config(FED),
        encode_message(
            Config(preset=cfg.preset, params=cfg.to_dict(), adapter_layout=[], class_masks=None),
            fed=FED,
            sender="server",
        ),
        retain=True,
    )
    broker.pump()


def test_budget_checks_by_hand() -> None:
    def said(problem: str | None) -> str:
        assert problem is not None, "no problem found"
        return problem

    cfg = FederationConfig(num_classes=65535, proto_dim=65536)  # the 17 GB probe passes the config checks
    assert "65535 * 65536" in said(config_problem(cfg))
    assert "lr 1e+30" in said(config_problem(FederationConfig(lr=1e30)))
    assert "not the shape of this device's data" in said(
        config_problem(FederationConfig(in_shape=(1, 28, 28)), (3, 32, 32))
    )
    assert config_problem(FederationConfig(in_shape=(1, 28, 28)), (1, 28, 28)) is None
    assert "over this device's bound" in said(anchors_problem(np.full((2, 3), 1.5e38, np.float32)))
    assert anchors_problem(np.full((2, 3), 1e6, np.float32)) is None  # TinyProto-sized sums are fine


def test_hostile_config_and_anchors_leave_the_previous_working_state() -> None:
    cfg, broker, server, agent, uploads = setup("fedproto")
    start_round(broker, server, 1, RoundStart(deadline=0.0))
    assert kinds(uploads)[-2:] == ["protos", "metrics"]
    model, before = agent.model, weights(agent)
    for hostile in (
        cfg.replace(num_classes=65535, proto_dim=65536),
        cfg.replace(lr=1e30),
        cfg.replace(in_shape=(3, 32, 32)),
    ):
        publish_config(broker, server, hostile)
        assert agent.cfg == cfg and agent.model is model and same_weights(before, weights(agent))
    assert agent.stats.dropped["bad_config"] == 3
    # Round 2 with finite anchors of 1.5e38 (the probe): refused before training, nothing changes.
    huge = ProtoSet(classes=np.array([0, 1]), values=np.full((2, 16), 1.5e38, np.float32), counts=None)
    start_round(broker, server, 2, RoundStart(deadline=0.0, targets=huge, target_label="mean"))
    assert agent.stats.dropped["bad_round"] == 1 and same_weights(before, weights(agent))
    assert kinds(uploads)[-1] == "metrics"  # nothing uploaded for round 2
    # The device still works: round 3 trains from the state it kept.
    start_round(broker, server, 3, RoundStart(deadline=0.0))
    assert kinds(uploads)[-2:] == ["protos", "metrics"] and agent.stats.rounds_trained == 2


def test_a_round_that_fails_locally_is_rolled_back_reported_and_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, broker, server, agent, uploads = setup("fedproto")
    start_round(broker, server, 1, RoundStart(deadline=0.0))
    before, real = weights(agent), agent_module.trainer.train_local
    calls = {"n": 0}

    def diverges_once(model, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))  # half-way through, as a diverging step leaves it
            raise FloatingPointError("local training diverged (loss inf); lower lr")
        return real(model, *args, **kwargs)

    monkeypatch.setattr(agent_module.trainer, "train_local", diverges_once)
    # The agent as a function of its input: the round message in, the failure out (and nothing to send).
    round2 = encode_message(RoundStart(deadline=0.0), fed=FED, sender="server", round=2, phase="train")
    out = agent.receive(topics.round_(FED), round2)
    assert out.failure is not None and (out.failure.round, out.failure.phase) == (2, "train")
    assert "FloatingPointError: local training diverged" in out.failure.reason and out.sends == ()
    assert not out.changed and not out.trained
    assert agent.stats.failed_rounds == 1 and same_weights(before, weights(agent))  # rolled back, no NaN
    assert (2, "train") not in agent.handled  # so it can be tried again
    out = agent.receive(topics.round_(FED), round2)  # the retry (the runner re-delivers the round message)
    assert out.failure is None and out.kinds() == ["protos", "metrics"] and out.changed and out.trained
    assert agent.stats.rounds_trained == 2


DATA = "synthetic:n=300,n_test=50"


def _served(
    mosquitto: Any,
    fed: str,
    *,
    clients: int,
    rounds: int,
    timeout: float,
    round_timeout: float | None = None,
    expected: list[str] | None = None,
) -> tuple[Any, Any, Any]:
    """A fedproto server (min_clients 1) over `mosquitto`, in a thread: (broker options, service, its thread)."""
    from broker_server.service import AggregatorService, server_transport
    from broker_server.settings import Broker, Federation
    from broker_server.simulation import SimulationSpec, prepare
    from protofl.transport.broker_url import parse_broker_url
    from tests.broker_server.mqtt_helpers import ServiceThread

    opts = parse_broker_url(mosquitto.url)
    cfg = prepare(SimulationSpec(preset="fedproto", dataset=DATA, clients=clients, rounds=rounds, seed=3)).cfg
    cfg = cfg.replace(min_clients=1, **({} if round_timeout is None else {"round_timeout": round_timeout}))
    service = AggregatorService(Federation(cfg, fed, expected_clients=expected), server_transport(Broker(opts), fed))
    return opts, service, ServiceThread(service, timeout=timeout).start()


@pytest.mark.mosquitto
def test_the_device_loop_reports_a_failed_round_and_retries_it(
    mosquitto, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Over a real broker: training diverges once in round 1; the device says so on its presence topic
    # (the server logs it), tries again after RETRY_S and the federation finishes with it.
    import logging

    from edge_agent.ops.local_data import DataSpec
    from edge_agent.ops.runner import DeviceRunner, RunnerOptions

    monkeypatch.setattr(runner_module, "RETRY_S", 0.5)
    real, calls = agent_module.trainer.train_local, {"n": 0}

    def diverges_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise FloatingPointError("local training diverged (loss inf); lower lr")
        return real(*args, **kwargs)

    monkeypatch.setattr(agent_module.trainer, "train_local", diverges_once)
    opts, service, server = _served(mosquitto, "retry", clients=1, rounds=2, timeout=60)
    device = DeviceRunner(opts, "retry", "client-000", DataSpec(DATA, partition=(0, 1), seed=3), RunnerOptions())
    with caplog.at_level(logging.WARNING, logger="protofl.server"):
        agent = device.run(timeout=60)
        server.join(EVENT_WAIT_S)
    service.close()
    assert agent is not None and agent.finished and agent.stats.failed_rounds == 1
    assert agent.stats.rounds_trained == 2 and calls["n"] == 3
    assert [r.clients for r in service.aggregator.records] == [["client-000"], ["client-000"]]
    assert any("device client-000: round 1 train failed (FloatingPointError" in r.getMessage() for r in caplog.records)


@pytest.mark.mosquitto
def test_a_device_that_gives_up_on_a_round_leaves_it_and_the_round_closes_at_quorum(
    mosquitto, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Issue 42: one of two devices fails round 1 every time it tries. After its last try it leaves the round (its
    # presence says it gave up on round 1 train), so the round closes at quorum, not at the 120 s deadline.
    import logging
    import threading

    from edge_agent.ops.local_data import DataSpec
    from edge_agent.ops.runner import DeviceRunner, RunnerOptions

    monkeypatch.setattr(runner_module, "RETRY_S", 0.2)
    real = agent_module.trainer.train_local

    def bad_fails(*args, **kwargs):
        if threading.current_thread().name == "bad":
            raise FloatingPointError("local training diverged (loss inf); lower lr")
        return real(*args, **kwargs)

    monkeypatch.setattr(agent_module.trainer, "train_local", bad_fails)
    opts, service, server = _served(
        mosquitto, "giveup", clients=2, rounds=1, timeout=90, round_timeout=120.0, expected=["good", "bad"]
    )
    runners = {
        name: DeviceRunner(opts, "giveup", name, DataSpec(DATA, partition=(i, 2), seed=3), RunnerOptions())
        for i, name in enumerate(("good", "bad"))
    }
    results: dict[str, object] = {}

    def run(name: str) -> None:
        try:
            results[name] = runners[name].run(timeout=60)
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[name] = exc

    threads = [threading.Thread(target=run, args=(n,), name=n) for n in runners]
    with caplog.at_level(logging.WARNING, logger="protofl.server"):
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        server.join(EVENT_WAIT_S)
    service.close()
    records = service.aggregator.records
    assert [(r.clients, r.closed_by) for r in records] == [(["good"], "quorum")], results
    assert records[0].ended - records[0].started < 60, "the round waited for its deadline"
    assert any("client bad gave up on round 1 train" in r.getMessage() for r in caplog.records)

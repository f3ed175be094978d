"""The edge agent over the in-process broker (carried by the simulator's `LocalDevice`): what it uploads for each
preset, and what it ignores. tests/edge_agent/test_agent_outcomes.py drives the agent as a function."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_agent.core.agent import ClientData, EdgeAgent
from edge_agent.ops.local import LocalDevice
from edge_agent.techniques import AlignmentTerm
from protofl import topics
from protofl.algorithms import cps
from protofl.presets import make_config
from protofl.sparse import SparseVector
from protofl.transport import InProcessBroker
from protofl.wire import (
    Config,
    Metrics,
    ParamsUpload,
    ProtoSet,
    ProtoUpload,
    RoundStart,
    decode_message,
    encode_message,
)

FED = "ag"


def tiny_data(seed: int = 0, n: int = 40) -> ClientData:
    rng = np.random.default_rng(seed)
    y = np.repeat([0, 1], n // 2)
    x = rng.standard_normal((n, 1, 6, 6)).astype(np.float32) + y[:, None, None, None] * 2.0
    return ClientData(x_train=x, y_train=y, x_test=x[:10], y_test=y[:10])


def setup(preset: str, on_artifacts=None, **overrides):
    cfg = make_config(
        preset,
        num_classes=3,
        proto_dim=16,
        adapter_rank=2,
        in_shape=(1, 6, 6),
        archs=("mlp",),
        batch_size=8,
        cps_s=4,
        **overrides,
    )
    broker = InProcessBroker()
    uploads: list = []
    broker.connect("spy").subscribe(topics.up(FED, "+"), lambda t, p: uploads.append(decode_message(p)))
    agent = EdgeAgent(
        "dev1", FED, tiny_data(), artifacts_at=("first_training", "final") if on_artifacts is not None else ()
    )
    LocalDevice(agent, broker.connect("dev1"), on_artifacts).start()
    masks = cps.make_masks(3, 16, 4, seed=0) if cfg.cps else None
    server = broker.connect("server")
    server.publish(
        topics.config(FED),
        encode_message(
            Config(preset=preset, params=cfg.to_dict(), adapter_layout=[], class_masks=masks), fed=FED, sender="server"
        ),
        retain=True,
    )
    broker.pump()
    return cfg, broker, server, agent, uploads


def start_round(broker, server, r: int, msg: RoundStart, phase: str = "train") -> None:
    server.publish(topics.round_(FED), encode_message(msg, fed=FED, sender="server", round=r, phase=phase), retain=True)
    broker.pump()


def kinds(uploads) -> list[str]:
    return [env.kind for env, _ in uploads]


def test_fedproto_agent_uploads_prototypes_with_counts_once_per_round() -> None:
    cfg, broker, server, agent, uploads = setup("fedproto")
    assert kinds(uploads) == ["join"]
    start_round(broker, server, 1, RoundStart(deadline=0.0))
    assert kinds(uploads) == ["join", "protos", "metrics"]
    env, up = uploads[1]
    assert isinstance(up, ProtoUpload) and env.round == 1 and env.sender == "dev1"
    assert up.local is not None and up.local.counts is not None
    assert up.local.classes.tolist() == [0, 1] and up.local.counts.tolist() == [20, 20]
    assert up.local.values.shape == (2, 16)
    metrics = uploads[2][1]
    assert isinstance(metrics, Metrics) and metrics.n_local == 10
    # The retained round message delivered again (a reconnect) must not train or upload twice.
    start_round(broker, server, 1, RoundStart(deadline=0.0))
    assert kinds(uploads) == ["join", "protos", "metrics"]


def _rule(agent, name: str):
    """The agent's device rule of technique `name`."""
    return next(rule for rule in agent.rules if rule.name == name)


def test_tinyproto_agent_sends_scaled_compressed_prototypes_without_counts() -> None:
    cfg, broker, server, agent, uploads = setup("tinyproto")
    start_round(broker, server, 1, RoundStart(deadline=0.0))
    up = uploads[1][1]
    assert up.local.counts is None  # prototype scaling hides n_kc
    assert up.local.values.shape == (2, 4)  # s = 4 values per class, no indices
    # the values are n_kc * p_kc on the class mask: compare with the agent's own prototype norms
    norms = np.linalg.norm(up.local.values, axis=1) / 20
    assert np.allclose(norms, [_rule(agent, "cps").local_norms[0], _rule(agent, "cps").local_norms[1]], rtol=1e-5)


@pytest.mark.parametrize("mu", [1e-2, "auto"])
def test_scaled_anchor_targets_fixed_mu_and_auto(mu) -> None:
    cfg, broker, server, agent, uploads = setup("tinyproto", mu=mu)
    start_round(broker, server, 1, RoundStart(deadline=0.0))
    G = np.array([[3.0, 4.0, 0.0, 0.0]], dtype=np.float32)  # ||G|| = 5
    t = agent.make_objective(
        agent._targets(
            RoundStart(deadline=0.0, targets=ProtoSet(classes=np.array([0]), values=G), target_label="cps+scaled")
        )
    )
    (term,) = [term for term in t.terms if isinstance(term, AlignmentTerm)]
    target = term.values[0].numpy()
    assert np.count_nonzero(target) <= 4 and term.present.tolist() == [True, False, False]
    if mu == "auto":
        assert np.linalg.norm(target) == pytest.approx(_rule(agent, "cps").local_norms[0], rel=1e-5)
    else:
        assert np.linalg.norm(target) == pytest.approx(5 * 1e-2, rel=1e-5)


def test_fedpagr_anchoring_sets_head_rows_to_prototypes() -> None:
    cfg, broker, server, agent, uploads = setup("fedpagr")
    P = np.eye(3, 16, dtype=np.float32)
    agent.make_objective(
        agent._targets(RoundStart(deadline=0.0, targets=ProtoSet(classes=np.arange(3), values=P), target_label="unit"))
    )
    assert torch.equal(agent.model.head.weight.detach(), torch.from_numpy(P))
    assert not agent.model.head.bias.detach().any()
    start_round(
        broker,
        server,
        1,
        RoundStart(deadline=0.0, targets=ProtoSet(classes=np.arange(3), values=P), target_label="unit"),
    )
    up = uploads[1][1]
    assert np.allclose(np.linalg.norm(up.local.values, axis=1), 1.0, atol=1e-5)  # unit prototypes


def test_agent_drops_malformed_and_foreign_messages() -> None:
    cfg, broker, server, agent, uploads = setup("fedproto")
    server.publish(topics.round_(FED), b"\x00not msgpack at all")
    server.publish(
        topics.round_(FED),
        encode_message(RoundStart(deadline=0.0), fed="other", sender="server", round=1, phase="train"),
    )
    broker.pump()
    assert agent.stats.dropped == {"malformed": 1, "wrong_fed": 1}
    assert kinds(uploads) == ["join"]


def test_refprotofl_agent_sends_topk_adapter_values() -> None:
    from protofl.adapter import adapter_layout, initial_adapter

    cfg = make_config(
        "refprotofl",
        num_classes=3,
        proto_dim=16,
        adapter_rank=2,
        in_shape=(1, 6, 6),
        archs=("mlp",),
        batch_size=8,
        public_classes=(0,),
    )
    broker = InProcessBroker()
    uploads: list = []
    broker.connect("spy").subscribe(topics.up(FED, "+"), lambda t, p: uploads.append(decode_message(p)))
    agent = EdgeAgent("dev1", FED, tiny_data())
    LocalDevice(agent, broker.connect("dev1")).start()
    layout = adapter_layout(16, 2, 3)
    server = broker.connect("server")
    server.publish(
        topics.config(FED),
        encode_message(
            Config(preset="refprotofl", params=cfg.to_dict(), adapter_layout=layout), fed=FED, sender="server"
        ),
    )
    theta = initial_adapter(layout, seed=0)
    start_round(broker, server, 1, RoundStart(deadline=0.0, adapter=theta), phase="proto")
    env, up = uploads[1]
    assert env.phase == "proto" and up.local.classes.tolist() == [1]  # class 0 is public-covered
    assert up.public is None  # no public set was shipped to this device
    start_round(broker, server, 1, RoundStart(deadline=0.0), phase="train")
    env, up = uploads[2]
    assert isinstance(up, ParamsUpload) and up.base_round == 1
    assert isinstance(up.update, SparseVector) and agent.model is not None
    d = theta.shape[0]
    assert up.update.nnz == int(np.ceil(0.1 * d))
    from edge_agent.training.params import adapter_vector

    assert np.array_equal(up.update.values, adapter_vector(agent.model)[up.update.indices])


def test_a_device_without_a_technique_of_the_federation_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The server runs a technique this device has no rule for (a package installed there, not here): the
    # device keeps no half-built state and says what is missing.
    from edge_agent import techniques

    known = dict(techniques.device_rules())
    monkeypatch.setattr(techniques, "device_rules", lambda: {k: v for k, v in known.items() if k != "cps"})
    cfg, broker, server, agent, uploads = setup("tinyproto")
    assert agent.cfg is None and agent.model is None and agent.stats.dropped == {"bad_config": 1}
    assert "technique(s) ['cps'] that this device has no rule for: install the package" in caplog.text
    monkeypatch.setattr(techniques, "device_rules", lambda: known)
    server.publish(
        topics.config(FED),
        encode_message(
            Config(preset="tinyproto", params=cfg.to_dict(), adapter_layout=[], class_masks=cps.make_masks(3, 16, 4)),
            fed=FED,
            sender="server",
        ),
        retain=True,
    )
    broker.pump()
    assert agent.cfg == cfg and [r.name for r in agent.rules] == ["fedproto", "cps"]

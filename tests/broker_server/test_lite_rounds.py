"""Mixed fleets in the round machine (issue 57): a lite device (no torch: `Join.trains` false) is planned for what it
can send, and refused where the federation needs training from it (protofl/lite.py).

The federation: 3 classes, m = 4, two members. With the ridge predictor (the protofl preset), the training phase
waits for prototypes and the statistics vector from a torch device, and for the statistics alone from a lite one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from broker_server.core.shell import Aggregator
from protofl.algorithms.ridge import ridge_length, ridge_statistics
from protofl.lite import lite_needs, lite_refusal
from protofl.plan import Phase, RoundPlan, Upload
from protofl.presets import make_config
from protofl.transport import InProcessBroker
from protofl.wire import Join, ParamsUpload, ProtoUpload, PublicSet
from tests.broker_server.test_rounds import FED, protoset, send

LAYOUT = [("w", (2, 3)), ("b", (2,))]  # the backbone vector's tensors: 8 values


def public(graph: bool) -> PublicSet:
    return PublicSet(
        x=np.zeros((0, 1, 2, 2), np.uint8),
        y=np.zeros(0, np.int64),
        classes=[],
        backbone=np.arange(8, dtype=np.float32),
        norm=([0.5], [0.25]),
        graph=b"an ONNX graph" if graph else None,
        layout=LAYOUT if graph else None,
    )


def federation(preset: str, graph: bool = True, **overrides: Any) -> tuple[InProcessBroker, Aggregator]:
    cfg = make_config(
        preset, num_classes=3, proto_dim=4, adapter_rank=2, min_clients=2, rounds=2, public_per_class=1, **overrides
    )
    broker = InProcessBroker()
    agg = Aggregator(cfg, FED, broker.connect("server"), expected_clients=["pi", "jetson"], public=public(graph))
    agg.start()
    return broker, agg


def test_the_rule() -> None:
    ridge = make_config("protofl")
    assert lite_refusal(ridge, has_graph=True) is None
    plan = RoundPlan.from_config(ridge)
    assert lite_needs(plan, Phase.TRAIN) == (Upload.ADAPTER,) and plan.sends(Phase.TRAIN) == (
        Upload.PROTOS,
        Upload.ADAPTER,
    )
    assert "ships no ONNX graph" in (lite_refusal(ridge, has_graph=False) or "")
    for preset in ("fedavg", "fedproto", "tinyproto", "fedpagr", "refprotofl"):
        why = lite_refusal(make_config(preset), has_graph=True)
        assert why is not None and f"preset '{preset}' trains the model on every device" in why


def test_a_lite_device_is_expected_for_its_statistics_alone() -> None:
    broker, agg = federation("protofl", cps=False)  # (full-width unit prototypes: the test's tables stay readable)
    send(broker, "pi", Join(arch="", n_samples=5, trains=False))
    send(broker, "jetson", Join(arch="", n_samples=6))
    assert agg.round == 1 and not agg.dropped
    n = ridge_length(4, 3)
    rng = np.random.default_rng(0)
    stats = {
        c: ridge_statistics(rng.standard_normal((k, 4)), np.arange(k) % 3, 3) for c, k in (("pi", 5), ("jetson", 6))
    }
    # prototypes are no part of a lite device's phase: dropped, said so
    send(broker, "pi", ProtoUpload(local=protoset({0: [1.0, 0, 0, 0]}), public=None, n_samples=5), 1, "train")
    assert agg.dropped == {"wrong_phase": 1}
    send(broker, "pi", ParamsUpload(update=stats["pi"], n_samples=5, base_round=1), 1, "train")
    assert agg.round == 1  # the torch device has sent nothing yet
    send(broker, "jetson", ParamsUpload(update=stats["jetson"], n_samples=6, base_round=1), 1, "train")
    assert agg.round == 1  # ... and its prototypes are still owed
    unit = {0: [1.0, 0, 0, 0], 1: [0, 1.0, 0, 0], 2: [0, 0, 1.0, 0]}
    send(broker, "jetson", ProtoUpload(local=protoset(unit), public=None, n_samples=6), 1, "train")
    assert agg.round == 2, "the phase closes once each device sent what it can"
    ridge_state = agg.machine.model.rules.named()
    got = {name: rule.state for name, rule in ridge_state}["ridge"]
    assert got.contributors == ["jetson", "pi"] and got.stats.shape == (n,)
    np.testing.assert_allclose(got.stats, stats["pi"].astype(np.float64) + stats["jetson"], rtol=1e-6)


def test_a_preset_that_trains_everywhere_refuses_a_lite_device_at_its_join() -> None:
    broker, agg = federation("fedproto")
    send(broker, "pi", Join(arch="", n_samples=5, trains=False))
    assert agg.dropped == {"cannot_train": 1} and "pi" not in agg.machine.state.clients
    assert "preset 'fedproto' trains the model on every device" in agg.refusals["pi"][1]
    send(broker, "jetson", Join(arch="", n_samples=6))
    assert agg.round == 0  # one member of two: no round


def test_a_server_without_the_graph_refuses_a_lite_device() -> None:
    broker, agg = federation("protofl", graph=False)
    send(broker, "pi", Join(arch="", n_samples=5, trains=False))
    assert agg.dropped == {"cannot_train": 1} and "ships no ONNX graph" in agg.refusals["pi"][1]

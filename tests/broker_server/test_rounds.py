"""The error boundary: every malformed-but-decodable upload the round machine can meet is a counted
drop with its reason, and nothing in the machine changes (model, open phase, accumulators' sums)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from broker_server.core.shell import Aggregator
from protofl import topics
from protofl.presets import make_config
from protofl.sparse import SparseVector
from protofl.transport import InProcessBroker
from protofl.wire import Join, Message, ParamsUpload, ProtoSet, ProtoUpload, encode_message
from tests.pipelines import ADAPTER_PIPELINE

FED = "r"


def protoset(table: dict[int, list[float]], counts: dict[int, int] | None = None) -> ProtoSet:
    classes = sorted(table)
    return ProtoSet(
        classes=np.array(classes),
        values=np.array([table[c] for c in classes], dtype=np.float32),
        counts=None if counts is None else np.array([counts[c] for c in classes]),
    )


def state(obj: Any, depth: int = 0) -> Any:
    """Everything the machine holds, as comparable plain values (arrays copied), callbacks left out."""
    if isinstance(obj, np.ndarray):
        return ("array", obj.dtype.str, obj.shape, obj.tobytes())
    if isinstance(obj, dict):
        return {k: state(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
        return type(obj).__name__, [state(v, depth + 1) for v in items]
    if type(obj).__module__.startswith(("broker_server", "protofl")) and hasattr(obj, "__dict__") and depth < 8:
        return type(obj).__name__, {
            k: state(v, depth + 1)
            for k, v in vars(obj).items()
            if not callable(v) and k not in ("cfg", "plan", "model")
        } | ({"model": state(vars(obj)["model"], depth + 1)} if "model" in vars(obj) and depth == 0 else {})
    return obj if obj is None or isinstance(obj, (int, float, str, bool)) else repr(type(obj))


def federation(preset: str, **overrides: Any) -> tuple[InProcessBroker, Aggregator]:
    cfg = make_config(
        preset, num_classes=3, proto_dim=4, adapter_rank=2, min_clients=2, rounds=3, public_per_class=1, **overrides
    )
    broker = InProcessBroker()
    agg = Aggregator(cfg, FED, broker.connect("server"), expected_clients=["a", "b"])
    agg.start()
    for c in ("a", "b"):
        send(broker, c, Join(arch="cnn", n_samples=4))
    assert agg.round == 1
    return broker, agg


def send(broker: InProcessBroker, client: str, msg: Message, round_: int = 0, phase: str = "") -> None:
    payload = encode_message(msg, fed=FED, sender=client, round=round_, phase=phase)
    broker.connect(client).publish(topics.up(FED, client), payload)
    broker.pump()


UNIT_OK = {0: [1.0, 0, 0, 0], 1: [0, 1.0, 0, 0]}
ERPA_SCALED = dict(ADAPTER_PIPELINE, erpa=True, public_classes=(0,), cps_s=1)  # ERPA with CPS scaling
# name -> (preset, config overrides, phase, the upload, the drop reason it must be counted under)
CASES: dict[str, tuple[str, dict[str, Any], str, Message, str]] = {
    # FedPAGR: a zero prototype has no direction (it used to escape the boundary as a ValueError)
    "fedpagr/zero_vector": (
        "fedpagr",
        {},
        "train",
        ProtoUpload(local=protoset({**UNIT_OK, 2: [0, 0, 0, 0]}), public=None, n_samples=4),
        "invalid",
    ),
    "fedpagr/wrong_width": (
        "fedpagr",
        {},
        "train",
        ProtoUpload(local=protoset({0: [1.0, 0, 0]}), public=None, n_samples=4),
        "invalid",
    ),
    "fedpagr/class_out_of_range": (
        "fedpagr",
        {},
        "train",
        ProtoUpload(local=protoset({5: [1.0, 0, 0, 0]}), public=None, n_samples=4),
        "invalid",
    ),
    "fedpagr/wrong_phase": (
        "fedpagr",
        {},
        "proto",
        ProtoUpload(local=protoset(UNIT_OK), public=None, n_samples=4),
        "wrong_phase",
    ),
    "fedproto/no_counts": (
        "fedproto",
        {},
        "train",
        ProtoUpload(local=protoset({0: [1.0, 2, 3, 4]}), public=None, n_samples=4),
        "invalid",
    ),
    # ERPA phase 1: a local prototype for a public-covered class, a public one of the wrong width
    "refprotofl/local_for_public_class": (
        "refprotofl",
        dict(public_classes=(0,)),
        "proto",
        ProtoUpload(local=protoset({0: [1.0, 2, 3, 4]}, {0: 2}), public=None, n_samples=4),
        "invalid",
    ),
    "refprotofl/public_wrong_width": (
        "refprotofl",
        {},
        "proto",
        ProtoUpload(local=None, public=protoset({0: [1.0, 2]}), n_samples=4),
        "invalid",
    ),
    "refprotofl/adapter_in_proto_phase": (
        "refprotofl",
        {},
        "proto",
        ParamsUpload(
            update=SparseVector(n=10, indices=np.array([1]), values=np.array([1.0], np.float32)),
            n_samples=4,
            base_round=1,
        ),
        "wrong_phase",
    ),
    "refprotofl/sparse_adapter_wrong_length": (
        "refprotofl",
        {},
        "train",
        ParamsUpload(
            update=SparseVector(n=10, indices=np.array([1]), values=np.array([1.0], np.float32)),
            n_samples=4,
            base_round=1,
        ),
        "invalid",
    ),
    # ERPA + scaling: the public table is fine, the scaled local table is not; neither may be folded
    "protofl-erpa/scaled_class_out_of_range": (
        "protofl",
        ERPA_SCALED,
        "proto",
        ProtoUpload(local=protoset({1: [1.0], 7: [2.0]}), public=protoset({0: [2.0]}), n_samples=4),
        "invalid",
    ),
    "protofl-erpa/scaled_wrong_width": (
        "protofl",
        ERPA_SCALED,
        "proto",
        ProtoUpload(local=protoset({1: [1.0, 2.0]}), public=protoset({0: [2.0]}), n_samples=4),
        "invalid",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_upload_is_a_counted_drop_and_changes_nothing(case: str) -> None:
    preset, overrides, phase, msg, reason = CASES[case]
    broker, agg = federation(preset, **overrides)
    if phase == "train" and agg.machine.plan.two_phase:
        # close ERPA's prototype phase with two good uploads first
        for c in ("a", "b"):
            send(
                broker,
                c,
                ProtoUpload(
                    local=None,
                    public=protoset({k: [1.0] * agg.machine.plan.proto_width for k in agg.machine.plan.public_classes}),
                    n_samples=4,
                ),
                1,
                "proto",
            )
        assert agg.machine.phase is not None and agg.machine.phase.phase.value == "train"
    before = state(agg.machine)
    dropped = dict(agg.dropped)
    send(broker, "a", msg, 1, phase)
    assert agg.dropped.get(reason, 0) == dropped.get(reason, 0) + 1, agg.dropped
    assert state(agg.machine) == before


def test_a_good_upload_does_change_the_state() -> None:
    # the check above can fail: the snapshot sees a fold
    broker, agg = federation("fedpagr")
    before = state(agg.machine)
    send(broker, "a", ProtoUpload(local=protoset(UNIT_OK), public=None, n_samples=4), 1, "train")
    assert not agg.dropped and state(agg.machine) != before

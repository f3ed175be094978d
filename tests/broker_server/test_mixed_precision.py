"""Adaptive uploads mean mixed precisions in one round: the server folds f4 and q8 uploads alike."""

from __future__ import annotations

import numpy as np

from protofl.sparse import SparseVector
from protofl.wire import ParamsUpload, ProtoSet, ProtoUpload
from tests.broker_server.test_rounds import federation, send


def test_one_round_takes_f4_and_q8_prototypes_and_adapters() -> None:
    # fedproto: global prototype = sample-weighted mean; a: class 0 = [1, 2, 3, 4] (n=1) in f4,
    # b: class 0 = [3, 2, 1, 0] (n=3) in q8 -> (1*[1,2,3,4] + 3*[3,2,1,0]) / 4 = [2.5, 2, 1.5, 1]
    broker, agg = federation("fedproto")
    a = ProtoSet(classes=np.array([0]), values=np.array([[1, 2, 3, 4]], np.float32), counts=np.array([1]))
    b = ProtoSet(classes=np.array([0]), values=np.array([[3, 2, 1, 0]], np.float32), counts=np.array([3]), dt="q8")
    send(broker, "a", ProtoUpload(local=a, public=None, n_samples=1), 1, "train")
    send(broker, "b", ProtoUpload(local=b, public=None, n_samples=3), 1, "train")
    assert agg.dropped == {} and agg.records[0].clients == ["a", "b"] and agg.round == 2
    # q8 steps are (3 - 0) / 255: b's values come back within 0.006 of themselves
    np.testing.assert_allclose(agg.model.rules.state_values()["prototypes"][0], [2.5, 2.0, 1.5, 1.0], atol=0.01)


def test_apud_adapters_in_f4_and_q8() -> None:
    broker, agg = federation("refprotofl", erpa=False, prototypes="none")
    d = agg.model.rules.state_values()["adapter"].shape[0]
    idx = np.array([0, 1])
    for client, dt, vals in (("a", "f4", [1.0, 2.0]), ("b", "q8", [3.0, 4.0])):
        up = ParamsUpload(update=SparseVector(d, idx, np.array(vals, np.float32)), n_samples=2, base_round=1, dt=dt)
        send(broker, client, up, 1, "train")
    assert agg.dropped == {} and agg.records[0].clients == ["a", "b"]
    # APUD eq. 6, equal weights: [(1 + 3) / 2, (2 + 4) / 2] on the two coordinates both sent
    np.testing.assert_allclose(agg.model.rules.state_values()["adapter"][:2], [2.0, 3.0], atol=0.01)

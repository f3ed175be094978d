"""Server rules composed into phases, on hand-computed numbers: ERPA anchors (with and without scaling), FedProto's
weighted prototypes, APUD and FedAvg folds, and what the next round's targets are."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from broker_server.core.stages import PhaseRun, ServerModel, build_model
from protofl.algorithms.erpa import Anchors
from protofl.algorithms.fedavg import FederatedVector
from protofl.algorithms.fedpagr import UnitState
from protofl.algorithms.fedproto import MeanPrototypes
from protofl.errors import WireError
from protofl.plan import Phase, RoundPlan, Upload
from protofl.presets import make_config
from protofl.sparse import SparseVector
from protofl.wire import ParamsUpload, ProtoSet, ProtoUpload


def model_for(preset: str, **overrides: Any) -> ServerModel:
    cfg = make_config(preset, num_classes=3, proto_dim=2, adapter_rank=1, **overrides)
    return build_model(cfg, RoundPlan.from_config(cfg))


def ps(table: dict[int, list[float]], counts: dict[int, int] | None = None) -> ProtoSet:
    classes = sorted(table)
    return ProtoSet(
        classes=np.array(classes),
        values=np.array([table[c] for c in classes], np.float32),
        counts=None if counts is None else np.array([counts[c] for c in classes]),
    )


def test_erpa_anchors_ext_mean_for_public_weighted_mean_for_the_rest() -> None:
    m = model_for("refprotofl", public_classes=(0,))
    phase = PhaseRun(m, Phase.PROTO)
    phase.add(Upload.PROTOS, ProtoUpload(public=ps({0: [1, 0]}), local=ps({1: [2, 2]}, {1: 1}), n_samples=1))
    phase.add(
        Upload.PROTOS, ProtoUpload(public=ps({0: [3, 0]}), local=ps({1: [5, 5], 2: [1, 1]}, {1: 2, 2: 4}), n_samples=6)
    )
    phase.finish()
    targets = m.rules.state(Anchors).targets
    assert targets is not None
    a, _ = targets.table()
    # a_0 = (1 + 3) / 2 = 2 (uniform); a_1 = (1*2 + 2*5) / 3 = 4 (n-weighted); a_2 = 1 (one sender)
    assert {c: v.tolist() for c, v in a.items()} == {0: [2.0, 0.0], 1: [4.0, 4.0], 2: [1.0, 1.0]}


def test_erpa_with_scaling_averages_the_scaled_vectors_over_senders() -> None:
    m = model_for("refprotofl", public_classes=(0,), scaling=True)
    phase = PhaseRun(m, Phase.PROTO)
    phase.add(Upload.PROTOS, ProtoUpload(public=ps({0: [1, 1]}), local=ps({1: [2, 0]}), n_samples=1))  # n*p, no counts
    phase.add(Upload.PROTOS, ProtoUpload(public=None, local=ps({1: [4, 2]}), n_samples=1))
    # G_1 = (2 + 4) / 2, (0 + 2) / 2 = (3, 1) (TinyProto eq. 10: 1/|N_c|); a_0 = the one ext prototype
    phase.finish()
    targets = m.rules.state(Anchors).targets
    assert targets is not None
    assert {c: v.tolist() for c, v in targets.table()[0].items()} == {0: [1.0, 1.0], 1: [3.0, 1.0]}


def test_fedproto_round_keeps_unsent_classes_and_becomes_next_targets() -> None:
    m = model_for("fedproto")
    m.rules.state(MeanPrototypes).prototypes = {2: np.array([9, 9], np.float32)}
    phase = PhaseRun(m, Phase.TRAIN)
    phase.add(Upload.PROTOS, ProtoUpload(local=ps({0: [1, 0]}, {0: 1}), public=None, n_samples=1))
    phase.add(Upload.PROTOS, ProtoUpload(local=ps({0: [4, 3]}, {0: 2}), public=None, n_samples=2))
    phase.finish()
    # g_0 = (1*(1,0) + 2*(4,3)) / 3 = (3, 2); class 2 nobody sent keeps (9, 9)
    protos = m.rules.state(MeanPrototypes).prototypes
    assert {c: v.tolist() for c, v in protos.items()} == {0: [3.0, 2.0], 2: [9.0, 9.0]}
    targets = PhaseRun(m, Phase.TRAIN).round_fields().targets
    assert targets is not None and targets.classes.tolist() == [0, 2]


def test_apud_fold_keeps_coordinates_nobody_sent() -> None:
    m = model_for("refprotofl")
    vec = m.rules.state(FederatedVector)
    vec.adapter = np.zeros(8, np.float32)  # any length: the phase follows the server's adapter
    phase = PhaseRun(m, Phase.TRAIN)
    n = vec.adapter.shape[0]
    phase.add(
        Upload.ADAPTER,
        ParamsUpload(
            update=SparseVector(n, np.array([0, 2]), np.array([2.0, 4.0], np.float32)), n_samples=1, base_round=1
        ),
    )
    phase.add(
        Upload.ADAPTER,
        ParamsUpload(update=SparseVector(n, np.array([0]), np.array([5.0], np.float32)), n_samples=3, base_round=1),
    )
    phase.finish()
    # theta_0 = (1*2 + 3*5) / 4 = 4.25; theta_2 = 4 (one sender); the rest keep 0
    assert vec.adapter[0] == pytest.approx(4.25) and vec.adapter[2] == 4.0 and not vec.adapter[[1, 3]].any()


def test_fedavg_without_a_known_model_takes_the_first_length_and_holds_the_rest_to_it() -> None:
    m = model_for("fedavg")
    vec = m.rules.state(FederatedVector)
    before: np.ndarray | None = vec.params  # (not vec.params itself: the type checker would hold it None below)
    assert before is None  # a server without torch does not know the model's size
    phase = PhaseRun(m, Phase.TRAIN)
    phase.add(Upload.ADAPTER, ParamsUpload(update=np.array([1.0, 2.0, 3.0], np.float32), n_samples=1, base_round=1))
    with pytest.raises(WireError, match="length 2, expected 3"):
        phase.add(Upload.ADAPTER, ParamsUpload(update=np.array([1.0, 2.0], np.float32), n_samples=1, base_round=1))
    phase.add(Upload.ADAPTER, ParamsUpload(update=np.array([3.0, 2.0, 1.0], np.float32), n_samples=1, base_round=1))
    phase.finish()
    after = vec.params
    assert after is not None and after.tolist() == [2.0, 2.0, 2.0]


def _spherical_erpa(public_classes: tuple[int, ...] = (0,)) -> ServerModel:
    """Candidate (d) without CPS masks (proto_dim 2 is too small for them): unit prototypes, consensus,
    ERPA anchors for the public classes."""
    m = model_for("fedpagr", refine=False, erpa=True, public_classes=public_classes)
    m.rules.state(UnitState).unit = np.array([[1, 0], [0, 1], [0.6, 0.8]], np.float32)
    return m


def test_erpa_on_unit_prototypes_anchors_public_classes_on_the_public_set() -> None:
    m = _spherical_erpa()
    phase = PhaseRun(m, Phase.TRAIN)
    phase.add(Upload.PROTOS, ProtoUpload(public=ps({0: [0, 1]}), local=ps({1: [1, 0]}), n_samples=4))
    phase.add(Upload.PROTOS, ProtoUpload(public=ps({0: [1, 0]}), local=ps({1: [0, 2]}), n_samples=8))
    phase.finish()
    r = 1 / np.sqrt(2)
    # class 0: normalised uniform mean of the public prototypes (0,1), (1,0); class 1: FedPAGR's consensus
    # of the local unit prototypes (1,0), (0,1) (the (0,2) upload is normalised first); class 2 nobody
    # sent keeps its row
    unit = m.rules.state(UnitState).unit
    assert unit is not None
    np.testing.assert_allclose(unit, [[r, r], [r, r], [0.6, 0.8]], rtol=1e-6)
    assert unit.dtype == np.float32


@pytest.mark.parametrize(
    "up, match",
    [
        (ProtoUpload(public=ps({1: [1, 0]}), local=ps({2: [1, 0]}), n_samples=1), "with no public data"),
        (ProtoUpload(public=ps({0: [1, 0]}), local=ps({0: [1, 0]}), n_samples=1), "public-covered"),
        (ProtoUpload(public=ps({0: [1, 0]}), local=ps({1: [0, 0]}), n_samples=1), "zero vector"),
    ],
)
def test_erpa_on_unit_prototypes_rejects_a_bad_upload_whole(up: ProtoUpload, match: str) -> None:
    m = _spherical_erpa()
    phase = PhaseRun(m, Phase.TRAIN)
    with pytest.raises((WireError, ValueError), match=match):
        phase.add(Upload.PROTOS, up)
    phase.finish()  # nothing was folded: every row keeps its value
    np.testing.assert_array_equal(m.rules.state(UnitState).unit, np.array([[1, 0], [0, 1], [0.6, 0.8]], np.float32))


def test_public_prototypes_in_the_training_phase_are_refused_elsewhere() -> None:
    m = model_for("fedpagr", refine=False)
    m.rules.state(UnitState).unit = np.array([[1, 0], [0, 1], [0.6, 0.8]], np.float32)
    with pytest.raises(WireError, match="public-set prototypes in the training phase"):
        PhaseRun(m, Phase.TRAIN).add(
            Upload.PROTOS, ProtoUpload(public=ps({0: [1, 0]}), local=ps({1: [0, 1]}), n_samples=1)
        )

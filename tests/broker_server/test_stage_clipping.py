"""The phase clips every upload once, before any fold sees it (broker_server/core/stages.py): a fold that does nothing
about clipping still gets clipped values, beside other folds or alone, and the norms are recorded once.

A toy technique, registered for these tests only, takes prototype and parameter uploads in the training phase and
keeps what its fold was handed; it declares no `Clip`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest

from broker_server.core.stages import PhaseRun, ServerModel, build_model
from protofl import registry
from protofl.adapter import adapter_layout, initial_adapter
from protofl.algorithms.fedavg import FederatedVector
from protofl.algorithms.fedproto import MeanPrototypes
from protofl.algorithms.robust import ClipPolicy
from protofl.plan import Phase, RoundPlan, Upload
from protofl.presets import make_config
from protofl.sparse import SparseVector
from protofl.technique import Clip, ClippedUpload, Fold, Part, PlanDraft, ServerRule, ServerState, Technique
from protofl.wire import ParamsUpload, ProtoSet, ProtoUpload


class KeepFold(Fold):
    """Reads both upload kinds and keeps the values it is handed; says nothing about clipping."""

    kinds = (Upload.PROTOS, Upload.ADAPTER)

    def __init__(self, kept: list[Any]) -> None:
        self.kept = kept

    def fold(self, prepared: Any) -> None:
        up: ClippedUpload = prepared
        if up.local is not None:
            self.kept.append(("local", up.local.classes.tolist(), up.local.rows.copy()))
        if up.update is not None:
            v = up.update.vector
            self.kept.append(
                (
                    "update",
                    v.indices.tolist() if isinstance(v, SparseVector) else None,
                    np.asarray(v.values if isinstance(v, SparseVector) else v, np.float64).copy(),
                )
            )


class Toy(Technique):
    name = "toy_keep"
    order = 90
    kept: list[Any] = []

    def active(self, cfg: Any) -> bool:
        return True

    def shape(self, draft: PlanDraft, cfg: Any) -> None:
        train = draft.uploads.get(Phase.TRAIN, ())
        if Upload.PROTOS not in train:  # a federation of parameters alone: prototypes go up too
            draft.uploads[Phase.TRAIN] = (*train, Upload.PROTOS)

    def server_rule(self, model: ServerState) -> ServerRule:
        kept = self.kept

        class Rule(ServerRule):
            def uploads(self) -> Mapping[Phase, tuple[Upload, ...]]:
                return {Phase.TRAIN: self.model.plan.sends(Phase.TRAIN)}  # whatever the others take, it reads too

            def folds(self, phase: Phase) -> list[Fold]:
                return [KeepFold(kept)] if phase is Phase.TRAIN else []

        return Rule(model)


@pytest.fixture
def toy() -> Iterator[list[Any]]:
    builtin = registry.techniques()
    kept: list[Any] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Toy, "kept", kept)
        mp.setattr(registry, "techniques", lambda: (*builtin, Toy()))
        yield kept


def model_for(preset: str, policy: ClipPolicy | None = None, **overrides: Any) -> ServerModel:
    cfg = make_config(preset, num_classes=3, proto_dim=2, adapter_rank=1, **overrides)
    plan = RoundPlan.from_config(cfg)
    assert "toy_keep" in plan.techniques
    return build_model(cfg, plan, policy)


def protos(table: dict[int, list[float]], counts: dict[int, int] | None = None) -> ProtoUpload:
    classes = sorted(table)
    ps = ProtoSet(
        classes=np.array(classes),
        values=np.array([table[c] for c in classes], np.float32),
        counts=None if counts is None else np.array([counts[c] for c in classes]),
    )
    return ProtoUpload(local=ps, public=None, n_samples=1)


def test_a_fold_alone_that_declares_nothing_gets_rows_clipped_around_zero(toy: list[Any]) -> None:
    m = model_for("fedavg", federate="none", prototypes="none")  # the toy is the only fold of the phase
    m.radii["protos"] = 5.0
    run = PhaseRun(m, Phase.TRAIN)
    run.add(Upload.PROTOS, protos({0: [30.0, 40.0], 2: [3.0, 4.0]}))
    run.finish()
    # (30, 40) is 50 from zero: scaled onto the ball of radius 5, (3, 4); (3, 4) is 5 away and stays as sent
    ((_, classes, rows),) = toy
    assert classes == [0, 2] and rows.tolist() == [[3.0, 4.0], [3.0, 4.0]]
    assert m.round_clips.checked == {"protos": 2} and m.round_clips.clipped == {"protos": 1}
    assert m.radii["protos"] == 10.0 * 27.5  # the factor times the median norm as sent, (50 + 5) / 2


def test_beside_fedproto_a_fold_gets_the_rows_fedproto_folds_and_norms_count_once(toy: list[Any]) -> None:
    m = model_for("fedproto")
    state = m.rules.state(MeanPrototypes)
    state.prototypes = {0: np.array([1.0, 1.0], np.float32)}
    m.radii["protos"] = 1.0
    run = PhaseRun(m, Phase.TRAIN)
    run.add(Upload.PROTOS, protos({0: [1.0, 5.0], 1: [0.5, 0.0]}, {0: 2, 1: 2}))
    run.finish()
    # class 0 around (1, 1): (1, 5) is 4 away -> (1, 2); class 1 around zero (no prototype yet): 0.5 away, as sent
    ((_, classes, rows),) = toy
    assert classes == [0, 1] and rows.tolist() == [[1.0, 2.0], [0.5, 0.0]]
    assert state.prototypes[0].tolist() == [1.0, 2.0] and state.prototypes[1].tolist() == [0.5, 0.0]  # FedProto's too
    assert m.round_clips.checked == {"protos": 2} and m.round_clips.clipped == {"protos": 1}  # not 4 and 2


def test_a_parameter_vector_is_clipped_around_the_global_one_for_every_fold(toy: list[Any]) -> None:
    m = model_for("fedavg", federate="adapter", prototypes="none")
    start = m.rules.state(FederatedVector).adapter
    assert start is not None and np.array_equal(start, initial_adapter(adapter_layout(2, 1, 3), seed=0))  # round 0
    d, before = start.shape[0], start.astype(np.float64)
    m.radii["adapter"] = 1.0
    run = PhaseRun(m, Phase.TRAIN)
    far = before + np.r_[3.0, 4.0, np.zeros(d - 2)]  # 5 from the global adapter
    run.add(Upload.ADAPTER, ParamsUpload(update=far.astype(np.float32), n_samples=1, base_round=1))
    run.finish()
    ((_, _, vector),) = toy
    # onto the ball of radius 1 around it: (3, 4) / 5; FedAvg's one upload is the new adapter
    np.testing.assert_allclose(vector - before, np.r_[0.6, 0.8, np.zeros(d - 2)], atol=1e-6)
    after = m.rules.state(FederatedVector).adapter
    assert after is not None
    np.testing.assert_allclose(after, vector, atol=1e-6)
    assert m.round_clips.checked == {"adapter": 1} and m.round_clips.clipped == {"adapter": 1}


def test_with_clipping_off_every_fold_gets_the_values_as_sent(toy: list[Any]) -> None:
    m = model_for("fedavg", ClipPolicy(enabled=False), federate="none", prototypes="none")
    m.radii["protos"] = 5.0
    run = PhaseRun(m, Phase.TRAIN)
    run.add(Upload.PROTOS, protos({0: [30.0, 40.0]}))
    run.finish()
    ((_, _, rows),) = toy
    assert rows.tolist() == [[30.0, 40.0]] and m.round_clips.checked == {}


def test_two_folds_that_clip_one_part_differently_cannot_share_a_phase(toy: list[Any]) -> None:
    m = model_for("fedproto")

    class Other(KeepFold):
        clip = {Part.LOCAL: Clip("anchors")}

    rule = m.rules[-1]
    rule.folds = lambda phase: [Other([])]  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="clip the local values of protos uploads differently"):
        PhaseRun(m, Phase.TRAIN)


def test_a_refused_upload_records_no_norms(toy: list[Any]) -> None:
    m = model_for("fedproto")
    run = PhaseRun(m, Phase.TRAIN)
    with pytest.raises(Exception, match="counts"):
        run.add(Upload.PROTOS, protos({0: [1.0, 5.0]}))  # weighted means need counts: FedProto's check refuses
    run.finish()
    assert toy == [] and m.round_clips.checked == {}

"""A federation's server model and its open phase, composed from the active techniques' rules (numpy only).

`build_model` makes the `ServerModel` (protofl/technique.py) and the rule of every active technique, in
rule order, and lets each set up its round-0 state. `PhaseRun` is one open phase: the folds the rules
contribute for it. An upload is checked once against the round plan here (class ids, widths, lengths,
whether this phase takes it), then by every fold that reads its kind, and only then folded into any of
them: an upload that raises leaves everything as it was (the I/O shell counts it as a drop). Folds stream:
they never hold the uploads.

Bounded uploads (protofl/algorithms/robust.py): every prototype and parameter value is clipped to a ball
around the current global value before it is folded, with a radius derived from the previous round's
accepted distances; `--robust median|trimmed` replaces plain means by coordinate-wise robust means.
"""

from __future__ import annotations

from typing import Any

from protofl import registry
from protofl.algorithms.robust import ClipPolicy
from protofl.config import FederationConfig
from protofl.errors import WireError
from protofl.plan import Phase, RoundPlan, Upload
from protofl.sparse import SparseVector
from protofl.technique import Fold, ServerModel
from protofl.wire import AdapterUpload, ProtoSet, ProtoUpload

__all__ = ["PhaseRun", "ServerModel", "build_model", "check_upload"]

_NAMES = {Phase.PROTO: "prototype", Phase.TRAIN: "training", Phase.DONE: "final"}


def build_model(cfg: FederationConfig, plan: RoundPlan, policy: ClipPolicy | None = None) -> ServerModel:
    """The server model at round 0, with the active techniques' rules attached."""
    model = ServerModel(cfg, plan, policy=policy or ClipPolicy())
    model.rules = [tech.server_rule(model) for tech in registry.active(cfg)]
    for rule in model.rules:
        rule.init_model()
    return model


def _check_protos(ps: ProtoSet | None, plan: RoundPlan, what: str) -> None:
    if ps is None:
        return
    width = ps.values.shape[1] if ps.values.ndim == 2 else 0
    for c in ps.classes:
        if not 0 <= int(c) < plan.num_classes:
            raise WireError(f"{what}: class {int(c)} out of range [0, {plan.num_classes})")
    if ps.classes.size and width != plan.proto_width:
        raise WireError(f"{what} for class {int(ps.classes[0])}: expected {plan.proto_width} values, got {width}")


def check_upload(plan: RoundPlan, phase: Phase, up: ProtoUpload | AdapterUpload) -> None:
    """The plan's checks of one upload: the one place they are written (the wire decoder already checked
    types, finiteness and sizes)."""
    if isinstance(up, ProtoUpload):
        _check_protos(up.local, plan, "prototype")
        _check_protos(up.public, plan, "public prototype")
        if up.public is not None and up.public.classes.size and plan.public_phase is not phase:
            raise WireError(f"public-set prototypes in the {_NAMES[phase]} phase; this federation sends them "
                            + (f"in the {_NAMES[plan.public_phase]} phase" if plan.public_phase else "not at all"))
        return
    if plan.federate == "none":
        raise WireError("this federation does not exchange adapters")
    if up.n_samples <= 0:
        raise WireError("adapter upload with n_samples = 0")
    if isinstance(up.update, SparseVector) and plan.federate == "full":
        raise WireError("FedAvg needs the full parameter vector, got a sparse update")


class PhaseRun:
    """One open phase: every active rule's folds for it, fed each accepted upload."""

    def __init__(self, model: ServerModel, phase: Phase) -> None:
        self.model = model
        self.phase = phase
        model.logs = {}
        self.folds: list[Fold] = [f for rule in model.rules for f in rule.folds(phase)]

    def add(self, kind: Upload, up: Any) -> None:
        """Check `up` against the plan and every fold that reads `kind`, then fold it into all of them."""
        check_upload(self.model.plan, self.phase, up)
        takers = [f for f in self.folds if kind in f.kinds]
        if not takers:
            raise WireError(f"this federation does not exchange {kind.value} uploads in the {self.phase.value} phase")
        prepared = [(f, f.check(up)) for f in takers]
        for fold, p in prepared:
            fold.fold(p)

    def finish(self) -> None:
        """Fold the phase into the server model (coordinates and classes nobody sent keep their value)."""
        self.model.close_logs()
        for fold in self.folds:
            fold.finish()

    def round_targets(self) -> ProtoSet | None:
        """The targets of the round message that opens this phase."""
        return self.model.first("round_targets", self.phase)

"""Device-side stage composition: the round plan's client halves over numpy arrays (no torch).

The mirror of broker_server/stages.py. Given the features z the device computed, it builds what the
plan says to upload (ERPA's phase-1 tables, post-training prototypes; scaled, CPS-compressed, in the
plan's dtype); given the anchors of a round message, it builds the dense alignment targets. The
techniques themselves live in protofl/algorithms; the agent only moves arrays in and out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from protofl.algorithms import cps, erpa, refine, scaling
from protofl.algorithms.fedproto import local_prototypes
from protofl.errors import WireError
from protofl.plan import RoundPlan, TargetKind
from protofl.wire import ProtoSet


@dataclass
class DeviceTables:
    """What a device keeps between rounds for its targets: its classes' local prototype norms
    (mu = "auto" rescales global prototypes to them)."""

    masks: np.ndarray | None = None
    local_norms: dict[int, float] = field(default_factory=dict)

    def remember(self, protos: dict[int, np.ndarray]) -> None:
        self.local_norms.update(scaling.support_norms(protos, self.masks))


def pack(plan: RoundPlan, protos: dict[int, np.ndarray], counts: dict[int, int] | None, masks: np.ndarray | None,
         *, scaled: bool) -> ProtoSet:
    """A prototype table for the wire: optional scaling (n*p, counts hidden), then CPS, in the plan's dtype."""
    if scaled and counts is not None:
        protos, counts = scaling.scale_prototypes(protos, counts), None
    if masks is not None:
        protos = cps.compress_table(protos, masks)
    return ProtoSet.from_table(protos, plan.proto_width, plan.proto_dtype, counts)


def erpa_tables(plan: RoundPlan, tables: DeviceTables, z_public: np.ndarray | None, y_public: np.ndarray | None,
                z_local: np.ndarray, y_local: np.ndarray) -> tuple[ProtoSet | None, ProtoSet]:
    """ERPA phase 1 (RefProtoFL Alg. 3): (public prototypes or None, local ones for uncovered classes)."""
    pub, local, counts = erpa.client_prototypes(z_public, y_public, z_local, y_local, plan.num_classes,
                                                plan.public_classes)
    tables.remember(local)
    public = pack(plan, pub, None, tables.masks, scaled=False) if z_public is not None and plan.public_classes else None
    return public, pack(plan, local, counts, tables.masks, scaled=plan.scaled)


def _unit_prototypes(plan: RoundPlan, tables: DeviceTables, z: np.ndarray, y: np.ndarray,
                     classes: set[int] | None = None) -> ProtoSet:
    """FedPAGR's unit prototypes of (z, y) for `classes` (None: every class present), on the wire
    (spherical CPS: the direction on the class's mask support)."""
    protos = refine.client_prototypes(z, y, plan.num_classes)
    if classes is not None:
        protos = {c: v for c, v in protos.items() if c in classes}
    if tables.masks is not None:
        kept = sorted(protos)
        cut = cps.restrict_to_masks(np.stack([protos[c] for c in kept]), tables.masks[kept]) if kept else []
        protos = {c: cut[i] for i, c in enumerate(kept)}
    return pack(plan, protos, None, tables.masks, scaled=False)


def trained_prototypes(plan: RoundPlan, tables: DeviceTables, z: np.ndarray, y: np.ndarray) -> ProtoSet:
    """The training phase's prototype upload: FedPAGR's unit prototypes, or mean prototypes.

    With ERPA on unit prototypes, only the classes the public set does not cover (RefProtoFL Alg. 3:
    the public-covered ones are anchored by `public_unit_prototypes` alone)."""
    if plan.prototypes == "unit":
        uncovered = set(range(plan.num_classes)) - set(plan.public_classes) if plan.public_in_train else None
        return _unit_prototypes(plan, tables, z, y, uncovered)
    protos, counts = local_prototypes(z, y, plan.num_classes)
    tables.remember(protos)
    return pack(plan, protos, counts, tables.masks, scaled=plan.scaled)


def public_unit_prototypes(plan: RoundPlan, tables: DeviceTables, z_public: np.ndarray | None,
                           y_public: np.ndarray | None) -> ProtoSet | None:
    """ERPA on unit prototypes (candidate (d)): unit prototypes of the public set for its covered
    classes, sent with the training upload; None when the device holds no public set."""
    if not plan.public_in_train or z_public is None or y_public is None or not plan.public_classes:
        return None
    return _unit_prototypes(plan, tables, z_public, y_public, set(plan.public_classes))


def _scatter(plan: RoundPlan, tables: DeviceTables, table: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """CPS anchors scattered back onto their masks (dense, m wide); others unchanged."""
    if not plan.cps:
        return table
    if tables.masks is None:
        raise WireError("anchors are CPS-compressed but this federation's config has no masks")
    return cps.reconstruct_table(table, tables.masks)


def pagr_prototypes(plan: RoundPlan, tables: DeviceTables, anchors: ProtoSet, anchor_kind: str) -> np.ndarray:
    """FedPAGR's refined prototypes P (C, m), unit rows, from a round's anchors (spherical CPS: scattered
    back onto their masks). Raises WireError if they are not what this federation's plan sends."""
    if anchor_kind != plan.anchor_kind:
        raise WireError(f"anchors labelled '{anchor_kind}', but this federation sends '{plan.anchor_kind}'")
    table, _ = anchors.table()
    if sorted(table) != list(range(plan.num_classes)):
        raise WireError(f"FedPAGR anchors must hold every class 0..{plan.num_classes - 1}, got {sorted(table)}")
    table = _scatter(plan, tables, table)
    return refine.normalize_rows(np.stack([table[c] for c in range(plan.num_classes)])).astype(np.float32)


def alignment_targets(plan: RoundPlan, tables: DeviceTables, anchors: ProtoSet, anchor_kind: str,
                      mu: float | str) -> dict[int, np.ndarray]:
    """Dense (m-wide) targets per class from a round's anchors (MSE / ERPA targets; not FedPAGR's).

    CPS anchors are scattered back onto their masks; scaled ones (TinyProto) become mu * G_c, or with
    mu = "auto" G_c at this device's own prototype norm. Public-covered classes (ERPA ext prototypes)
    are never scaled. Raises WireError if the anchors are not what this federation's plan sends.
    """
    if anchor_kind != plan.anchor_kind:
        raise WireError(f"anchors labelled '{anchor_kind}', but this federation's plan sends '{plan.anchor_kind}'")
    assert plan.target in (TargetKind.MSE, TargetKind.ANCHOR)
    table, _ = anchors.table()
    table = _scatter(plan, tables, table)
    if plan.scaled:
        public = set(plan.public_classes)
        scaled = {c: v for c, v in table.items() if c not in public}
        if mu == "auto":
            # Without any local prototype we hold none of these classes, so no sample of ours
            # would use their targets: drop them rather than guess a magnitude.
            scaled = scaling.auto_rescale(scaled, tables.local_norms) if tables.local_norms else {}
            table = {c: v for c, v in table.items() if c in public}
        else:
            scaled = scaling.apply_mu(scaled, float(mu))
        table.update(scaled)
    return table

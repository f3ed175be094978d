"""Server-side stage composition: the round plan's stages as accumulators (numpy only).

`ServerModel` is the global state (adapter, FedAvg parameters, prototypes). Each phase gets a fresh
accumulator from it: `PrototypePhase` (ERPA anchors) and `TrainPhase` (APUD / FedAvg adapters and
FedProto / TinyProto / FedPAGR prototypes). Accumulators stream: they fold each upload in as it
arrives and never hold the uploads. Every `add` checks the whole upload before it folds anything,
so an upload that raises leaves the accumulator as it was (the aggregator counts it as a drop).

Bounded uploads (protofl/algorithms/robust.py): every prototype and adapter value is clipped to a
ball around the current global value before it is folded, with a radius derived from the previous
round's accepted distances; `--robust median|trimmed` replaces the mean of plain-mean prototypes and
of adapters by a coordinate-wise robust mean (scaled and unit prototypes are clipped only).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from protofl.algorithms import cps, erpa, refine
from protofl.algorithms.apud import ApudAggregator
from protofl.algorithms.fedavg import FedAvgAggregator
from protofl.algorithms.fedproto import PrototypeAggregator
from protofl.algorithms.robust import ClipPolicy, CoordinateRobust, NormLog, clip_around
from protofl.algorithms.scaling import ScaledAggregator
from protofl.config import FederationConfig
from protofl.errors import WireError
from protofl.plan import RoundPlan
from protofl.sparse import SparseVector
from protofl.wire import AdapterUpload, ProtoSet, ProtoUpload


@dataclass
class ServerModel:
    """What the federation has agreed on so far."""

    cfg: FederationConfig
    plan: RoundPlan
    adapter: np.ndarray | None = None  # theta_a (federate="adapter")
    params: np.ndarray | None = None  # full model (federate="full")
    prototypes: dict[int, np.ndarray] = field(default_factory=dict)  # wire-space global prototypes
    unit: np.ndarray | None = None  # FedPAGR refined prototypes (C, m)
    masks: np.ndarray | None = None  # CPS masks (C, m)
    policy: ClipPolicy = field(default_factory=ClipPolicy)
    # Clipping radius per kind of value ("protos", "anchors", "adapter"), from the last round's upload norms.
    radii: dict[str, float] = field(default_factory=dict)
    clipped: dict[str, int] = field(default_factory=dict)  # uploads clipped so far, per kind

    def radius(self, kind: str) -> float:
        return self.radii.get(kind, self.policy.first_radius)

    def update_radius(self, kind: str, log: NormLog) -> None:
        """After a round: the next radius from its accepted norms (kept if nothing was accepted)."""
        if log.values:
            self.radii[kind] = self.policy.radius(log.values)
        if log.clipped:
            self.clipped[kind] = self.clipped.get(kind, 0) + log.clipped

    def train_anchors(self) -> ProtoSet | None:
        """Targets sent with a (non-ERPA) training round: last round's global prototypes."""
        plan = self.plan
        if plan.prototypes == "unit":
            assert self.unit is not None
            table = {c: self.unit[c] for c in range(plan.num_classes)}
            if self.masks is not None:  # spherical CPS: only the support travels
                table = cps.compress_table(table, self.masks)
            return ProtoSet.from_table(table, plan.proto_width, plan.proto_dtype)
        if plan.prototypes == "mean" and not plan.two_phase and self.prototypes:
            return ProtoSet.from_table(self.prototypes, plan.proto_width, plan.proto_dtype)
        return None


def _table(ps: ProtoSet | None) -> tuple[dict[int, np.ndarray], dict[int, int] | None]:
    return ({}, None) if ps is None else ps.table()


def clip_table(table: dict[int, np.ndarray], centers: dict[int, np.ndarray], radius: float,
               width: int) -> tuple[dict[int, np.ndarray], list[tuple[np.ndarray, float]]]:
    """Every row clipped to `radius` around its class's center (zero where none); and (row, distance)s."""
    out, seen = {}, []
    for c, v in table.items():
        center = centers.get(c)
        out[c], d = clip_around(v, np.zeros(width) if center is None else np.asarray(center, np.float64), radius)
        seen.append((v, d))
    return out, seen


def check_table(table: dict[int, np.ndarray], num_classes: int, width: int, what: str) -> None:
    for c, v in table.items():
        if not 0 <= c < num_classes:
            raise WireError(f"{what}: class {c} out of range [0, {num_classes})")
        if v.shape != (width,):
            raise WireError(f"{what} for class {c}: expected {width} values, got {v.shape[0] if v.ndim else 0}")


class PrototypePhase:
    """ERPA phase 1 on the server (RefProtoFL Alg. 4): ext prototypes for public classes, global
    prototypes (n-weighted, or scaled when TinyProto scaling is on) for the others, then anchors."""

    def __init__(self, model: ServerModel) -> None:
        self.model = model
        plan = model.plan
        self.public = set(plan.public_classes)
        self.erpa = erpa.ErpaAggregator(plan.num_classes, plan.proto_width, sorted(self.public))
        self.scaled = ScaledAggregator(plan.num_classes, plan.proto_width) if plan.scaled else None
        self.log = NormLog()

    @property
    def senders(self) -> int:
        return self.erpa.senders

    def validate(self, up: ProtoUpload) -> None:
        plan = self.model.plan
        pub, _ = _table(up.public)
        loc, counts = _table(up.local)
        check_table(pub, plan.num_classes, plan.proto_width, "public prototype")
        check_table(loc, plan.num_classes, plan.proto_width, "local prototype")
        if set(pub) - self.public:
            raise WireError(f"public prototypes for classes {sorted(set(pub) - self.public)} with no public data")
        if set(loc) & self.public:
            raise WireError(f"local prototypes for public-covered classes {sorted(set(loc) & self.public)}")
        if plan.counts_with_prototypes and loc and counts is None:
            raise WireError("local prototypes without counts (this federation does not use scaling)")

    def add(self, up: ProtoUpload) -> None:
        self.validate(up)
        pub, _ = _table(up.public)
        loc, counts = _table(up.local)
        # Anchors are built from scratch each round: clipped around zero.
        radius, width = self.model.radius("anchors"), self.model.plan.proto_width
        pub, d_pub = clip_table(pub, {}, radius, width)
        loc, d_loc = clip_table(loc, {}, radius, width)
        self._fold(pub, loc, counts)
        for v, d in d_pub + d_loc:
            self.log.record(v, d, radius)

    def _fold(self, pub: dict[int, np.ndarray], loc: dict[int, np.ndarray], counts: dict[int, int] | None) -> None:
        if self.scaled is not None:
            # Both accumulators check before folding; check the scaled table first so that a bad one
            # cannot leave ERPA's half folded.
            self.scaled.check(loc)
            self.erpa.add(pub, {}, {})
            self.scaled.add(loc)
        else:
            self.erpa.add(pub, loc, counts or {})

    def anchors(self) -> dict[int, np.ndarray]:
        self.model.update_radius("anchors", self.log)
        glob = self.scaled.result() if self.scaled is not None else self.erpa.global_prototypes()
        table = erpa.combine_anchors(self.erpa.ext_prototypes(), glob, sorted(self.public))
        if self.model.cfg.refine and table:
            table = self._refined(table)
        return table

    def _refined(self, table: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        cfg, masks = self.model.cfg, self.model.masks
        dense = cps.reconstruct_table(table, masks) if masks is not None else table
        out = refine.refine_anchor_table(dense, masks, steps=cfg.refine_steps, lr=cfg.refine_lr,
                                         momentum=cfg.refine_momentum, lambda_s=cfg.lambda_s, margin=cfg.margin)
        return cps.compress_table(out, masks) if masks is not None else out


class TrainPhase:
    """The training phase's accumulators: adapters (APUD or FedAvg) and post-training prototypes."""

    def __init__(self, model: ServerModel) -> None:
        self.model = model
        plan = model.plan
        self.adapters: ApudAggregator | FedAvgAggregator | None = None
        if plan.federate == "adapter":
            assert model.adapter is not None
            self.adapters = ApudAggregator(model.adapter)
        elif plan.federate == "full" and model.params is not None:
            self.adapters = FedAvgAggregator(model.params.shape[0])
        # FedAvg without a known model (a server with no torch): the first upload fixes the length.
        self.protos: PrototypeAggregator | ScaledAggregator | refine.ConsensusAggregator | None = None
        # ERPA on unit prototypes (candidate (d)): the public-set prototypes of the training upload.
        self.public_protos: refine.ConsensusAggregator | None = None
        if plan.prototypes == "unit":
            assert model.unit is not None
            self.protos = refine.ConsensusAggregator(model.unit)
            if plan.public_in_train:
                self.public_protos = refine.ConsensusAggregator(model.unit)
        elif plan.prototypes == "mean" and not plan.two_phase:
            self.protos = (ScaledAggregator(plan.num_classes, plan.proto_width) if plan.scaled
                           else PrototypeAggregator(plan.num_classes, plan.proto_width, weighting=model.cfg.aggregation))
        policy = model.policy
        robust = policy.robust != "mean"
        # Robust means replace plain means only: scaled sums and unit directions have their own geometry.
        self.robust_protos: dict[int, CoordinateRobust] | None = (
            {} if robust and isinstance(self.protos, PrototypeAggregator) else None)
        self.robust_adapter: CoordinateRobust | None = None
        if robust and isinstance(self.adapters, (ApudAggregator, FedAvgAggregator)):
            self.robust_adapter = CoordinateRobust(self._adapter_reference().shape[0], policy.robust, policy.trim)
        self.proto_log, self.adapter_log = NormLog(), NormLog()
        self._ref64: np.ndarray | None = None  # the dense adapter/model clipped around, in float64

    def _adapter_reference(self) -> np.ndarray:
        """The global vector adapter uploads are clipped around (FedAvg: the model, when known)."""
        model = self.model
        ref = model.adapter if model.plan.federate == "adapter" else model.params
        assert ref is not None
        return ref

    def _proto_centers(self) -> dict[int, np.ndarray]:
        """The current global prototypes in wire space (spherical CPS: cut to their masks), the centres
        uploads are clipped around."""
        if self.model.plan.prototypes == "unit":
            assert self.model.unit is not None
            unit = dict(enumerate(self.model.unit))
            return cps.compress_table(unit, self.model.masks) if self.model.masks is not None else unit
        return self.model.prototypes

    @property
    def senders(self) -> int:
        return self.adapters.senders if self.adapters is not None else 0

    def add_adapter(self, up: AdapterUpload) -> None:
        plan = self.model.plan
        if plan.federate == "none":
            raise WireError("this federation does not exchange adapters")
        if up.n_samples <= 0:
            raise WireError("adapter upload with n_samples = 0")
        if isinstance(up.update, SparseVector):
            if plan.federate == "full":
                raise WireError("FedAvg needs the full parameter vector, got a sparse update")
            n = up.update.n
        else:
            n = up.update.shape[0]
        if self.adapters is None:  # FedAvg, model length not known yet
            self.adapters = FedAvgAggregator(n)
        expected = self.model.adapter.shape[0] if plan.federate == "adapter" else self.adapters.dim
        if n != expected:
            raise WireError(f"adapter of length {n}, expected {expected}")
        has_reference = plan.federate == "adapter" or self.model.params is not None
        if not has_reference:  # FedAvg on a server that does not know the model: finiteness checks only
            self.adapters.add(up.update, float(up.n_samples))
            return
        raw = up.update.values if isinstance(up.update, SparseVector) else up.update
        update, dist, radius = self._clipped_adapter(up.update)
        if self.robust_adapter is not None:
            self.adapters.add(update, float(up.n_samples))  # validates; its mean is not used
            if isinstance(update, SparseVector):
                self.robust_adapter.add(update.values.astype(np.float64), update.indices)
            else:
                self.robust_adapter.add(np.asarray(update, np.float64))
        else:
            self.adapters.add(update, float(up.n_samples))
        self.adapter_log.record(raw, dist, radius)

    def _clipped_adapter(self, update: SparseVector | np.ndarray) -> tuple[SparseVector | np.ndarray, float, float]:
        """(the update clipped around the global adapter, its distance, the radius); pure."""
        ref, radius = self._adapter_reference(), self.model.radius("adapter")
        if isinstance(update, SparseVector):
            idx = update.indices
            if idx.shape[0] and (idx.min() < 0 or idx.max() >= ref.shape[0]):
                raise WireError(f"adapter indices out of range [0, {ref.shape[0]})")
            vals, dist = clip_around(update.values, ref[idx].astype(np.float64), radius)
            return (update if dist <= radius else SparseVector(update.n, idx, vals)), dist, radius
        if self._ref64 is None:  # once per round: 90 MB and ~0.1 s per upload for a resnet18 FedAvg model
            self._ref64 = ref.astype(np.float64)
        vals, dist = clip_around(np.asarray(update), self._ref64, radius)
        return (update if dist <= radius else vals), dist, radius

    def add_prototypes(self, up: ProtoUpload) -> None:
        if self.protos is None:
            raise WireError("this federation does not exchange prototypes in the training phase")
        plan = self.model.plan
        table, counts = _table(up.local)
        check_table(table, plan.num_classes, plan.proto_width, "prototype")
        pub = self._public_table(up)
        radius = self.model.radius("protos")
        table, dists = clip_table(table, self._proto_centers(), radius, plan.proto_width)
        if pub:
            pub, pub_dists = clip_table(pub, self._proto_centers(), radius, plan.proto_width)
            dists += pub_dists
        if isinstance(self.protos, refine.ConsensusAggregator):
            masks = self.model.masks
            dense = (lambda t: cps.reconstruct_table(t, masks)) if masks is not None else (lambda t: t)
            local = dense(table)
            if self.public_protos is not None:
                # Both aggregators check everything before folding: check the local table first so that a
                # bad one cannot leave the public prototypes folded alone.
                self.protos.check(local)
                self.public_protos.add(dense(pub))
            self.protos.add(local)
        elif isinstance(self.protos, ScaledAggregator):
            self.protos.add(table)
        else:
            if self.model.cfg.aggregation == "weighted" and table and counts is None:
                raise WireError("prototypes without counts (weighted aggregation needs n_kc)")
            self.protos.add(table, counts)  # validates (and feeds the mean, unused when robust)
            if self.robust_protos is not None:
                for c, v in table.items():
                    self.robust_protos.setdefault(c, CoordinateRobust(plan.proto_width, self.model.policy.robust,
                                                                      self.model.policy.trim)).add(v)
        for v, d in dists:
            self.proto_log.record(v, d, radius)

    def _public_table(self, up: ProtoUpload) -> dict[int, np.ndarray]:
        """The upload's public-set prototypes, checked (only ERPA on unit prototypes sends them here)."""
        plan = self.model.plan
        pub, _ = _table(up.public)
        if not pub:
            return {}
        if not plan.public_in_train:
            raise WireError("public-set prototypes in the training phase; this federation sends them in the "
                            "prototype phase or not at all")
        check_table(pub, plan.num_classes, plan.proto_width, "public prototype")
        public = set(plan.public_classes)
        loc, _ = _table(up.local)
        if set(pub) - public:
            raise WireError(f"public prototypes for classes {sorted(set(pub) - public)} with no public data")
        if set(loc) & public:
            raise WireError(f"local prototypes for public-covered classes {sorted(set(loc) & public)}")
        return pub

    def finish(self) -> None:
        """Fold the round into the server model (coordinates/classes nobody sent keep their value)."""
        cfg, model = self.model.cfg, self.model
        model.update_radius("protos", self.proto_log)
        model.update_radius("adapter", self.adapter_log)
        if self.adapters is not None and self.adapters.senders > 0:
            result = (self.adapters.result() if self.robust_adapter is None
                      else self.robust_adapter.result(self._adapter_reference()).astype(np.float32))
            if model.plan.federate == "adapter":
                model.adapter = result
            else:
                model.params = result
        if isinstance(self.protos, refine.ConsensusAggregator):
            S, K = self.protos.sums()
            p_bar = self.protos.result()
            if self.public_protos is not None:  # candidate (d): public classes anchored by the public set
                p_bar = erpa.unit_anchors(*self.public_protos.sums(), p_bar,
                                          model.plan.public_classes).astype(np.float32)
            unit = (refine.geometric_refine(p_bar, S, K, steps=cfg.refine_steps, lr=cfg.refine_lr,
                                            momentum=cfg.refine_momentum, lambda_s=cfg.lambda_s,
                                            margin=cfg.margin) if cfg.refine else p_bar)
            # Spherical CPS: refinement moves rows off their masks; project them back (after the T steps).
            model.unit = cps.restrict_to_masks(unit, model.masks) if model.masks is not None else unit
        elif self.protos is not None:
            result = self.protos.result()
            if self.robust_protos is not None:
                zero = np.zeros(model.plan.proto_width)
                result = {c: acc.result(zero).astype(np.float32) for c, acc in self.robust_protos.items()}
            if result:
                # FedProto keeps a class's old prototype if nobody sent it this round.
                model.prototypes = {**model.prototypes, **result}

"""ERPA, external-referenced prototype alignment: RefProtoFL (Wu et al., paper 000), Sec. 4.2, Alg. 3-5.

delta_c = 1 if the server's public set has no sample of class c (eq. 12); "public-covered" below
means delta_c = 0.

Client half (Alg. 3, `client_prototypes`; z from the device's backbone and the broadcast adapter):
    public-covered c:            p_kc^pub = mean of z over the public samples of c          (eq. 10)
    not covered and n_kc > 0:    p_kc     = mean of z over D_kc, sent with n_kc             (eq. 11)
(the means themselves are fedproto.local_prototypes). Training then aligns z to the anchors
(eq. 17, on the MSE scale of docs/algorithms.md; the torch term is `alignment` in edge_agent/techniques).

Server half (Alg. 4):
    p_c^ext = uniform mean of p_kc^pub over the clients that sent c                       (eq. 14)
    p_c^g   = sum_{k in U_c} n_kc p_kc / sum_{k in U_c} n_kc over the senders U_c of c   (eqs. 13, 15)
Anchors (Alg. 5 line 2, eq. 16):
    a_c = p_c^ext if c is public-covered, else p_c^g; absent if no client sent c.

Eq. (14) divides by |S^t|, all selected clients; we divide by the clients that actually sent
p_kc^pub. The two agree whenever every participant uploads every public class (what Alg. 3 does);
ours stays a mean when an upload is lost or a client skips a class.

Streaming: two prototype accumulators (fedproto.PrototypeAggregator), uniform for ext and
n-weighted for g, so memory is O(C m) whatever the number of clients.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from protofl.algorithms.fedproto import PrototypeAggregator
from protofl.algorithms.prototypes import local_prototypes
from protofl.algorithms.unit import UnitFold
from protofl.errors import ConfigError, WireError
from protofl.mergeable import Additive
from protofl.technique import (
    Clip,
    ClippedSet,
    ClippedUpload,
    Fold,
    Part,
    Phase,
    PlanDraft,
    RoundFields,
    ServerRule,
    ServerState,
    Technique,
    Upload,
    flag,
)
from protofl.wire import ProtoSet

if TYPE_CHECKING:
    from protofl.config import FederationConfig

__all__ = ["client_prototypes", "ErpaAggregator", "combine_anchors", "unit_anchors", "check_split", "Erpa", "Anchors"]


def client_prototypes(
    z_public: np.ndarray | None,
    y_public: np.ndarray | None,
    z_local: np.ndarray,
    y_local: np.ndarray,
    num_classes: int,
    public_classes: Iterable[int],
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray], dict[int, int]]:
    """Alg. 3: (p^pub for public-covered classes, p for the uncovered classes this client holds, n_kc).

    `z_public` is None when the device holds no public set (then it sends no public prototypes).
    """
    public = {int(c) for c in public_classes}
    pub: dict[int, np.ndarray] = {}
    if public and z_public is not None and y_public is not None:
        protos, _ = local_prototypes(z_public, y_public, num_classes)
        pub = {c: p for c, p in protos.items() if c in public}
    protos, counts = local_prototypes(z_local, y_local, num_classes)
    local = {c: p for c, p in protos.items() if c not in public}
    return pub, local, {c: counts[c] for c in local}


def check_split(public: Mapping[int, Any], local: Mapping[int, Any], public_classes: Iterable[int]) -> None:
    """Alg. 3's split: public-set prototypes only for public-covered classes, local ones only for the rest."""
    covered = {int(c) for c in public_classes}
    wrong_pub = sorted({int(c) for c in public} - covered)
    if wrong_pub:
        raise WireError(
            f"public prototypes for classes {wrong_pub} with no public data; send local prototypes "
            f"(with counts) for those"
        )
    wrong_loc = sorted({int(c) for c in local} & covered)
    if wrong_loc:
        raise WireError(
            f"local prototypes for public-covered classes {wrong_loc}; those are anchored by public "
            f"prototypes only (keeps the label histogram private)"
        )


class ErpaAggregator(Additive):
    """Alg. 4: external-reference prototypes for public classes, n-weighted global ones for the rest."""

    additive = ("_ext", "_glob", "_senders")  # mergeable across aggregator shards

    def __init__(self, num_classes: int, dim: int, public_classes: Sequence[int]) -> None:
        public = [int(c) for c in public_classes]
        if len(set(public)) != len(public):
            raise ValueError(f"ERPA: public_classes has duplicates: {sorted(public)}")
        bad = [c for c in public if not 0 <= c < int(num_classes)]
        if bad:
            raise ValueError(f"ERPA: public classes {bad} out of range [0, {num_classes})")
        self.public_classes = frozenset(public)
        self._ext = PrototypeAggregator(num_classes, dim, weighting="mean")
        self._glob = PrototypeAggregator(num_classes, dim, weighting="weighted")
        self._senders = 0

    @property
    def senders(self) -> int:
        """How many client uploads have been accepted."""
        return self._senders

    def add(
        self,
        public: Mapping[int, np.ndarray],
        local: Mapping[int, np.ndarray],
        local_counts: Mapping[int, int],
    ) -> None:
        """One client's Alg. 3 upload. Public prototypes only for public-covered classes, local ones
        (with n_kc) only for the others; anything else is rejected and leaves the state unchanged."""
        check_split(public, local, self.public_classes)
        # Check both tables before applying either, so a bad local table cannot leave a half-applied upload.
        ext_rows = self._ext._prepare(public, None)
        glob_rows = self._glob._prepare(local, local_counts)
        self._ext._apply(ext_rows)
        self._glob._apply(glob_rows)
        self._senders += 1

    def ext_prototypes(self) -> dict[int, np.ndarray]:
        """p_c^ext (eq. 14) for the public-covered classes somebody sent."""
        return self._ext.result()

    def global_prototypes(self) -> dict[int, np.ndarray]:
        """p_c^g (eq. 15) for the uncovered classes somebody sent."""
        return self._glob.result()

    def anchors(self) -> dict[int, np.ndarray]:
        """a_c (eq. 16) for every class that has one."""
        return combine_anchors(self.ext_prototypes(), self.global_prototypes(), self.public_classes)


def combine_anchors(
    ext: Mapping[int, np.ndarray],
    glob: Mapping[int, np.ndarray],
    public_classes: Iterable[int],
) -> dict[int, np.ndarray]:
    """Eq. (16) as a pure function: a_c = ext[c] for public-covered c, glob[c] otherwise.

    The combined pipeline passes scaled-aggregation results as `glob`, which may hold public
    classes too. Those are ignored while ext[c] exists; if no client's public prototype for c
    arrived this round, glob[c] stands in rather than leaving the class without an anchor.
    External prototypes for classes that are not public-covered are ignored (eq. 16 gives them
    weight 1 - delta_c = 0). A class in neither table has no anchor.
    """
    public = {int(c) for c in public_classes}
    out: dict[int, np.ndarray] = {}
    for c in sorted({int(c) for c in glob} | {int(c) for c in ext if int(c) in public}):
        if c in public and c in ext:
            out[c] = np.asarray(ext[c], dtype=np.float32).copy()
        elif c in glob:
            out[c] = np.asarray(glob[c], dtype=np.float32).copy()
    return out


def unit_anchors(
    ext_sum: np.ndarray, ext_count: np.ndarray, consensus: np.ndarray, public_classes: Iterable[int]
) -> np.ndarray:
    """Eq. (16) on the unit sphere (the combined pipeline's candidate (d), docs/algorithms.md): the anchor of a
    public-covered class c that some client sent is the normalised uniform mean of the clients' unit
    public-set prototypes, normalize(ext_sum[c] / ext_count[c]) (eq. 14, then normalised like the unit
    consensus, protofl/algorithms/unit.py); every other row is the consensus prototype `consensus[c]`
    (which already keeps last round's row for a class nobody sent).

    `ext_sum` (C, m) and `ext_count` (C,) are a ConsensusAggregator's sums over the public prototypes;
    returns a new (C, m) float64 array with unit rows where ext rows were used.
    """
    out = np.array(consensus, dtype=np.float64, copy=True)
    S, K = np.asarray(ext_sum, dtype=np.float64), np.asarray(ext_count)
    if S.shape != out.shape or K.shape != (out.shape[0],):
        raise ValueError(f"ERPA unit anchors: sums {S.shape} / counts {K.shape} do not match prototypes {out.shape}")
    for c in sorted({int(c) for c in public_classes}):
        if K[c] > 0:
            norm = float(np.linalg.norm(S[c]))
            if norm > 0.0:  # opposite directions cancelling exactly: keep the consensus row
                out[c] = S[c] / norm
    return out


# -- the technique ------------------------------------------------------------------------------------
def public_class_list(cfg: FederationConfig) -> tuple[int, ...]:
    """The classes the server's public set covers (none when ERPA is off or the set is empty)."""
    if not cfg.erpa or cfg.public_per_class == 0:
        return ()
    if cfg.public_classes is None:
        return tuple(range(cfg.num_classes))
    return tuple(sorted(set(cfg.public_classes)))


class Erpa(Technique):
    """RefProtoFL's ERPA: anchors from a server-held public set. With mean prototypes a round has a first
    phase (public-set and local prototypes -> anchors); on unit prototypes (candidate (d)) the public-set
    prototypes travel with the training upload and anchor their classes on the sphere."""

    name = "erpa"
    order = 30
    options = {
        "erpa": flag("erpa"),
        # The public set itself (public_per_class, public_classes) is a core field of the config: it is carved
        # out of the training data for every preset; ERPA is what anchors on it.
    }

    def check(self, cfg: FederationConfig) -> None:
        if not cfg.erpa:
            return
        # On unit prototypes the public-set prototypes go up with the training upload, which equals the
        # next round's first phase only while nothing federated changes the device's features in between.
        if cfg.prototypes == "unit" and cfg.federate != "none":
            raise ConfigError(
                "erpa on unit prototypes sends its public-set prototypes with the training upload, "
                "which is exact only when no adapter or model is federated: set federate='none' "
                "(or prototypes='mean')"
            )
        if cfg.prototypes == "unit" and cfg.refine:
            raise ConfigError(
                "refinement of ERPA unit anchors is not built: turn refine off (or erpa off for "
                "the unit prototypes' own refinement)"
            )
        # A public-covered class is anchored by the public-set mean; only the other classes travel as
        # n-weighted prototypes. With every class covered scaling acts on nothing (measured: identical
        # accuracy on 3 seeds with and without it, bench/results/TABLE.md).
        if cfg.scaling and len(public_class_list(cfg)) == cfg.num_classes:
            raise ConfigError(
                "scaling changes nothing with erpa when the public set covers every class: every "
                "anchor is the public-set mean, so no client sends an n-weighted prototype; turn "
                "scaling off, or list fewer public_classes (scaling then acts on the others)"
            )

    def shape(self, draft: PlanDraft, cfg: FederationConfig) -> None:
        draft.public_classes = public_class_list(cfg)
        if cfg.prototypes == "unit":
            draft.public_phase = Phase.TRAIN  # one phase: the public-set prototypes ride on the training upload
            return
        draft.phases = (Phase.PROTO, Phase.TRAIN)
        draft.public_phase = Phase.PROTO
        draft.uploads = {
            Phase.PROTO: (Upload.PROTOS,),
            Phase.TRAIN: tuple(u for u in draft.uploads.get(Phase.TRAIN, ()) if u is not Upload.PROTOS),
        }

    def server_rule(self, model: ServerState) -> ServerRule:
        return ErpaRule(model)


@dataclass
class Anchors:
    """ERPA's server state: the anchors the first phase built (Alg. 5, eq. 16), the training round's targets."""

    targets: ProtoSet | None = None


class ErpaRule(ServerRule):
    fills = frozenset({"targets"})

    def __init__(self, model: ServerState) -> None:
        super().__init__(model)
        self.state = Anchors()
        self.public_fold: PublicUnitFold | None = None

    def uploads(self) -> Mapping[Phase, tuple[Upload, ...]]:
        plan = self.model.plan
        if plan.public_phase is None:
            return {}
        return {plan.public_phase: (Upload.PROTOS,)}

    def folds(self, phase: Phase) -> list[Fold]:
        plan = self.model.plan
        self.public_fold = None
        if phase is Phase.PROTO:
            return [AnchorFold(self.model, self.state)]
        if phase is Phase.TRAIN and plan.public_phase is Phase.TRAIN:
            unit = self.model.rules.unit_prototypes()
            assert unit is not None, "public-set prototypes on the sphere need unit prototypes"
            self.public_fold = PublicUnitFold(unit, self.model.rules.support_masks(), plan.public_classes)
            return [self.public_fold]
        return []

    def round_fields(self, phase: Phase) -> RoundFields | None:
        if phase is Phase.TRAIN and self.model.plan.two_phase and self.state.targets is not None:
            return RoundFields(targets=self.state.targets)
        return None

    def adjust_consensus(self, unit: np.ndarray) -> np.ndarray:
        if self.public_fold is None:
            return unit
        return unit_anchors(*self.public_fold.acc.sums(), unit, self.model.plan.public_classes).astype(np.float32)


class AnchorFold(Fold):
    """The first phase (Alg. 4): ext prototypes for public classes, global prototypes (n-weighted, or another
    technique's aggregate, e.g. scaled sums) for the others; at its end the anchors (Alg. 5, eq. 16)."""

    kinds = (Upload.PROTOS,)
    merged = ("erpa", "other")
    # Anchors are built from scratch each round: both sets are clipped around zero.
    clip = {Part.LOCAL: Clip("anchors"), Part.PUBLIC: Clip("anchors")}

    def __init__(self, model: ServerState, state: Anchors) -> None:
        self.model, self.state = model, state
        plan = model.plan
        self.public = sorted(plan.public_classes)
        self.erpa = ErpaAggregator(plan.num_classes, plan.proto_width, self.public)
        self.other = model.rules.mean_aggregator(plan.proto_width)  # None: n-weighted, inside self.erpa

    def check(self, up: ClippedUpload) -> Any:
        pub, _ = up.public.table() if up.public is not None else ({}, None)
        loc, counts = up.local.table() if up.local is not None else ({}, None)
        check_split(pub, loc, self.public)
        if self.other is None and loc and counts is None:
            raise WireError("local prototypes without counts (this federation does not use scaling)")
        if self.other is not None:
            # Both accumulators check before folding: check the other table first so that a bad one
            # cannot leave this half folded.
            self.other.check(loc)
        return pub, loc, counts

    def fold(self, prepared: Any) -> None:
        pub, loc, counts = prepared
        if self.other is not None:
            self.erpa.add(pub, {}, {})
            self.other.add(loc)
        else:
            self.erpa.add(pub, loc, counts or {})

    def finish(self) -> None:
        glob = self.other.result() if self.other is not None else self.erpa.global_prototypes()
        table = combine_anchors(self.erpa.ext_prototypes(), glob, self.public)
        table = self.model.rules.adjust_targets(table)
        plan = self.model.plan
        self.state.targets = ProtoSet.from_table(table, plan.proto_width, plan.proto_dtype) if table else None


class PublicUnitFold(UnitFold):
    """Candidate (d): the unit public-set prototypes that travel with the training upload."""

    part = Part.PUBLIC

    def __init__(self, unit: np.ndarray, masks: np.ndarray | None, public_classes: Iterable[int]) -> None:
        super().__init__(unit, masks)
        self.public_classes = tuple(public_classes)

    def prototypes(self, up: ClippedUpload) -> ClippedSet | None:
        pub = up.public
        if pub is not None and pub.classes.size:
            local = up.local.classes.tolist() if up.local is not None else []
            check_split(dict.fromkeys(pub.classes.tolist()), dict.fromkeys(local), self.public_classes)
        return pub

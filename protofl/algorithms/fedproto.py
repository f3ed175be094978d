"""FedProto (Tan et al., AAAI 2022): class prototypes instead of parameters.

Client half, the local prototype of class c on client k (FedProto; TinyProto paper 002, eq. 3):

    p_kc = (1 / n_kc) * sum_{(x, y) in D_kc} z(x),      n_kc = |D_kc|,

computed only for classes the client holds. Server half, one global prototype per class over the
clients N_c that sent c. Two forms (docs/algorithms.md, "Baselines"):

    weighted (the paper's):  g_c = sum_{k in N_c} n_kc p_kc / sum_{k in N_c} n_kc
    mean (PFLlib, TinyProto eq. 9):  g_c = (1 / |N_c|) sum_{k in N_c} p_kc

The weighted form needs n_kc on the wire, which reveals the client's label histogram; "mean" does
not. Inference (TinyProto eq. 12 / FedProto): the class of the nearest prototype in L2.

The accumulator keeps one (C, m) running sum and one (C,) running weight, never the uploads.
The public-set anchors and TinyProto's scaled aggregation reuse it. The technique below is FedProto's
server rule; its device rule (local means, the alignment objective) is edge_agent/techniques/fedproto.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protofl.algorithms.robust import CoordinateRobust, center_table, class_rows
from protofl.errors import WireError
from protofl.mergeable import Additive
from protofl.technique import (
    BatchedFold,
    Clip,
    ClippedSet,
    ClippedUpload,
    Fold,
    Part,
    Phase,
    PrototypeMean,
    RoundFields,
    RowMean,
    ServerRule,
    ServerState,
    Technique,
    Upload,
    stacked_rows,
)
from protofl.wire import ProtoSet

__all__ = ["PrototypeAggregator", "FedProto", "MeanPrototypes"]

_WEIGHTINGS = ("weighted", "mean")


def _class_id(c: object, num_classes: int, who: str) -> int:
    if isinstance(c, bool) or not isinstance(c, (int, np.integer)):
        raise ValueError(f"{who}: class id must be an integer, got {c!r}")
    if not 0 <= int(c) < num_classes:
        raise ValueError(f"{who}: class id {c} out of range [0, {num_classes})")
    return int(c)


def _count(n: object, c: int, who: str) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer, float, np.floating)):
        raise ValueError(f"{who}: sample count for class {c} must be an integer, got {n!r}")
    if not math.isfinite(float(n)) or float(n) != int(n) or int(n) <= 0:
        raise ValueError(f"{who}: sample count for class {c} must be a positive integer, got {n!r}")
    return int(n)


class PrototypeAggregator(Additive):
    """Streaming per-class (weighted) mean of prototypes, FedProto's server step."""

    additive = ("_sum", "_weight", "_senders")  # mergeable across aggregator shards

    def __init__(self, num_classes: int, dim: int, weighting: str = "weighted") -> None:
        if int(num_classes) < 1 or int(dim) < 1:
            raise ValueError(f"prototype aggregator: need num_classes >= 1 and dim >= 1, got {num_classes}, {dim}")
        if weighting not in _WEIGHTINGS:
            raise ValueError(f"prototype aggregator: weighting must be one of {_WEIGHTINGS}, got {weighting!r}")
        self.num_classes = int(num_classes)
        self.dim = int(dim)
        self.weighting = weighting
        self._sum = np.zeros((self.num_classes, self.dim), dtype=np.float64)
        self._weight = np.zeros(self.num_classes, dtype=np.float64)
        self._senders = 0

    @property
    def senders(self) -> int:
        """How many uploads have been accepted (an upload with no classes still counts)."""
        return self._senders

    def add(self, protos: Mapping[int, np.ndarray], counts: Mapping[int, int] | None = None) -> None:
        """Fold in one client's table; `counts` (n_kc per class) is required when weighting="weighted".

        All of the upload is checked before any of it is applied, so a rejected upload leaves the
        aggregate unchanged.
        """
        self._apply(self._prepare(protos, counts))

    def check_rows(self, classes: np.ndarray, shape: tuple[int, ...], counts: np.ndarray | None) -> None:
        """Raise ValueError if this aggregator cannot take one upload's rows of this shape (row i of class
        `classes[i]`, from `counts[i]` samples), as a decoded `ProtoSet` gives them (classes unique and ascending,
        counts >= 1, values finite: the decoder checked those): its classes, its width, counts when weighted."""
        who = "prototype aggregator"
        k = classes.shape[0]
        if shape != (k, self.dim):
            raise ValueError(f"{who}: expected rows of shape ({k}, {self.dim}), got {shape}")
        if k and not 0 <= int(classes[0]) <= int(classes[-1]) < self.num_classes:  # ascending: ends are min, max
            raise ValueError(f"{who}: class ids must lie in [0, {self.num_classes})")
        if self.weighting == "weighted" and counts is None:
            raise ValueError(f"{who}: weighting='weighted' needs the per-class sample counts n_kc")

    def add_many(self, classes: list[np.ndarray], rows: np.ndarray, counts: np.ndarray | None, uploads: int) -> None:
        """`add` for several uploads as rows that `check_rows` passed: `classes` one array per upload with rows, in
        arrival order, `rows` and `counts` theirs concatenated in that order, `uploads` the senders (uploads with
        no rows included). The weights multiply all rows in one pass; each upload's rows are then added at once
        (a view where its classes are consecutive): the sums `add` makes upload by upload, bit for bit."""
        weighted = self.weighting == "weighted"
        assert counts is not None or not weighted or not classes
        w = counts.astype(np.float64) if weighted and counts is not None else None
        terms = w[:, None] * rows if w is not None else rows
        at = 0
        for c in classes:
            k = c.shape[0]
            where = class_rows(c)
            self._sum[where] += terms[at : at + k]
            self._weight[where] += w[at : at + k] if w is not None else 1.0
            at += k
        self._senders += uploads

    def check(self, protos: Mapping[int, np.ndarray], counts: Mapping[int, int] | None = None) -> None:
        """Raise ValueError if `add` would reject this table; changes nothing."""
        self._prepare(protos, counts)

    def result(self) -> dict[int, np.ndarray]:
        """Global prototypes as float32, only for the classes at least one client sent."""
        sent = np.flatnonzero(self._weight > 0)
        return {int(c): (self._sum[c] / self._weight[c]).astype(np.float32) for c in sent}

    # Split in two so that ErpaAggregator can check two tables before touching either aggregator.
    def _prepare(
        self, protos: Mapping[int, np.ndarray], counts: Mapping[int, int] | None
    ) -> list[tuple[int, np.ndarray, float]]:
        who = "prototype aggregator"
        if self.weighting == "weighted" and counts is None:
            raise ValueError(f"{who}: weighting='weighted' needs the per-class sample counts n_kc")
        rows = []
        for c, p in protos.items():
            c = _class_id(c, self.num_classes, who)
            v = np.asarray(p)
            if v.shape != (self.dim,):
                raise ValueError(f"{who}: prototype for class {c}: expected shape ({self.dim},), got {v.shape}")
            v = v.astype(np.float64, copy=False)
            if not np.isfinite(v).all():
                raise ValueError(f"{who}: prototype for class {c} contains NaN or inf; drop this upload")
            if self.weighting == "weighted":
                assert counts is not None
                if c not in counts:
                    raise ValueError(f"{who}: class {c} has a prototype but no sample count")
                w = float(_count(counts[c], c, who))
            else:
                w = 1.0
            rows.append((c, v, w))
        return rows

    def _apply(self, rows: list[tuple[int, np.ndarray, float]]) -> None:
        for c, v, w in rows:
            self._sum[c] += w * v
            self._weight[c] += w
        self._senders += 1


# -- the technique ------------------------------------------------------------------------------------
class FedProto(Technique):
    """Mean prototypes: clients send per-class means, the server averages them into next round's targets."""

    name = "fedproto"
    order = 20

    def active(self, cfg: Any) -> bool:
        return bool(cfg.prototypes == "mean")

    def server_rule(self, model: ServerState) -> ServerRule:
        return FedProtoRule(model)


@dataclass
class MeanPrototypes:
    """FedProto's server state: the global prototype of every class somebody sent, in wire space (class -> row),
    which the next training round carries as its targets."""

    prototypes: dict[int, np.ndarray] = field(default_factory=dict)


class FedProtoRule(ServerRule):
    fills = frozenset({"targets"})

    def __init__(self, model: ServerState) -> None:
        super().__init__(model)
        self.state = MeanPrototypes()

    def _in_training(self) -> bool:
        return Upload.PROTOS in self.model.plan.sends(Phase.TRAIN)

    def uploads(self) -> Mapping[Phase, tuple[Upload, ...]]:
        return {Phase.TRAIN: (Upload.PROTOS,)} if self._in_training() else {}

    def folds(self, phase: Phase) -> list[Fold]:
        return [MeanFold(self.model, self.state)] if phase is Phase.TRAIN and self._in_training() else []

    def round_fields(self, phase: Phase) -> RoundFields | None:
        plan, protos = self.model.plan, self.state.prototypes
        if phase is not Phase.TRAIN or not self._in_training() or not protos:
            return None
        return RoundFields(targets=ProtoSet.from_table(protos, plan.proto_width, plan.proto_dtype))


class MeanFold(BatchedFold):
    """The training phase's mean prototypes: n-weighted (or another technique's aggregate), of uploads clipped
    around the current global prototypes; `--robust` replaces the plain mean by a coordinate-wise one. Uploads
    are folded a batch at a time (BatchedFold), with the sums of folding them one by one."""

    kinds = (Upload.PROTOS,)
    merged = ("acc", "robust")

    def __init__(self, model: ServerState, state: MeanPrototypes) -> None:
        super().__init__()
        self.model, self.state = model, state
        plan = model.plan
        other = model.rules.mean_aggregator(plan.proto_width)
        self.default = other is None
        self.acc: PrototypeMean = (
            other
            if other is not None
            else PrototypeAggregator(plan.num_classes, plan.proto_width, weighting=model.cfg.aggregation)
        )
        # Robust means replace plain means only: scaled sums have their own geometry.
        self.robust: dict[int, CoordinateRobust] | None = (
            {} if self.default and model.robust_mean(plan.proto_width) is not None else None
        )
        # Another technique's aggregate that takes tables only is fed one upload at a time, when it arrives (its
        # `add` may refuse one, which a batch folded later could not do).
        self.by_rows: RowMean | None = self.acc if isinstance(self.acc, RowMean) else None
        self.rows_ok = self.by_rows is not None
        self.weighted = self.default and model.cfg.aggregation == "weighted"  # the n_kc-weighted mean: needs counts
        # Uploads are clipped around the global prototypes, which change only when the phase ends.
        self.clip = {Part.LOCAL: Clip("protos", center_table(state.prototypes, plan.num_classes, plan.proto_width))}
        self._none = np.zeros(0, np.int64)

    def check(self, up: ClippedUpload) -> Any:
        ps = up.local
        classes, shape, counts = (
            (self._none, (0, self.model.plan.proto_width), None) if ps is None else (ps.classes, ps.shape, ps.counts)
        )
        if self.weighted and classes.size and counts is None:
            raise WireError("prototypes without counts (weighted aggregation needs n_kc)")
        if self.by_rows is not None:
            self.by_rows.check_rows(classes, shape, counts if self.default else None)
        return ps

    def fold(self, prepared: Any) -> None:
        if self.rows_ok:
            super().fold(prepared)
        else:
            self.fold_batch([prepared])

    def elements(self, prepared: Any) -> int:
        return 0 if prepared is None else prepared.shape[0] * prepared.shape[1]

    def fold_batch(self, batch: list[Any]) -> None:
        sent: list[ClippedSet] = [p for p in batch if p is not None and p.classes.size]
        classes = [p.classes for p in sent]
        rows = stacked_rows(sent) if sent else np.zeros((0, self.model.plan.proto_width))
        if self.by_rows is not None:
            counts = np.concatenate([p.counts for p in sent]) if self.weighted and sent else None
            self.by_rows.add_many(classes, rows, counts, len(batch))
        else:  # a table-taking aggregate (a batch of one upload; one with no rows still counts)
            self.acc.add(dict(zip(classes[0].tolist(), rows, strict=True)) if sent else {})
        if self.robust is not None and sent:
            every = np.concatenate(classes)
            for c, v in zip(every.tolist(), rows, strict=True):
                acc = self.robust.get(c)
                if acc is None:
                    acc = self.robust[c] = self._robust_mean()
                acc.add(v)

    def _robust_mean(self) -> CoordinateRobust:
        out = self.model.robust_mean(self.model.plan.proto_width)
        assert out is not None
        return out

    def new_accumulator(self, name: str, key: Any) -> Any:
        """A class another shard has a robust mean for and this one has not."""
        if name != "robust" or not isinstance(key, int) or not 0 <= key < self.model.plan.num_classes:
            return super().new_accumulator(name, key)
        return self._robust_mean()

    def finish(self) -> None:
        model = self.model
        result = self.acc.result()
        if self.robust is not None:
            zero = np.zeros(model.plan.proto_width)
            result = {c: acc.result(zero).astype(np.float32) for c, acc in self.robust.items()}
        if result:
            # FedProto keeps a class's old prototype if nobody sent it this round.
            self.state.prototypes = {**self.state.prototypes, **result}

"""A federation's server model and its open phase, composed from the active techniques' rules (numpy only).

`build_model` makes the `ServerModel` (the rules see it as protofl.technique.ServerState) and the rule
of every active technique, in rule order (each keeping its own state), checks that they fold what the plan
asks for, and lets each set up its round-0 state. `PhaseRun` is one open phase: the folds the rules
contribute for it. An upload is checked once against the round plan here (class ids, widths, lengths,
whether this phase takes it), then by every fold that reads its kind, and only then folded into any of
them: an upload that raises leaves everything as it was (the I/O shell counts it as a drop). Folds stream:
they never hold the uploads.

Bounded uploads (protofl/algorithms/robust.py): every prototype and parameter value is clipped to a ball
around the current global value before any fold sees it, with a radius derived from the previous round's
accepted norms; `--robust median|trimmed` replaces plain means by coordinate-wise robust means. The phase
does the clipping, once per part of an upload (its local and public-set prototypes, its parameter vector),
around the centres the folds declare (`protofl.technique.Clip`; around zero where none does), records the
norms, and hands every fold the clipped values (`ClippedUpload`): a fold cannot forget to clip. Prototype
rows are clipped a batch of uploads at a time in one pass (issue 27), bit for bit as one by one.
`--clip off` (ClipPolicy.enabled False) folds uploads unclipped and counts nothing. The rows checked and
clipped are counted per round (`ServerModel.round_clips`, reset when a round's first phase opens) and in
total (`clipped`); the first clip of a server's life logs one line that says what happened and how to
switch it off.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from broker_server.core.persist import NOT_STATE, state_fields
from protofl import registry
from protofl.algorithms.robust import ClipCount, ClipPolicy, CoordinateRobust, NormLog, class_rows, clip_rows
from protofl.config import FederationConfig
from protofl.errors import WireError
from protofl.plan import Phase, RoundPlan, Upload
from protofl.sparse import SparseVector
from protofl.technique import (
    DEFAULT_LOGS,
    PARTS,
    BatchedFold,
    Clip,
    ClippedSet,
    ClippedUpload,
    ClippedVector,
    Fold,
    Part,
    RoundFields,
    RuleChain,
)
from protofl.wire import ParamsUpload, ProtoSet, ProtoUpload

__all__ = ["PhaseRun", "ServerModel", "build_model", "check_upload"]

_NAMES = {Phase.PROTO: "prototype", Phase.TRAIN: "training", Phase.DONE: "final"}
_ROWS = {"protos": "prototype rows", "anchors": "anchor rows", "adapter": "parameter vectors"}
log = logging.getLogger("protofl.server")


@dataclass
class ServerModel:
    """What the active rules share (protofl.technique.ServerState): the config, the plan, the rules (each
    keeping its own state), and the clipping state with this phase's norm logs."""

    # What is not state (the config it was built from, the rules, this phase's logs) is marked NOT_STATE:
    # every other field is saved and restored by broker_server/core/persist.py without being listed again. The
    # rules' own states are saved beside it, per technique (broker_server/core/rounds.py, `snapshot`).
    cfg: FederationConfig = field(metadata=NOT_STATE)
    plan: RoundPlan = field(metadata=NOT_STATE)
    # The whole model's parameters the devices start from, where the server knows them (the simulator passes them).
    initial_params: np.ndarray | None = field(default=None, metadata=NOT_STATE)
    # The shared backbone the public message ships (the whole model vector; the ridge predictor's), where there is one.
    shared_backbone: np.ndarray | None = field(default=None, metadata=NOT_STATE)
    round: int = field(default=0, metadata=NOT_STATE)  # the round whose phase is open (the round machine's)
    policy: ClipPolicy = field(default_factory=ClipPolicy, metadata=NOT_STATE)
    # Clipping radius per kind of value ("protos", "anchors", "adapter"), from the last round's upload norms.
    radii: dict[str, float] = field(default_factory=dict)
    clipped: dict[str, int] = field(default_factory=dict)  # rows clipped so far, per kind
    round_clips: ClipCount = field(default_factory=ClipCount)  # rows checked and clipped in the current round
    explained: bool = False  # the one log line that says what clipping did has been written
    rules: RuleChain = field(default_factory=RuleChain, metadata=NOT_STATE)  # each with its own `state`
    logs: dict[str, NormLog] = field(default_factory=dict, metadata=NOT_STATE)  # this phase's norms, per kind

    def robust_mean(self, dim: int) -> CoordinateRobust | None:
        """A coordinate-wise robust mean of `dim` values replacing a plain mean, or None (plain means)."""
        p = self.policy
        return None if p.robust == "mean" else CoordinateRobust(dim, p.robust, p.trim)

    def log(self, kind: str) -> NormLog:
        return self.logs.setdefault(kind, NormLog())

    def close_logs(self) -> None:
        """At a phase's end: count what was clipped, then each kind's next radius from its accepted norms."""
        for kind, norms in self.logs.items():
            self.round_clips.add(kind, norms)
            self._explain_once(kind, norms)
            self.update_radius(kind, norms)
        self.logs = {}

    def new_round(self) -> None:
        """A round begins: its clip counts start at zero (read them at the round's end, before this)."""
        self.round_clips = ClipCount()

    def radius(self, kind: str) -> float:
        """This round's radius for `kind`: infinite with clipping off."""
        if not self.policy.enabled:
            return math.inf
        return self.radii.get(kind, self.policy.first_radius)

    def update_radius(self, kind: str, norms: NormLog) -> None:
        """After a round: the next radius from its accepted norms (kept if nothing was accepted)."""
        if norms.values:
            self.radii[kind] = self.policy.radius(norms.values)
        if norms.clipped:
            self.clipped[kind] = self.clipped.get(kind, 0) + norms.clipped

    def _explain_once(self, kind: str, norms: NormLog) -> None:
        """The first clip of this server's life: one line saying what was clipped, by which rule, how to stop it."""
        if self.explained or not norms.clipped:
            return
        self.explained = True
        log.warning(
            "clipping: %d of %d %s (%s) lay farther than %.4g from the current global value and were "
            "scaled back onto that ball (%s). Honest uploads can be clipped too; the count is in each "
            "round's line. --clip off folds uploads as sent.",
            norms.clipped,
            len(norms.values),
            _ROWS.get(kind, "rows"),
            kind,
            self.radius(kind),
            self.policy.rule(),
        )


def build_model(
    cfg: FederationConfig,
    plan: RoundPlan,
    policy: ClipPolicy | None = None,
    initial_params: np.ndarray | None = None,
    shared_backbone: np.ndarray | None = None,
) -> ServerModel:
    """The server model at round 0, with the active techniques' rules attached."""
    model = ServerModel(
        cfg, plan, initial_params=initial_params, shared_backbone=shared_backbone, policy=policy or ClipPolicy()
    )
    active = registry.active(cfg)
    model.rules = RuleChain([tech.server_rule(model) for tech in active], [tech.name for tech in active])
    for rule in model.rules:
        rule.init_model()
    check_rules(model)
    return model


def check_rules(model: ServerModel) -> None:
    """The rules agree with the plan and with each other: every upload the plan asks for in a phase is folded by
    some rule and no rule folds one it does not ask for (ServerRule.uploads), and no two rules' states have a
    field of one name (a checkpoint keeps them per technique, a tool reads them by name)."""
    plan, seen = model.plan, dict[str, str]()
    for phase in plan.phases:
        folded, sent = model.rules.uploads(phase), plan.sends(phase)
        if set(folded) != set(sent):
            raise ValueError(
                f"the {phase.value} phase: the plan asks for {[u.value for u in sent]}, the server "
                f"rules fold {[u.value for u in folded]} (techniques {', '.join(plan.techniques)})"
            )
    for name, rule in model.rules.named():
        for f in state_fields(type(rule.state)) if rule.state is not None else ():
            if f.name in seen:
                raise ValueError(f"the states of '{seen[f.name]}' and '{name}' both have '{f.name}'")
            seen[f.name] = name


def _check_protos(ps: ProtoSet | None, plan: RoundPlan, what: str) -> None:
    if ps is None:
        return
    width = ps.values.shape[1] if ps.values.ndim == 2 else 0
    # Classes are unique and ascending (the decoder checked): the last is the largest, and none is negative.
    if ps.classes.size and not 0 <= int(ps.classes[0]) <= int(ps.classes[-1]) < plan.num_classes:
        bad = ps.classes[(ps.classes < 0) | (ps.classes >= plan.num_classes)]
        raise WireError(f"{what}: class {int(bad[0])} out of range [0, {plan.num_classes})")
    if ps.classes.size and width != plan.proto_width:
        raise WireError(f"{what} for class {int(ps.classes[0])}: expected {plan.proto_width} values, got {width}")


def check_upload(plan: RoundPlan, phase: Phase, up: ProtoUpload | ParamsUpload) -> None:
    """The plan's checks of one upload: the one place they are written (the wire decoder already checked
    types, finiteness and sizes)."""
    if not isinstance(up, ProtoUpload):
        return  # a parameter upload: the decoder checked its vector; its length and weight are the folds' to check
    _check_protos(up.local, plan, "prototype")
    _check_protos(up.public, plan, "public prototype")
    if up.public is not None and up.public.classes.size and plan.public_phase is not phase:
        raise WireError(
            f"public-set prototypes in the {_NAMES[phase]} phase; this federation sends them "
            + (f"in the {_NAMES[plan.public_phase]} phase" if plan.public_phase else "not at all")
        )


# -- clipping: once per part of an upload, before any fold sees it ------------------------------------------
class _SetClips:
    """One prototype part (local or public-set) of the uploads a phase takes: every set clipped around one table
    of centres and its norms recorded in one log. Accepted sets wait for a batch (clipped in one pass: per-row
    kernels, so each row as it would be on its own), until a fold reads one, the batch is full, or the phase
    flushes; a set a fold reads in `check` (before it is accepted) is clipped alone. Norms are recorded once a
    set is accepted, a batch of sets at a time."""

    def __init__(self, model: ServerModel, clip: Clip | None) -> None:
        self.model = model
        plan = model.plan
        self.on = model.policy.enabled and clip is not None
        self.kind = clip.log if clip is not None else ""
        self.centers: np.ndarray | None = None
        if self.on:
            assert clip is not None
            shape = (plan.num_classes, plan.proto_width)
            centers = np.zeros(shape) if clip.centers is None else np.asarray(clip.centers, np.float64)
            if centers.shape != shape:
                raise ValueError(f"prototype centres of shape {centers.shape}; this federation's are {shape}")
            self.centers = centers
        self.empty = np.zeros((0, plan.proto_width))
        self.pending: list[ClippedSet] = []  # accepted, not clipped yet
        self.elements = 0
        self.batch, self.batch_elements = BatchedFold.BATCH, BatchedFold.BATCH_ELEMENTS  # (a batched fold's bounds)
        self.seen: list[tuple[np.ndarray, np.ndarray]] = []  # accepted sets clipped alone: norms not recorded yet

    def clip_set(self, s: ClippedSet) -> None:
        """`s.rows` was read before it was clipped: with its batch where it is accepted, else on its own."""
        if s._sent is None:  # nothing to clip: no rows
            s._rows = self.empty
        elif s._pending:
            self.run()
        else:
            s._rows, s._seen = self._clip(s._sent, s.classes)

    def accept(self, s: ClippedSet) -> None:
        """`s` passed every check: its norms are recorded (now, or with its batch)."""
        k = s.shape[0]
        if not k:
            s._sent, s._rows = None, self.empty
        elif s._rows is not None:  # clipped alone in a check: its norms are recorded with the next ones
            if s._seen is not None:
                self.seen.append(s._seen)
                if len(self.seen) >= self.batch:
                    self._record_seen()
            s._sent = s._seen = None
        else:
            s._pending = True
            self.pending.append(s)
            self.elements += k * s.shape[1]
            if len(self.pending) >= self.batch or self.elements >= self.batch_elements:
                self.run()

    def run(self) -> None:
        """Clip every pending set in one pass and record their norms (and those of the sets clipped alone)."""
        if self.seen:
            self._record_seen()
        if not self.pending:
            return
        batch, self.pending, self.elements = self.pending, [], 0
        if len(batch) == 1:
            values, classes = batch[0]._sent, batch[0].classes
        else:
            values, classes = np.concatenate([s._sent for s in batch]), np.concatenate([s.classes for s in batch])
        assert values is not None
        rows, seen = self._clip(values, classes)
        at = 0
        for s in batch:
            s._batch, s._start, s._sent, s._pending = rows, at, None, False
            at += s.shape[0]
        self._record(seen)

    def _clip(self, values: np.ndarray, classes: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
        if self.centers is None:  # --clip off, or a part declared unbounded: the rows as sent, in float64
            return values.astype(np.float64), None
        rows, dists, norms = clip_rows(values, self.centers[class_rows(classes)], self.model.radius(self.kind))
        return rows, (norms, dists)

    def _record_seen(self) -> None:
        seen, self.seen = self.seen, []
        self._record(
            seen[0] if len(seen) == 1 else (np.concatenate([n for n, _ in seen]), np.concatenate([d for _, d in seen]))
        )

    def _record(self, seen: tuple[np.ndarray, np.ndarray] | None) -> None:
        if seen is not None and seen[0].shape[0]:
            self.model.log(self.kind).record_rows(seen[0], seen[1], self.model.radius(self.kind))


class _VectorClips:
    """The parameter vectors of the uploads a phase takes: each clipped around one reference vector (a sparse
    upload around the reference's values at its positions) when it is accepted, its norm recorded."""

    def __init__(self, model: ServerModel, clip: Clip | None) -> None:
        self.model = model
        self.on = model.policy.enabled and clip is not None and clip.centers is not None
        self.kind = clip.log if clip is not None else ""
        self.reference = clip.centers if self.on and clip is not None else None
        self._ref64: np.ndarray | None = None  # the reference in float64, once a phase (90 MB for a resnet18)

    def clip_vector(self, v: ClippedVector) -> None:
        sent = v._sent
        assert sent is not None
        if self.reference is None:  # --clip off, or no reference to clip around: as sent
            v._vector = sent
            return
        if v.n != self.reference.shape[0]:
            raise WireError(f"adapter of length {v.n}, expected {self.reference.shape[0]}")
        if self._ref64 is None:
            self._ref64 = np.asarray(self.reference, np.float64)
        radius = self.model.radius(self.kind)
        # protofl.algorithms.robust.clip_around, keeping the float64 values as sent for the norm log (one pass
        # over the K values fewer than converting them again, issue 27)
        sparse = isinstance(sent, SparseVector)
        center = self._ref64[sent.indices] if isinstance(sent, SparseVector) else self._ref64
        u64 = np.asarray(sent.values if isinstance(sent, SparseVector) else sent, np.float64)
        d = u64 - center
        dist = float(np.sqrt(np.dot(d, d)))
        vals = u64 if dist <= radius else center + d * (radius / dist)
        v._vector = SparseVector(sent.n, sent.indices, vals) if sparse else vals  # type: ignore[union-attr]
        v._seen = (u64, dist)

    def accept(self, v: ClippedVector) -> None:
        """`v` passed every check: clipped if no fold read it yet (a length other than the reference's refuses
        the upload here, before anything is folded), and its norm recorded."""
        if v._vector is None:
            self.clip_vector(v)
        if v._seen is not None:
            u64, dist = v._seen
            self.model.log(self.kind).record(u64, dist, self.model.radius(self.kind))
            v._seen = None
        v._sent = None


class _UploadClips:
    """The clipping of one upload kind in one phase: per part, the `Clip` its folds declare (one per part: two
    folds that declare different ones are a technique combination that cannot run), or around zero."""

    def __init__(self, model: ServerModel, kind: Upload, takers: Sequence[Fold]) -> None:
        self.kind = kind
        specs: dict[Part, Clip | None] = {}
        for part in PARTS[kind]:
            declared = [(f, f.clip[part]) for f in takers if part in f.clip]
            spec = declared[0][1] if declared else Clip(DEFAULT_LOGS[part])
            for f, other in declared[1:]:
                if not (spec is other or (spec is not None and spec.same(other))):
                    raise ValueError(
                        f"{type(declared[0][0]).__name__} and {type(f).__name__} clip the {part.value} "
                        f"values of {kind.value} uploads differently; one clip per part of an upload"
                    )
            if spec is not None and spec.log not in _ROWS:
                raise ValueError(f"norm log '{spec.log}' is not one of {sorted(_ROWS)}")
            specs[part] = spec
        self.sets = kind is Upload.PROTOS
        self.local = _SetClips(model, specs.get(Part.LOCAL))
        self.public = _SetClips(model, specs.get(Part.PUBLIC))
        self.update = _VectorClips(model, specs.get(Part.UPDATE))

    def view(self, up: Any, sender: str = "") -> ClippedUpload:
        if self.sets:
            local, public = up.local, up.public
            return ClippedUpload(
                self.kind,
                up.n_samples,
                None if local is None else ClippedSet(local.classes, local.counts, local.values, self.local),
                None if public is None else ClippedSet(public.classes, public.counts, public.values, self.public),
                sender=sender,
            )
        return ClippedUpload(
            self.kind, up.n_samples, None, None, ClippedVector(up.update, self.update), up.base_round, sender
        )

    def weighted_view(self, up: Any, sender: str, weight: float) -> ClippedUpload:
        """`view`, counting `weight` times: its sample count and per-class counts times `weight`, or, for a set that
        travels without counts, its rows (broker_server/core/buffered.py states the rule)."""
        view = self.view(up, sender)
        view.n_samples = up.n_samples * weight
        view.weight = weight
        for s in (view.local, view.public):
            if s is None:
                continue
            if s.counts is not None:
                s.counts = s.counts * weight
            else:
                s._sent = np.asarray(s._sent, np.float64) * weight
        return view

    def accept(self, view: ClippedUpload) -> None:
        # A prototype upload's sets never refuse here; a parameter upload has its one vector, which may.
        local, public, update = view.local, view.public, view.update
        if local is not None:
            self.local.accept(local)
        if public is not None:
            self.public.accept(public)
        if update is not None:
            self.update.accept(update)

    def flush(self) -> None:
        self.local.run()
        self.public.run()


class PhaseRun:
    """One open phase: every active rule's folds for it, fed each accepted upload."""

    def __init__(self, model: ServerModel, phase: Phase) -> None:
        self.model = model
        self.phase = phase
        model.logs = {}
        if phase is model.plan.first_phase:
            model.new_round()
        self.folds: list[Fold] = [f for rule in model.rules for f in rule.folds(phase)]
        self.takers = {k: [f for f in self.folds if k in f.kinds] for k in Upload}  # per kind, in rule order
        self.clips = {k: _UploadClips(model, k, takers) for k, takers in self.takers.items() if takers}

    def add(self, kind: Upload, up: Any, sender: str = "", weight: float = 1.0) -> None:
        """Check `up` (from client `sender`) against the plan and every fold that reads `kind`, then clip it (once:
        `Clip`) and fold it into all of them. `weight`: what it counts beside a synchronous round's upload (an
        asynchronous round's older upload: broker_server/core/buffered.py)."""
        check_upload(self.model.plan, self.phase, up)
        takers = self.takers[kind]
        if not takers:
            raise WireError(f"this federation does not exchange {kind.value} uploads in the {self.phase.value} phase")
        clips = self.clips[kind]
        view = clips.view(up, sender) if weight == 1.0 else clips.weighted_view(up, sender, weight)
        if len(takers) == 1:  # (most phases: one fold per kind)
            fold = takers[0]
            p = fold.check(view)
            clips.accept(view)
            fold.fold(p)
            return
        prepared = [(f, f.check(view)) for f in takers]
        clips.accept(view)
        for fold, p in prepared:
            fold.fold(p)

    def flush(self) -> None:
        """Fold every upload a fold has kept back for its next batch, and clip and record every accepted upload:
        before anything reads the sums or logs."""
        for fold in self.folds:
            fold.flush()
        for clips in self.clips.values():
            clips.flush()

    def finish(self) -> None:
        """Fold the phase into the server model (coordinates and classes nobody sent keep their value)."""
        self.flush()
        self.model.close_logs()
        for fold in self.folds:
            fold.finish()

    def round_fields(self) -> RoundFields:
        """What the round message that opens this phase carries from the rules."""
        return self.model.rules.round_fields(self.phase)

    # -- sharded aggregators: a shard's partial phase, merged by the coordinator (protofl/mergeable.py) ----
    def partial(self) -> dict[str, Any]:
        """What this shard folded in the phase: every fold's accumulators and the norm logs (for the clip
        counts and the next radius), as plain values and arrays."""
        self.flush()
        logs = {
            kind: {"values": np.asarray(n.values, np.float64), "clipped": int(n.clipped)}
            for kind, n in self.model.logs.items()
        }
        return {"folds": [f.partial() for f in self.folds], "logs": logs}

    def merge(self, part: Mapping[str, Any]) -> None:
        """Add one shard's `partial()` of this same phase; a malformed one raises ValueError and changes nothing."""
        self.check_partial(part)
        self.flush()
        for fold, theirs in zip(self.folds, part["folds"], strict=True):
            fold.merge(theirs)
        for kind, entry in part["logs"].items():
            norms = self.model.log(kind)
            norms.values.extend(float(v) for v in entry["values"])
            norms.clipped += entry["clipped"]

    def check_partial(self, part: Mapping[str, Any]) -> None:
        """Raise ValueError if `merge` would refuse this shard's partial (its shapes, finiteness, structure)."""
        folds, logs = (part.get("folds"), part.get("logs")) if isinstance(part, Mapping) else (None, None)
        if not isinstance(folds, list) or len(folds) != len(self.folds) or not isinstance(logs, Mapping):
            raise ValueError(f"a shard's partial phase must have {len(self.folds)} folds and the norm logs")
        for kind, entry in logs.items():
            entry = entry if isinstance(entry, Mapping) else {}
            values, clipped = entry.get("values"), entry.get("clipped")
            if (
                kind not in _ROWS
                or not isinstance(values, np.ndarray)
                or values.ndim != 1
                or not np.isfinite(values).all()
                or not isinstance(clipped, int)
                or not 0 <= clipped <= values.size
            ):
                raise ValueError(f"a shard's norm log '{kind}' is malformed")
        for fold, theirs in zip(self.folds, folds, strict=True):
            fold.merge(theirs, check=True)


def check_mergeable(cfg: FederationConfig, policy: ClipPolicy | None = None) -> None:
    """Raise NotMergeable (with the reason) if some phase of this federation has a fold whose accumulators
    cannot be split between aggregator shards; checked on a model of its own, before anything runs."""
    plan = RoundPlan.from_config(cfg)
    model = build_model(cfg, plan, policy)
    for phase in plan.phases:
        for fold in PhaseRun(model, phase).folds:
            fold.partial()

"""The technique contract: what a prototype technique is to the framework (numpy only).

A technique is one name with two halves (docs/design.md, "Techniques"):

- this side, `Technique`: the config options it declares, the combination rules it enforces, what it
  adds to the round plan (`shape`) and its server rule (`server_rule`), which joins the phases it takes
  part in with a `Fold` per phase: check an upload, fold it in, finish the phase into the rule's `state`;
- the device side (torch), `edge_agent.techniques.DeviceRule`, registered under the same name.

Both halves register through Python entry points (`protofl.techniques` and `protofl.device_rules`), the
built-in techniques too, so a third-party technique is installed, not merged. The round machine, the I/O
shell, the agent and the trainer name no technique; they call the hooks below on the active rules in
order (on the server through a `RuleChain`, typed). Each server rule keeps its own state; rules talk to each
other only through these hooks (what one offers the others: support masks, unit prototypes, a replacement
aggregate) and the round plan.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from protofl.mergeable import NotMergeable, merge_into, partial_of
from protofl.sparse import SparseVector
from protofl.wire import ModelUpdate, ProtoSet

if TYPE_CHECKING:
    from protofl.adapter import Layout
    from protofl.algorithms.robust import CoordinateRobust
    from protofl.config import FederationConfig
    from protofl.plan import RoundPlan


R = TypeVar("R")
A = TypeVar("A")


class Phase(str, enum.Enum):
    """A round's phases, as they travel in the envelope's `phase` field."""

    PROTO = "proto"  # a first phase of prototypes whose aggregate is the training phase's targets
    TRAIN = "train"  # local training -> parameter and/or prototype uploads
    DONE = "done"  # the federation is over (final round message)


class Upload(str, enum.Enum):
    """What a client sends in a phase, as the envelope's `kind`."""

    PROTOS = "protos"
    ADAPTER = "adapter"  # a parameter vector: the federated adapter, or the whole model


@dataclass(frozen=True)
class Option:
    """A config option a technique declares: its default, and a check of one value (a problem or None).
    `only_when_set`: an option added after devices and reports were in use travels (and appears in
    `FederationConfig.to_dict`) only when set away from its default, so a federation that leaves it alone sends the
    config bytes it sent before, and a device of an earlier version, which refuses options it does not know, still
    joins it (as the core fields of protofl/config.py `_ONLY_WHEN_SET`)."""

    default: Any
    check: Callable[[Any], str | None] | None = None
    only_when_set: bool = False


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool): what numeric options and config fields accept."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def first_answer(rules: Sequence[R], ask: Callable[[R], A | None]) -> A | None:
    """The first rule's non-None answer to `ask` (a typed call of one hook, e.g. `lambda r: r.vector(ctx)`), or
    None: how the device asks its rules a hook that one rule owns (the server's are a typed `RuleChain`)."""
    for rule in rules:
        out = ask(rule)
        if out is not None:
            return out
    return None


def flag(name: str) -> Option:
    """A true/false switch option, off by default."""
    return Option(False, lambda v: None if isinstance(v, bool) else f"config '{name}' must be true or false, got {v!r}")


def integer(name: str, default: int | None, low: int = 0, what: str = "") -> Option:
    """An integer option >= `low` (None allowed when it is the default)."""

    def check(v: Any) -> str | None:
        if v is None and default is None:
            return None
        if not isinstance(v, int) or isinstance(v, bool):
            return f"config '{name}' must be an integer, got {v!r}"
        return None if v >= low else (what or f"{name} must be >= {low}, got {v}")

    return Option(default, check)


def number(name: str, default: float, positive: bool = False) -> Option:
    """A finite number option (> 0 when `positive`)."""

    def check(v: Any) -> str | None:
        if not is_number(v):
            return f"config '{name}' must be a finite number, got {v!r}"
        return f"{name} must be > 0" if positive and v <= 0 else None

    return Option(default, check)


@dataclass
class PlanDraft:
    """The round plan while the active techniques shape it (protofl.plan.RoundPlan is the finished one)."""

    num_classes: int
    proto_dim: int
    federate: str
    prototypes: str
    proto_dtype: str
    adapter_dtype: str
    phases: tuple[Phase, ...] = (Phase.TRAIN,)
    uploads: dict[Phase, tuple[Upload, ...]] = field(default_factory=dict)
    target_label: list[str] = field(default_factory=lambda: ["dense"])
    proto_width: int = 0
    masked: bool = False  # prototypes travel as the values on their class's support mask
    public_classes: tuple[int, ...] = ()
    public_phase: Phase | None = None  # the phase whose prototype upload carries public-set prototypes
    shared_backbone: bool = False  # the public message ships the federation's shared backbone to every device


class Technique:
    """One technique's framework half. Subclasses set `name`, `order`, `options` (and `presets`), and
    override what they use; every hook has a do-nothing default."""

    name: str = ""
    order: int = 50  # plan shaping and server hooks run in ascending order
    options: Mapping[str, Option] = {}
    presets: Mapping[str, Mapping[str, Any]] = {}  # preset name -> config values (a preset is data)
    # Devices need nothing of it (a server optimiser, a robust fold): no device rule, and its `shape` adds nothing a
    # device reads. The config message says so, and a device without the technique installed still joins.
    device_free: bool = False

    def active(self, cfg: FederationConfig) -> bool:
        """Whether this federation runs the technique (default: its switch option, named as itself)."""
        return bool(cfg.options.get(self.name, False))

    def check(self, cfg: FederationConfig) -> None:
        """Its options' combination rules: raise ConfigError with what to change (called for the federations
        that use it; the options of the techniques a federation leaves off are their defaults there)."""

    def shape(self, draft: PlanDraft, cfg: FederationConfig) -> None:
        """Add this technique's phases, uploads, widths and labels to the plan."""

    def server_rule(self, model: ServerState) -> ServerRule:
        return ServerRule(model)


class Part(str, enum.Enum):
    """The values of an upload that are bounded each on its own: a prototype upload's own prototypes and its
    public-set ones, a parameter upload's vector."""

    LOCAL = "local"
    PUBLIC = "public"
    UPDATE = "update"


PARTS: Mapping[Upload, tuple[Part, ...]] = {Upload.PROTOS: (Part.LOCAL, Part.PUBLIC), Upload.ADAPTER: (Part.UPDATE,)}
# The norm log (and so the radius) of a part whose folds declare no `Clip` for it: clipped around zero.
DEFAULT_LOGS: Mapping[Part, str] = {Part.LOCAL: "protos", Part.PUBLIC: "protos", Part.UPDATE: "adapter"}


@dataclass(frozen=True, eq=False)
class Clip:
    """What the values of one part of an upload are clipped around (protofl/algorithms/robust.py), and the
    norm log they count in: "protos", "anchors" or "adapter", one radius each, set from the norms it logged.

    `centers`: for a prototype set a (num_classes, width) float64 table whose row c is the centre of class c's
    rows (`robust.center_table`), for a parameter vector the (n,) vector it is clipped around; None: zero.
    A fold declares one per part it reads (`Fold.clip`) and the phase clips each upload's part once, before
    any fold's `check`, records its norms, and hands every fold the clipped values; folds never see the
    policy (radius, `--clip off`). A part no fold declares is clipped around zero into `DEFAULT_LOGS`; a
    part declared None is folded as sent (say why where it is declared)."""

    log: str
    centers: np.ndarray | None = None

    def same(self, other: Clip | None) -> bool:
        """Whether two folds' declarations for one part agree (the same log and centres)."""
        if other is None or other.log != self.log:
            return False
        a, b = self.centers, other.centers
        return a is b or (a is not None and b is not None and a.shape == b.shape and bool(np.array_equal(a, b)))


class _SetClipper(Protocol):
    def clip_set(self, s: ClippedSet) -> None: ...


class _VectorClipper(Protocol):
    def clip_vector(self, v: ClippedVector) -> None: ...


class ClippedSet:
    """One prototype set of an upload as the folds see it: `classes` (unique, ascending, in range: the plan
    checked them), `counts` (one per row, or None), the `shape` (k, width) it was sent with, and `rows`, its
    values clipped by the phase (float64, k x width; read-only).

    The phase clips a batch of accepted uploads' rows in one pass, when a fold first reads one of them (or the
    batch is full, or the phase ends); a fold's `check` that reads `rows` has that upload's set clipped alone."""

    __slots__ = ("classes", "counts", "shape", "_sent", "_rows", "_batch", "_start", "_clipper", "_seen", "_pending")
    _sent: np.ndarray | None  # the values as sent, until they are clipped

    def __init__(self, classes: np.ndarray, counts: np.ndarray | None, sent: np.ndarray, clipper: _SetClipper) -> None:
        self.classes, self.counts, self.shape, self._sent, self._clipper = classes, counts, sent.shape, sent, clipper
        # Clipped: `_rows` (alone), or rows `_start`... of `_batch` (the rows of the batch it was clipped in).
        self._rows: np.ndarray | None = None
        self._batch: np.ndarray | None = None
        self._start = 0
        self._seen: Any = None  # clipped alone before it was accepted: what the phase records when it is
        self._pending = False  # accepted, waiting for its batch to be clipped

    @property
    def rows(self) -> np.ndarray:
        rows = self._rows
        if rows is None:
            if self._batch is None:
                self._clipper.clip_set(self)
                if self._rows is not None:
                    return self._rows
            assert self._batch is not None
            rows = self._rows = self._batch[self._start : self._start + self.shape[0]]
        return rows

    def table(self) -> tuple[dict[int, np.ndarray], dict[int, int] | None]:
        """({class: clipped row}, {class: count} or None)."""
        rows, classes = self.rows, self.classes.tolist()
        table = {c: rows[i] for i, c in enumerate(classes)}
        return table, None if self.counts is None else dict(zip(classes, self.counts.tolist(), strict=True))


def stacked_rows(sets: Sequence[ClippedSet]) -> np.ndarray:
    """The clipped rows of `sets` one after the other (k1 + k2 + ..., width): the rows of the batch they were
    clipped in, without a copy, where they lie in it in this order (a batched fold's batch), else a copy."""
    first = sets[0]
    if first._batch is None and first._rows is None:
        first._clipper.clip_set(first)  # (clips the batch it waits in)
    batch, at = first._batch, first._start
    if batch is not None:
        for s in sets:
            if s._batch is not batch or s._start != at:
                break
            at += s.shape[0]
        else:
            return batch[first._start : at]
    return np.concatenate([s.rows for s in sets])


class ClippedVector:
    """A parameter upload's vector as the folds see it: its dense length `n`, the positions sent (`indices`,
    sorted and unique; None for a dense vector), and `vector`: the update clipped by the phase (a SparseVector
    or a dense array; float64 where it was clipped, as sent where it was not)."""

    __slots__ = ("n", "indices", "_sent", "_vector", "_clipper", "_seen")

    def __init__(self, update: SparseVector | np.ndarray, clipper: _VectorClipper) -> None:
        self.n: int = update.n if isinstance(update, SparseVector) else int(update.shape[0])
        self.indices: np.ndarray | None = update.indices if isinstance(update, SparseVector) else None
        self._sent: SparseVector | np.ndarray | None = update
        self._vector: SparseVector | np.ndarray | None = None
        self._clipper = clipper
        self._seen: Any = None

    @property
    def vector(self) -> SparseVector | np.ndarray:
        if self._vector is None:
            self._clipper.clip_vector(self)
        assert self._vector is not None
        return self._vector


class ClippedUpload:
    """An upload as the folds see it (the phase builds it after the plan's checks): its `kind`, `n_samples`,
    `base_round`, its `sender`, and its parts, every value clipped: `local` and `public` (ClippedSet, or None where the
    upload has no such set) of a prototype upload, `update` (ClippedVector) of a parameter upload. `weight`: what it
    counts beside a synchronous round's upload (an asynchronous round's older upload counts less: its `n_samples`
    and counts are the sent ones times `weight`; broker_server/core/buffered.py)."""

    __slots__ = ("kind", "n_samples", "local", "public", "update", "base_round", "sender", "weight")

    def __init__(
        self,
        kind: Upload,
        n_samples: int,
        local: ClippedSet | None = None,
        public: ClippedSet | None = None,
        update: ClippedVector | None = None,
        base_round: int = 0,
        sender: str = "",
    ) -> None:
        self.kind, self.n_samples, self.local, self.public, self.update, self.base_round = (
            kind,
            n_samples,
            local,
            public,
            update,
            base_round,
        )
        self.sender = sender  # the client that sent it ("" where a caller does not say: tests, tools)
        self.weight = 1.0


class Fold:
    """One rule's part of one phase: reads some upload kinds, checks then folds each accepted upload.

    `check` is pure and raises WireError/ValueError for an upload it refuses; the phase calls every fold's
    `check` before any `fold`, so a refused upload changes nothing. Both see the upload as a `ClippedUpload`:
    its values already clipped, around the centres `clip` declares per part (`Clip`)."""

    kinds: tuple[Upload, ...] = ()
    clip: Mapping[Part, Clip | None] = {}

    def check(self, up: ClippedUpload) -> Any:
        return up

    def fold(self, prepared: Any) -> None:
        pass

    def flush(self) -> None:
        """Fold what `fold` has kept back (a `BatchedFold`'s pending uploads); the phase calls it before
        anything reads the accumulators or the norm logs (finish, partial, merge)."""

    def finish(self) -> None:
        """Fold the phase into the server model (called once, in rule order)."""

    # Sharded aggregators (protofl/mergeable.py): `merged` names the attributes holding this fold's
    # accumulators (each `Additive`, a dict of them, or None); a shard sends `partial()`, the coordinator
    # `merge`s every shard's into its own fold, then `finish`es. None: the fold says nothing, and a sharded
    # federation refuses it (a fold that reads no uploads, `kinds` empty, has nothing to merge).
    merged: tuple[str, ...] | None = None

    def partial(self) -> dict[str, Any]:
        """This fold's accumulators as another shard's coordinator adds them (plain values and arrays)."""
        if self.merged is None:
            if not self.kinds:
                return {}
            raise NotMergeable(
                f"{type(self).__module__}.{type(self).__name__} does not name its mergeable "
                f"accumulators (Fold.merged): it cannot run on sharded aggregators; run one aggregator"
            )
        return {name: partial_of(getattr(self, name), f"{type(self).__name__}.{name}") for name in self.merged}

    def merge(self, part: Mapping[str, Any], *, check: bool = False) -> None:
        """Add another shard's `partial()` of this fold; all of it is checked (ValueError) before anything
        changes. `check`: only check."""
        names = self.merged or ()
        if not isinstance(part, Mapping) or set(part) != set(names):
            got = sorted(part) if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(f"{type(self).__name__}: partial has {got}, expected {sorted(names)}")
        for only_check in (True,) if check else (True, False):
            for name in names:
                where = f"{type(self).__name__}.{name}"
                mine, theirs = getattr(self, name), part[name]
                if not isinstance(mine, dict):
                    merged = merge_into(mine, theirs, where, check=only_check)
                    if not only_check:
                        setattr(self, name, merged)
                    continue
                if not isinstance(theirs, Mapping):
                    raise ValueError(f"{where}: expected a map of accumulators, got {type(theirs).__name__}")
                for k, v in theirs.items():
                    acc = mine.get(k)
                    if acc is None:
                        acc = self.new_accumulator(name, k)
                        if not only_check:
                            mine[k] = acc
                    merge_into(acc, v, f"{where}[{k}]", check=only_check)

    def new_accumulator(self, name: str, key: Any) -> Any:
        """A fresh accumulator for `key` of the dict attribute `name`, which another shard has and this
        fold has not yet (merge); by default none may appear."""
        raise ValueError(f"{type(self).__name__}.{name}: partial has key {key!r}, which this fold does not have")


class BatchedFold(Fold):
    """A fold that folds its accepted uploads a batch at a time, where one numpy pass over many uploads' rows
    costs little more than one upload's (issue 27: clipping and folding were a third of an upload's time).

    `fold` keeps what `check` returned; `fold_batch` folds up to BATCH of them at once, in arrival order, and
    must make the same sums bit for bit as folding each in turn (per-row kernels, and `np.add.at`, which adds
    in index order). `check` refuses everything `fold_batch` could not fold: a batch is folded after its
    uploads were accepted and journaled, so nothing may refuse one of them then."""

    BATCH = 64  # uploads
    # ... or fewer, so that a batch's float64 rows stay in cache (256 KB): 64 uploads of 10 x 512 rows
    # clipped in one pass ran 1.6x slower than one by one, 64 of 10 x 51 rows 2x faster.
    BATCH_ELEMENTS = 32_768

    def __init__(self) -> None:
        self._pending: list[Any] = []
        self._elements = 0

    def fold(self, prepared: Any) -> None:
        self._pending.append(prepared)
        self._elements += self.elements(prepared)
        if len(self._pending) >= self.BATCH or self._elements >= self.BATCH_ELEMENTS:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            batch, self._pending, self._elements = self._pending, [], 0
            self.fold_batch(batch)

    def elements(self, prepared: Any) -> int:
        """How many values one checked upload brings to a batch (what BATCH_ELEMENTS bounds)."""
        return 0

    def fold_batch(self, batch: list[Any]) -> None:
        raise NotImplementedError


class PrototypeMean(Protocol):
    """An aggregate of prototype tables that replaces the n-weighted mean (`ServerRule.mean_aggregator`): fed
    one upload's table at a time ({class: row}, the rows clipped), read once at the phase's end."""

    def check(self, table: Mapping[int, np.ndarray]) -> None:
        """Raise ValueError if `add` would refuse this table; changes nothing."""

    def add(self, table: Mapping[int, np.ndarray]) -> None: ...

    def result(self) -> dict[int, np.ndarray]:
        """The aggregate per class that somebody sent (float32)."""


@runtime_checkable
class RowMean(PrototypeMean, Protocol):
    """A `PrototypeMean` that also takes a batch of uploads' rows in one pass (what a decoded ProtoSet gives:
    classes unique and ascending, rows (k, width)); a batched fold feeds it so."""

    def check_rows(self, classes: np.ndarray, shape: tuple[int, ...], counts: np.ndarray | None) -> None:
        """Raise ValueError if it cannot take one upload's rows of this shape; changes nothing."""

    def add_many(self, classes: list[np.ndarray], rows: np.ndarray, counts: np.ndarray | None, uploads: int) -> None:
        """Several uploads' rows (checked), concatenated in arrival order; `uploads` counts those without rows too."""


class VectorMean(Protocol):
    """An aggregate of parameter vectors that replaces the sample-weighted mean (`ServerRule.vector_aggregator`):
    fed one upload's vector (dense, or a SparseVector: the coordinates it sent) with its weight |D_k|."""

    @property
    def senders(self) -> int: ...

    def add(self, vector: SparseVector | np.ndarray, weight: float) -> None: ...

    def result(self) -> np.ndarray:
        """The new global vector (float32)."""


@dataclass(frozen=True)
class RoundFields:
    """What the round message opening a phase carries from the rules (None: nothing of that field): the targets
    (`target_label` is the plan's), the federated adapter, the whole model's parameters, a global predictor's head.
    A rule declares the fields it fills (`ServerRule.fills`); for each field the first rule in rule order that gives
    one wins."""

    targets: ProtoSet | None = None
    adapter: np.ndarray | None = None
    params: np.ndarray | None = None
    predictor: tuple[np.ndarray, np.ndarray] | None = None  # a global head (W, b): the final message's
    model: ModelUpdate | None = None  # the ridge predictor's global model g: its latest change (or all of it)


ROUND_FIELDS = ("targets", "adapter", "params", "predictor", "model")


class ServerRule:
    """A technique's server half for one federation: its own state, its folds, and hooks.

    - `state`: a dataclass instance holding what this rule keeps from phase to phase (its global prototypes,
      anchors, parameter vector), or None; its checkpoint form is derived from its fields
      (broker_server/core/persist.py: `field(metadata=NOT_STATE)` for what is not state) and saved under the
      technique's name, so a rule lists nothing to persist.
    - `uploads()`: the upload kinds its folds take in each phase (what it adds to the round plan; the server
      checks them against the plan), and `fills`: the round-message fields its `round_fields` fills.
    - Hooks one rule offers the others are typed methods; the phase and the other rules ask all the active
      rules at once through `ServerState.rules` (a `RuleChain`), in rule order."""

    state: Any = None
    fills: frozenset[str] = frozenset()

    def __init__(self, model: ServerState) -> None:
        self.model = model

    def init_model(self) -> None:
        """Round-0 state (initial prototypes, the initial adapter); every rule is built (and its offers answer)
        before any rule's `init_model` runs."""

    def uploads(self) -> Mapping[Phase, tuple[Upload, ...]]:
        """The upload kinds this rule's folds take in each phase (none by default)."""
        return {}

    def folds(self, phase: Phase) -> list[Fold]:
        """This rule's folds for a phase that is opening (none by default)."""
        return []

    def round_fields(self, phase: Phase) -> RoundFields | None:
        """What the round message opening `phase` (Phase.DONE: the final one) carries from this rule: only the
        fields it `fills`."""
        return None

    def stale(self, upload: object, round_: int) -> str | None:
        """Why an upload for the open round `round_` is stale to this rule (e.g. trained from another round's
        global value), or None. Asked before the upload is journaled: a stale upload is dropped, never applied."""
        return None

    # -- what one rule offers the others (the first rule with an answer wins) --------------------------------
    def support_masks(self) -> np.ndarray | None:
        """(C, m) bool per-class support masks that prototypes travel on (protofl/algorithms/support.py)."""
        return None

    def unit_prototypes(self) -> np.ndarray | None:
        """(C, m) unit prototypes on the sphere at full width (protofl/algorithms/unit.py), as agreed so far."""
        return None

    def adapter_layout(self) -> Layout | None:
        """The layout of the federated adapter that the config message announces (protofl/adapter.py)."""
        return None

    def mean_aggregator(self, width: int) -> PrototypeMean | None:
        """A replacement for the n-weighted mean of local prototypes `width` values wide (None: keep the
        default)."""
        return None

    def vector_aggregator(self, reference: np.ndarray) -> VectorMean | None:
        """A replacement for the sample-weighted mean of parameter vectors around the global `reference` (None:
        keep the default)."""
        return None

    def predictor_head(self) -> tuple[np.ndarray, np.ndarray] | None:
        """A global predictor's head on the federation's shared backbone (W (C, d), b (C,)), where this rule
        builds one (protofl/algorithms/ridge.py); None before it can."""
        return None

    def predictor_info(self) -> dict[str, Any]:
        """What `predictor_head` was made from, for the run's records (e.g. how many devices); {} by default."""
        return {}

    def predictor_backbone(self) -> np.ndarray | None:
        """The whole model vector the global head sits on, where this rule refreshes the shared backbone (the
        ridge predictor's route); None: the shared backbone as the public message shipped it."""
        return None

    # -- adjustments (every rule's, in rule order) -------------------------------------------------------------
    def adjust_targets(self, table: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """Rework a phase's freshly built target table (e.g. refinement); default unchanged."""
        return table

    def adjust_consensus(self, unit: np.ndarray) -> np.ndarray:
        """Rework the consensus of unit prototypes (C, m) before it is refined; default unchanged."""
        return unit


T = TypeVar("T")
S = TypeVar("S")


class RuleChain:
    """A federation's active server rules in rule order, under their techniques' names, asked as one
    (`ServerState.rules`): each hook of `ServerRule` with its rule-order semantics. An offer (`round_fields`
    field by field, `stale`, `support_masks`, `unit_prototypes`, `adapter_layout`, `mean_aggregator`,
    `vector_aggregator`, `predictor_head`, `predictor_info`, `predictor_backbone`) is the first rule's that makes
    one, None where none does; an adjustment (`adjust_targets`, `adjust_consensus`) passes the value through every
    rule in order."""

    def __init__(self, rules: Sequence[ServerRule] = (), names: Sequence[str] = ()) -> None:
        self.rules: tuple[ServerRule, ...] = tuple(rules)
        self.names: tuple[str, ...] = tuple(names) or tuple(type(r).__name__ for r in self.rules)
        if len(self.names) != len(self.rules):
            raise ValueError(f"{len(self.rules)} rules, {len(self.names)} names")
        for name, rule in zip(self.names, self.rules, strict=True):
            bad = sorted(set(rule.fills) - set(ROUND_FIELDS))
            if bad:
                raise ValueError(f"the server rule of '{name}' fills {bad}; a round message has {list(ROUND_FIELDS)}")
        # Asked for every upload: only the rules that say anything (none in a prototype federation).
        self._stale = tuple(r for r in self.rules if type(r).stale is not ServerRule.stale)

    def __iter__(self) -> Iterator[ServerRule]:
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def __getitem__(self, i: int) -> ServerRule:
        return self.rules[i]

    def named(self) -> Iterator[tuple[str, ServerRule]]:
        return zip(self.names, self.rules, strict=True)

    def state(self, kind: type[S]) -> S:
        """The state of the active rule whose state is a `kind` (tools and tests read a technique's state so)."""
        for rule in self.rules:
            if isinstance(rule.state, kind):
                return rule.state
        raise LookupError(f"no active rule keeps a {kind.__name__}; active: {', '.join(self.names)}")

    def state_values(self) -> dict[str, Any]:
        """Every active rule's state fields by name (no two rules' states share a name: `check_rules`)."""
        out: dict[str, Any] = {}
        for rule in self.rules:
            if rule.state is not None:
                out.update(
                    (f.name, getattr(rule.state, f.name))
                    for f in dataclasses.fields(rule.state)
                    if f.metadata.get("state", True)
                )
        return out

    def _first(self, offer: Callable[[ServerRule], T | None]) -> T | None:
        for rule in self.rules:
            out = offer(rule)
            if out is not None:
                return out
        return None

    def uploads(self, phase: Phase) -> tuple[Upload, ...]:
        """Every upload kind some rule's folds take in `phase`, in `Upload` order."""
        kinds = {k for rule in self.rules for k in rule.uploads().get(phase, ())}
        return tuple(k for k in Upload if k in kinds)

    def round_fields(self, phase: Phase) -> RoundFields:
        out: dict[str, Any] = {}
        for name, rule in self.named():
            fields = rule.round_fields(phase)
            if fields is None:
                continue
            for key in ROUND_FIELDS:
                value = getattr(fields, key)
                if value is None:
                    continue
                if key not in rule.fills:
                    raise ValueError(
                        f"the server rule of '{name}' filled the round message's '{key}', which it "
                        f"does not declare (ServerRule.fills)"
                    )
                out.setdefault(key, value)
        return RoundFields(**out)

    def round_targets(self, phase: Phase) -> ProtoSet | None:
        """The targets of the round message opening `phase`."""
        return self.round_fields(phase).targets

    def stale(self, upload: object, round_: int) -> str | None:
        for rule in self._stale:
            why = rule.stale(upload, round_)
            if why is not None:
                return why
        return None

    def support_masks(self) -> np.ndarray | None:
        return self._first(lambda rule: rule.support_masks())

    def adapter_layout(self) -> Layout | None:
        return self._first(lambda rule: rule.adapter_layout())

    def unit_prototypes(self) -> np.ndarray | None:
        return self._first(lambda rule: rule.unit_prototypes())

    def mean_aggregator(self, width: int) -> PrototypeMean | None:
        return self._first(lambda rule: rule.mean_aggregator(width))

    def vector_aggregator(self, reference: np.ndarray) -> VectorMean | None:
        return self._first(lambda rule: rule.vector_aggregator(reference))

    def predictor_head(self) -> tuple[np.ndarray, np.ndarray] | None:
        return self._first(lambda rule: rule.predictor_head())

    def predictor_info(self) -> dict[str, Any]:
        return self._first(lambda rule: rule.predictor_info() or None) or {}

    def predictor_backbone(self) -> np.ndarray | None:
        return self._first(lambda rule: rule.predictor_backbone())

    def adjust_targets(self, table: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        for rule in self.rules:
            table = rule.adjust_targets(table)
        return table

    def adjust_consensus(self, unit: np.ndarray) -> np.ndarray:
        for rule in self.rules:
            unit = rule.adjust_consensus(unit)
        return unit


class ServerState(Protocol):
    """What the active rules share (broker_server.core.stages.ServerModel): the config and the round plan, the
    rules themselves (`rules`: their state and offers: support masks, unit prototypes, replacement aggregates),
    and the robust-mean setting. What a technique keeps is its rule's own `state`, not this. Uploads reach the
    folds clipped (`Clip`, `ClippedUpload`): the clipping policy is the phase's, not the rules'."""

    cfg: FederationConfig
    plan: RoundPlan
    rules: RuleChain  # every active rule, in rule order: ask them as one (their hooks)
    initial_params: np.ndarray | None  # the whole model's parameters the devices start from, if the server knows
    shared_backbone: np.ndarray | None  # the shared backbone the public message ships (whole model vector), if any
    round: int  # the round whose phase is open (0 before the first)

    def robust_mean(self, dim: int) -> CoordinateRobust | None:
        """A coordinate-wise robust mean of `dim` values that replaces a plain mean (`--robust median|trimmed`),
        or None where means stay plain."""


def table_of(ps: ProtoSet | None) -> tuple[dict[int, np.ndarray], dict[int, int] | None]:
    """A prototype set as ({class: row}, counts or None); an absent set is empty."""
    return ({}, None) if ps is None else ps.table()

"""What a running federation looks like from outside: one immutable snapshot, and its JSON form.

The service thread builds a `Snapshot` from the aggregator after its steps (observer.py); everything
that shows a federation reads one: `protofl-server status`, the Prometheus endpoint, the live page,
`state_dir/status.json` and the retained `server/summary` topic. The JSON form is the monitor
protocol (docs/design.md, "Watching a federation"): an object with `"v": SUMMARY_VERSION`; a reader
refuses another major version instead of misreading it, and ignores keys it does not know, so fields
can be added without a version change. Times are epoch seconds of the server's clock. No numpy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from protofl.errors import ProtoFLError

SUMMARY_VERSION = 1
SUMMARY_KIND = "protofl.summary"
ACCURACY_KEYS = ("local_acc", "global_acc", "local_proto_acc", "global_proto_acc", "predictor_acc")
# Member states: connected; offline but keeping its place for its grace; offline past it; never seen.
ONLINE, OFFLINE, LEFT, NOT_JOINED = "online", "offline", "left", "not joined"
MEMBER_STATES = (ONLINE, OFFLINE, LEFT, NOT_JOINED)


class SummaryError(ProtoFLError, ValueError):
    """A summary document that is not one this build reads."""


@dataclass(frozen=True)
class Upload:
    """A member's last accepted upload."""

    round: int
    phase: str
    kind: str
    bytes: int
    encoding: str  # wire dtype of its values (f4, f2, q8), with K for a sparse APUD update
    at: float


@dataclass(frozen=True)
class Member:
    id: str
    state: str  # one of MEMBER_STATES
    arch: str = ""
    n_samples: int = 0
    profile: str = ""  # DEVICE+LINK as the device said when it joined ("" when it runs without one)
    uploads: int = 0  # accepted (the federation's, restarts included)
    last_upload: Upload | None = None
    grace_ends: float | None = None  # offline: when it stops holding up the round
    traits: str = ""  # what it says it is (link, tags, power: protofl/traits.py), in words ("" where it says nothing)
    skipped_files: int = 0  # files of its data its loader skipped (unreadable), as its last metrics said


@dataclass(frozen=True)
class Refused:
    """A member that refused the federation (a technique or model it lacks, another architecture, a config it
    cannot serve): how many times, and the last reason it (or, for an architecture, the server) gave."""

    member: str
    times: int
    reason: str


@dataclass(frozen=True)
class RoundRow:
    """A closed round; the accuracies once its metrics are in (None where no device sent them)."""

    round: int
    clients: int
    closed_by: str
    started: float
    ended: float
    uplink_bytes: int
    downlink_bytes: int
    local_acc: float | None = None
    global_acc: float | None = None
    local_proto_acc: float | None = None
    global_proto_acc: float | None = None
    # the global predictor, scored by the server on its own labelled data (`start --validation`)
    predictor_acc: float | None = None
    left_out: int = 0  # members the run's selection left out of the round (broker_server/core/selection.py)

    @property
    def duration_s(self) -> float:
        return max(0.0, self.ended - self.started)


@dataclass(frozen=True)
class Snapshot:
    fed: str
    preset: str
    state: str  # waiting | running | finished | stopped
    round: int
    rounds: int
    updated: float
    phase: str | None = None
    deadline: float | None = None
    quorum: int = 0
    completed: int = 0  # rounds closed
    members: tuple[Member, ...] = ()
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    accepted: dict[str, int] = field(default_factory=dict)  # uploads by kind (the federation's, restarts included)
    dropped: dict[str, int] = field(default_factory=dict)  # messages by reason
    clipped: dict[str, int] = field(default_factory=dict)  # uploads by kind
    last_drops: tuple[str, ...] = ()  # the last few drops, oldest first: "REASON from DEVICE: why"
    refusals: tuple[Refused, ...] = ()  # members that refused the federation, by member
    history: tuple[RoundRow, ...] = ()  # the last closed rounds, oldest first
    broker_restarts: int = 0
    # messages the broker reported dropped ($SYS, since this server started), and the re-send requests the
    # server sent for them (broker_server/ops/resend.py)
    broker_dropped: int = 0
    resend_requests: int = 0
    server_pid: int = 0
    started: float = 0.0  # when this server process started
    # differential privacy (protofl/privacy.py `ledger`): the budget, delta, clip, noise, epsilon per round and
    # spent so far; None: the federation runs without DP
    privacy: dict[str, Any] | None = None
    # a fleet's run (broker_server/ops/privacy_ledger.py `FleetView.now`): each device's epsilon and delta summed over
    # the fleet's runs, this one's so far included, and the fleet's budget; None outside a fleet
    fleet_privacy: dict[str, Any] | None = None
    # protofl/learning.py: the note once the federation is not learning (flat accuracies or a collapsed model)
    learning: str | None = None

    def count(self, state: str) -> int:
        return sum(1 for m in self.members if m.state == state)

    def last_accuracies(self) -> tuple[int, dict[str, float]] | None:
        """(round, its accuracies) of the last round whose metrics brought any."""
        for row in reversed(self.history):
            accs = {k: getattr(row, k) for k in ACCURACY_KEYS if getattr(row, k) is not None}
            if accs:
                return row.round, accs
        return None

    def to_json(self) -> dict[str, Any]:
        out = self.to_json_without_members()
        out["members"] = [_member_json(m) for m in self.members]
        return out

    def to_json_without_members(self) -> dict[str, Any]:
        """`to_json` with the members' rows left to the caller (its "members" key in its place, unset)."""
        # Field by field rather than dataclasses.asdict, which deep-copies every value: at 3,000 members
        # asdict was a seventh of a busy server's time (issue 27). The values are plain (str, numbers,
        # dicts of counts), so shallow copies of the dicts are what asdict would give.
        out = {f: getattr(self, f) for f in _SNAPSHOT_FIELDS}
        out["history"] = [_fields_of(r, _ROW_FIELDS) for r in self.history]
        for name in ("accepted", "dropped", "clipped"):
            out[name] = dict(out[name])
        out["last_drops"] = list(self.last_drops)
        out["refusals"] = [_fields_of(r, _REFUSED_FIELDS) for r in self.refusals]
        return {"v": SUMMARY_VERSION, "kind": SUMMARY_KIND, **out}

    def encode(self) -> bytes:
        return _dumps(self.to_json())

    @classmethod
    def from_json(cls, raw: Any, where: str = "summary") -> Snapshot:
        if not isinstance(raw, dict) or raw.get("kind") != SUMMARY_KIND:
            raise SummaryError(f'{where}: not a protofl summary (no "kind": "{SUMMARY_KIND}")')
        if raw.get("v") != SUMMARY_VERSION:
            raise SummaryError(
                f"{where}: summary version {raw.get('v')!r}; this build reads {SUMMARY_VERSION}: use "
                f"the same protofl-edge version on the server and here"
            )
        try:
            members = tuple(
                _build(Member, m, last_upload=_build(Upload, m["last_upload"]) if m.get("last_upload") else None)
                for m in raw["members"]
            )
            history = tuple(_build(RoundRow, r) for r in raw["history"])
            drops = tuple(str(d) for d in raw.get("last_drops", ()))
            refusals = tuple(_build(Refused, r) for r in raw.get("refusals", ()))
            return _build(cls, raw, members=members, history=history, last_drops=drops, refusals=refusals)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SummaryError(f"{where}: a damaged summary ({type(exc).__name__}: {exc})") from None

    @classmethod
    def decode(cls, data: bytes, where: str = "summary") -> Snapshot:
        try:
            raw = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise SummaryError(f"{where}: not JSON ({exc})") from None
        return cls.from_json(raw, where)


class SnapshotEncoder:
    """Encodes snapshots as `Snapshot.encode` does (the same bytes), each member's row once while it is the same
    `Member` object: the live watch hands on the same objects for the rows that did not change, so encoding a fleet's
    snapshot costs its changed rows and one join, not a row's encoding per member."""

    def __init__(self) -> None:
        self._rows: dict[str, tuple[Member, bytes]] = {}

    def encode(self, snap: Snapshot) -> bytes:
        rows, kept = self._rows, {}
        parts = []
        for m in snap.members:
            row = rows.get(m.id)
            if row is None or row[0] is not m:
                row = (m, _dumps(_member_json(m)))
            kept[m.id] = row
            parts.append(row[1])
        self._rows = kept
        out = snap.to_json_without_members()
        out["members"] = []
        head = _dumps(out)
        # The first '"members":[]' is the key's: the keys before it are plain fields, and a string's quotes are escaped.
        at = head.index(_NO_MEMBERS) + len(_NO_MEMBERS) - 1
        return b"".join((head[:at], b",".join(parts), head[at:]))


_NO_MEMBERS = b'"members":[]'


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def _build(cls: type, raw: dict[str, Any], **given: Any) -> Any:
    """`cls` from the keys of `raw` it has (unknown keys are a newer writer's additions: ignored)."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in raw.items() if k in names and k not in given}, **given)


_SNAPSHOT_FIELDS = tuple(f.name for f in fields(Snapshot))
_MEMBER_FIELDS = tuple(f.name for f in fields(Member))
_UPLOAD_FIELDS = tuple(f.name for f in fields(Upload))
_ROW_FIELDS = tuple(f.name for f in fields(RoundRow))
_REFUSED_FIELDS = tuple(f.name for f in fields(Refused))


def _fields_of(obj: Any, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in names}


def _member_json(m: Member) -> dict[str, Any]:
    out = _fields_of(m, _MEMBER_FIELDS)
    if m.last_upload is not None:
        out["last_upload"] = _fields_of(m.last_upload, _UPLOAD_FIELDS)
    return out

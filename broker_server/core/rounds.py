"""The round state machine: joins, presence, phases, uploads and deadlines, with no I/O (numpy only).

Round r: open -> [a first prototype phase -> targets] -> train phase -> fold into the server model, as
the round plan says; what each phase does is the active techniques' rules (broker_server/core/stages.py).
A phase closes when every expected client has sent what the plan asks of it in that phase, or at its
deadline; either way only once at least `min_clients` did (`--min-clients` is a floor for every close).

The machine is driven by inputs and answers with effects. An input is a decoded message (`Received`),
a device's presence (`Presence`), or a timer that fired (`GraceOver`, `DeadlinePassed`: `timers(now)`
says which are due). `accepts(input)` raises `Drop` for anything refused, before any state changes,
and says whether applying it changes state that a restart must rebuild (the shell journals exactly
those); `apply(input)` changes the state and returns what should happen outside: messages to publish,
"a phase boundary" (the durable service checkpoints there), "a round closed", "metrics came in". Timers
are inputs like messages, so a journal of inputs replays to the same state whatever the clock says.

What survives a crash is declared once: `MachineState`, the server model's state fields and each rule's
`state` (saved per technique); their checkpoint form is derived from the dataclasses (persist.py). Times
are not state: after a restart the open phase's deadline and every grace period are measured from the resume.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from broker_server.core.buffered import Buffered
from broker_server.core.closing import Closing, ClosingEffect, ClosingInput, Drop, FoldHere
from broker_server.core.persist import NOT_STATE, from_plain, restore_fields, to_plain
from broker_server.core.secagg_run import SecAggClosing
from broker_server.core.selection import Selection
from broker_server.core.stages import PhaseRun, build_model
from protofl import privacy
from protofl.algorithms.robust import ClipPolicy
from protofl.config import SCOPE, FederationConfig, canonical
from protofl.humanize import human_bytes
from protofl.lite import lite_needs, lite_refusal
from protofl.names import printable
from protofl.plan import Phase, RoundPlan, Upload
from protofl.traits import Traits
from protofl.wire import (
    Config,
    Head,
    Join,
    Message,
    Metrics,
    Pace,
    ParamsUpload,
    ProtoUpload,
    PublicSet,
    RoundStart,
    Status,
)

log = logging.getLogger("protofl.server")
UPLOAD_KINDS = frozenset(u.value for u in Upload)
_UPLOADS = {u.value: u for u in Upload}  # a dict lookup, not an Enum call, for every upload
_PHASES = {p.value: p for p in Phase}

# encode(message, round, phase) -> the bytes that go on the wire (their length is what is counted)
Encode = Callable[[Message, int, str], bytes]

# How long a device whose connection dropped (its last will) keeps its place in the open round: a flaky
# link that reconnects within it delivers its upload; a dead device stops holding up the round after it.
OFFLINE_GRACE_S = 5.0
# After the server restarts (or its broker connection comes back) every device must reconnect, with a
# backoff of up to 30 s (protofl/transport/mqtt.py Backoff): until a device has said "online" again, an
# "offline" presence - the will a dying broker published for it - gives it this long, from the resume.
RESUME_GRACE_S = 45.0
# Metrics of rounds this far behind the current one are still taken (they arrive after their round
# closed); anything else is refused, so a member cannot make the server keep metrics of any round.
METRICS_LAG = 2


# -- inputs -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Received:
    """A decoded message from a device's `up/` topic."""

    env: Head  # the envelope's fields (the body is `msg`)
    msg: Message
    nbytes: int


@dataclass(frozen=True)
class Presence:
    """A client's presence: online (connected), or offline (its last will, or it said goodbye). `gave_up`: the
    (round, phase) an online client gave up on (it failed there every time it tried): it leaves that phase, so
    the phase closes at quorum instead of waiting for its deadline; it stays a client for the next one."""

    client: str
    online: bool
    gave_up: tuple[int, str] | None = None
    traits: Traits | None = None  # what an online device says it is now (its power state): kept with its join
    # Offline for good: the fleet revoked it (broker_server/ops/enrol.py). It leaves at once, without a grace: what it
    # sends after (uploads the broker had queued when it cut the device off) is no client's, dropped and counted.
    revoked: bool = False


@dataclass(frozen=True)
class GraceOver:
    """Timer: `client` went offline and did not come back within its grace; it leaves the open round."""

    client: str


@dataclass(frozen=True)
class DeadlinePassed:
    """Timer: the deadline of round `round`'s `phase` passed with at least min_clients complete."""

    round: int
    phase: Phase


Input = Received | Presence | GraceOver | DeadlinePassed | ClosingInput


# -- effects ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Publish:
    """Send `message` (already encoded as `payload`) on its topic, retained."""

    message: Message
    payload: bytes


@dataclass(frozen=True)
class Boundary:
    """A phase opened or the federation finished: the state has no half-folded phase (checkpoint here)."""


@dataclass(frozen=True)
class RoundClosed:
    record: RoundRecord


@dataclass(frozen=True)
class MetricsIn:
    client: str
    round: int
    metrics: Metrics
    nbytes: int


@dataclass(frozen=True)
class Steer:
    """Send `message` (encoded as `payload`) to one device on its own `down/` topic, not retained: pace steering,
    "you are not in this round; come back then" (broker_server/core/selection.py)."""

    client: str
    message: Message
    payload: bytes


Effect = Publish | Steer | Boundary | RoundClosed | MetricsIn | ClosingEffect


# -- state --------------------------------------------------------------------------------------
@dataclass
class RoundRecord:
    round: int
    clients: list[str] = field(default_factory=list)
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    started: float = 0.0
    ended: float = 0.0
    closed_by: str = ""
    # rows clipped and rows checked against the radius in this round, per kind (empty with clipping off)
    clipped: dict[str, int] = field(default_factory=dict)
    clip_checked: dict[str, int] = field(default_factory=dict)
    # With a run's selection (broker_server/core/selection.py): the members chosen for the round, and why each other
    # member is not in it (empty without one: every member takes part).
    selected: list[str] = field(default_factory=list)
    left_out: dict[str, str] = field(default_factory=dict)
    # Asynchronous rounds (broker_server/core/buffered.py): the older uploads folded into this version ("device@the
    # version it trained from" -> staleness), each at weight 1/sqrt(1 + staleness).
    staleness: dict[str, int] = field(default_factory=dict)


@dataclass
class OpenPhase:
    phase: Phase
    expected: set[str]
    needs: tuple[Upload, ...]
    received: dict[str, set[Upload]] = field(default_factory=dict)
    # Where each upload was folded when not here ("sender/kind" -> shard: the sharded closing), and why the phase
    # is closing while its closing strategy completes it ("" while it is open, and always when it folds here).
    owners: dict[str, str] = field(default_factory=dict)
    closing: str = ""
    deadline: float = field(default=0.0, metadata=NOT_STATE)  # a time: measured again after a restart
    # Lite devices (no torch: protofl/lite.py) expected in this phase, and the part of `needs` they send.
    lite: set[str] = field(default_factory=set)
    lite_needs: tuple[Upload, ...] = ()

    def needs_of(self, client: str) -> tuple[Upload, ...]:
        return self.lite_needs if client in self.lite else self.needs

    def complete(self, client: str) -> bool:
        return set(self.needs_of(client)) <= self.received.get(client, set())

    def done_clients(self) -> list[str]:
        return sorted(c for c in self.received if self.complete(c))


@dataclass
class Accepted:
    """A member's accepted uploads, for the watchers (broker_server/watch): how many, and the last one. State like
    the rest, so a restarted server shows what was accepted before it (issue 42); `at` is the machine's clock when
    it was applied (a journal replay's time for one replayed)."""

    uploads: int = 0
    round: int = 0
    phase: str = ""
    kind: str = ""
    bytes: int = 0
    at: float = 0.0


@dataclass
class MachineState:
    """Everything of the round machine that a restart must rebuild (besides the server model)."""

    round: int = 0
    finished: bool = False
    phase: OpenPhase | None = None
    clients: dict[str, Join] = field(default_factory=dict)
    departed: dict[str, Join] = field(default_factory=dict)  # offline past their grace; back when online
    leaving: set[str] = field(default_factory=set)  # offline, still expected for their grace
    records: list[RoundRecord] = field(default_factory=list)
    current: RoundRecord = field(default_factory=lambda: RoundRecord(round=1))
    # What the watchers count (a checkpoint written before they were state lacks both: restored empty)
    accepted: dict[str, Accepted] = field(default_factory=dict)  # by member
    accepted_kinds: dict[str, int] = field(default_factory=dict)  # uploads by kind, every member
    # Asynchronous rounds (broker_server/core/buffered.py): "member/kind" -> the last version an upload was folded from,
    # so that no (member, kind, version) upload is folded twice, whichever version is open when it comes again.
    versions: dict[str, int] = field(default_factory=dict)
    stopped: str = ""  # why the run finished before its last round (a spent privacy budget), "" otherwise


class Graces:
    """How long each offline member keeps its place in the open round: timers, in memory only, never state (after
    a restart, or the broker connection back, they are measured again from the resume)."""

    def __init__(self, offline: float, resume: float) -> None:
        self.offline = offline
        self.resume = max(resume, offline)
        self.ends: dict[str, float] = {}
        self.unconfirmed: set[str] = set()  # clients not heard "online" since the resume
        self.resumed_at = 0.0

    def start(self, client: str, now: float) -> float:
        """`client` went offline at `now`: when its grace ends. Until a client has said "online" since the resume,
        its grace is the resume grace, counted from the resume: an "offline" then is most likely the will its
        broker published while dying with the server."""
        end = now + self.offline
        if client in self.unconfirmed:
            end = max(end, self.resumed_at + self.resume)
        self.ends[client] = end
        return end

    def restart(self, now: float, clients: Iterable[str], leaving: Iterable[str]) -> None:
        """Measured again from `now`: every client unconfirmed, every leaving one given the resume grace."""
        self.resumed_at = now
        self.unconfirmed = set(clients)
        self.ends = {c: now + self.resume for c in leaving}


class UploadHead(Protocol):
    """What places an upload in the open phase: an envelope's fields (`Head`), or a shard's report of one."""

    @property
    def sender(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def round(self) -> int: ...

    @property
    def phase(self) -> str: ...


class RoundMachine:
    def __init__(
        self,
        cfg: FederationConfig,
        encode: Encode,
        *,
        clock: Callable[[], float],
        initial_params: np.ndarray | None = None,
        public: PublicSet | None = None,
        expected_clients: Sequence[str] | None = None,
        policy: ClipPolicy | None = None,
        offline_grace: float = OFFLINE_GRACE_S,
        resume_grace: float = RESUME_GRACE_S,
        limits: dict[str, int] | None = None,
        closing: Closing | None = None,
        time_scale: float = 1.0,
        fed: str = "",
    ) -> None:
        self.cfg = cfg
        # Who takes part in each round (the run's selection; `time_scale`: a simulation's links run that much
        # faster than the deadline the server is given).
        self.selection = Selection(cfg, time_scale)
        self.limits = dict(limits or {})  # the decoder limits the config message tells devices
        self.encode = encode
        self.clock = clock
        self.graces = Graces(offline_grace, resume_grace)
        self.plan = RoundPlan.from_config(cfg)
        # Buffered asynchronous rounds (FedBuff), where the config asks for them.
        sharded = closing is not None and not isinstance(closing, FoldHere)
        self.buffered = Buffered(cfg, self.plan, sharded=sharded)
        # The public message: the public set where the plan uses it, and the shared backbone where one travels
        # (a federation whose plan uses no public images sends only that: a set of zero samples).
        if public is not None and not self.plan.public_classes and public.backbone is not None:
            public = replace(public, x=public.x[:0], y=public.y[:0], classes=[])
        self.public = (
            public if self.plan.public_classes or (public is not None and public.backbone is not None) else None
        )
        self.expected_clients = sorted(expected_clients) if expected_clients else None
        # Membership by a set: `in` on the sorted list was a scan per upload (a fifth of the fold's time at
        # 4,000 devices, quadratic in the fleet).
        self._expected_set = frozenset(self.expected_clients or ())
        # Uploads are clipped by default. `initial_params`: the whole model's, where the server knows it.
        self.model = build_model(
            cfg, self.plan, policy, initial_params, None if self.public is None else self.public.backbone
        )
        self.dp = privacy.resolve(cfg, self.plan)  # the DP mechanism the devices apply: what the rounds spend
        # How a phase closes (closing.py): its folds finish here (one aggregator), the coordinator of aggregator
        # shards merges their partials first (shard_closing.py), or secure aggregation runs its steps first, where
        # the config asks for it (refused there, with the reason, where it cannot combine).
        self.closing: Closing = closing or FoldHere()
        if cfg.secagg:
            self.closing = SecAggClosing(cfg, self.model, policy or ClipPolicy(), fed=fed, sharded=sharded)
        self.layout = self.model.rules.adapter_layout() or []  # the federated adapter's, announced in the config
        self.state = MachineState()
        # What a new device receives once (config + public set): a function of the config, never state.
        self.welcome_bytes = sum(len(p.payload) for p in self._welcome())
        self.run: PhaseRun | None = None  # the open phase's folds (empty at every boundary)
        self._below_floor_said = False

    # The state, read by the shell, services, simulators and tests.
    @property
    def round(self) -> int:
        return self.state.round

    @property
    def finished(self) -> bool:
        return self.state.finished

    @property
    def phase(self) -> OpenPhase | None:
        return self.state.phase

    @property
    def clients(self) -> dict[str, Join]:
        return self.state.clients

    @property
    def departed(self) -> dict[str, Join]:
        return self.state.departed

    @property
    def records(self) -> list[RoundRecord]:
        return self.state.records

    def grace_end(self, client: str) -> float | None:
        """When an offline `client` stops holding up the open round (None unless it is leaving)."""
        return self.graces.ends.get(client) if client in self.state.leaving else None

    @property
    def quorum(self) -> int:
        """Clients needed to open round 1."""
        return len(self.expected_clients) if self.expected_clients else self.cfg.min_clients

    @property
    def floor(self) -> int:
        """Clients that must have sent everything before a phase may close (with a run's selection, no more than
        the round chose)."""
        least = min(self.cfg.min_clients, self.quorum)
        return max(1, min(least, len(self.state.current.selected))) if self.selection.active else least

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> list[Effect]:
        """The federation's first messages: config, public set, "waiting"."""
        return [*self._welcome(), self._status("waiting", f"0/{self.quorum} clients")]

    def announce(self) -> list[Effect]:
        """After a restart: the retained messages again (config, public set, status, the open round
        message), not counted as downlink; a device that already handled the round message sends its
        uploads again, and those already applied are dropped as duplicates."""
        out: list[Effect] = [*self._welcome()]
        s = self.state
        if s.finished:
            return out + self._finish_messages()
        if s.phase is None:
            return out + [self._status("waiting", f"{len(s.clients)}/{self.quorum} clients")]
        out += [
            self._status("running", f"round {s.round}/{self.cfg.rounds} {s.phase.phase.value}"),
            self._publish(self._round_message(s.phase.phase, s.phase.deadline), s.phase.phase.value),
        ]
        return out + self.closing.announce(self)

    def _welcome(self) -> list[Publish]:
        out = [
            self._publish(
                Config(
                    preset=self.cfg.preset,
                    params=self.cfg.to_dict(),
                    adapter_layout=self.layout,
                    class_masks=self.model.rules.support_masks(),
                    limits=self.limits,
                ),
                "",
                round_=0,
            )
        ]
        if self.public is not None:
            out.append(self._publish(self.public, "", round_=0))
        return out

    def _publish(self, msg: Message, phase: str, round_: int | None = None) -> Publish:
        return Publish(msg, self.encode(msg, self.state.round if round_ is None else round_, phase))

    def _status(self, state: str, detail: str = "") -> Publish:
        return self._publish(Status(state=state, detail=detail), "")

    # -- inputs ---------------------------------------------------------------------------------
    def accepts(self, inp: Input) -> bool:
        """Raise Drop if `inp` is refused (nothing changes); else whether applying it changes state that a
        restart must rebuild (what the shell journals before applying it)."""
        s = self.state
        if isinstance(inp, ClosingInput):
            return self.closing.accepts(self, inp)
        if isinstance(inp, Received):
            env, msg = inp.env, inp.msg
            if isinstance(msg, (ProtoUpload, ParamsUpload)):
                self._check_upload(env, msg)
                return True
            if env.kind in self.closing.kinds:
                return self.closing.accepts(self, inp)
            if isinstance(msg, Join):
                self._check_member(env.sender)
                self._check_arch(env.sender, msg)
                self._check_lite(env.sender, msg)
                return env.sender not in s.clients or env.sender in s.leaving
            if isinstance(msg, Metrics):
                self._check_metrics(env)
                return False
            raise Drop("unexpected_kind", f"'{env.kind}' from {env.sender}")
        if isinstance(inp, Presence):
            if s.finished:
                return False
            if inp.gave_up is not None:
                return self._gives_up(inp.client, inp.gave_up)
            if inp.online:
                return inp.client in s.leaving or inp.client in s.departed or self._new_traits(inp)
            return inp.client in s.clients and (inp.revoked or inp.client not in s.leaving)
        if isinstance(inp, GraceOver):
            return not s.finished and inp.client in s.leaving and inp.client in s.clients
        return s.phase is not None and not s.finished and (inp.round, inp.phase) == (s.round, s.phase.phase)

    def apply(self, inp: Input) -> list[Effect]:
        """Apply an input that `accepts` took (again while replaying a journal); returns its effects."""
        if isinstance(inp, Received):
            msg = inp.msg
            if isinstance(msg, Join):
                return self._on_join(inp.env, msg, inp.nbytes)
            if isinstance(msg, Metrics):
                return [MetricsIn(inp.env.sender, inp.env.round, msg, inp.nbytes)]
            if isinstance(msg, (ProtoUpload, ParamsUpload)):
                return self._on_upload(inp.env, msg, inp.nbytes)
            return self.closing.apply(self, inp)  # a message of its kinds
        if isinstance(inp, Presence):
            if inp.gave_up is not None:
                return self._give_up(inp.client, inp.gave_up) if self._gives_up(inp.client, inp.gave_up) else []
            if inp.revoked:
                return self._depart(inp.client)
            if inp.online and self._new_traits(inp):
                self._set_traits(inp.client, inp.traits)
            return self._come_back(inp.client) if inp.online else self._leave(inp.client)
        if isinstance(inp, ClosingInput):
            return self.closing.apply(self, inp)
        if isinstance(inp, GraceOver):
            return self._depart(inp.client) if self.accepts(inp) else []
        return self._close_phase("deadline") if self.accepts(inp) else []

    def timers(self, now: float) -> list[GraceOver | DeadlinePassed]:
        """The timer inputs due at `now`: devices whose grace ran out, then the open phase's deadline.
        A deadline that passes with fewer than min_clients complete is moved on by another round_timeout, unless
        the closing strategy says waiting cannot help (`Closing.overdue`: it closes the phase itself)."""
        s = self.state
        if s.finished:
            return []
        due: list[GraceOver | DeadlinePassed] = [
            GraceOver(c) for c in sorted(s.leaving) if now >= self.graces.ends.get(c, 0.0) and c in s.clients
        ]
        open_ = s.phase
        if open_ is not None and not due and not open_.closing and now >= open_.deadline:
            done = self.closing.ready(self)
            if done is None:
                done = open_.done_clients()
            if len(done) >= self.floor or self.closing.overdue(self):
                due.append(DeadlinePassed(s.round, open_.phase))
            else:
                log.warning(
                    "round %d %s: deadline passed with %d/%d clients (min %d); waiting another %.0fs",
                    s.round,
                    open_.phase.value,
                    len(done),
                    len(open_.expected),
                    self.floor,
                    self.cfg.round_timeout,
                )
                open_.deadline = now + self.cfg.round_timeout
        return due

    def screen(self, head: Head) -> None:
        """Raise Drop for a message its envelope alone shows the machine would refuse (a stranger's upload,
        another round or phase, a second upload, metrics of a far round), before its body is parsed."""
        if head.kind in UPLOAD_KINDS:
            self.check_upload_head(head)
        elif head.kind in self.closing.kinds:
            self.closing.screen(self, head)
        elif head.kind == Metrics.KIND:
            self._check_metrics(head)
        elif head.kind == Join.KIND:
            self._check_member(head.sender)

    def _new_traits(self, inp: Presence) -> bool:
        """Whether an online presence says something new about what a member is (its traits)."""
        s = self.state
        join = s.clients.get(inp.client) or s.departed.get(inp.client)
        return inp.traits is not None and join is not None and join.traits != inp.traits

    def _set_traits(self, client: str, traits: Traits | None) -> None:
        s = self.state
        for members in (s.clients, s.departed):
            if client in members:
                members[client] = replace(members[client], traits=traits)

    def _check_member(self, client: str) -> None:
        if self._expected_set and client not in self._expected_set:
            raise Drop("unknown_client", f"'{client}' is not in this federation's client list")

    def _check_metrics(self, env: Head) -> None:
        if env.sender not in self.state.clients:
            raise Drop("unknown_client", f"metrics from '{env.sender}'")
        if not self.state.round - METRICS_LAG <= env.round <= self.state.round:
            raise Drop("stale", f"metrics for round {env.round} from {env.sender}; now round {self.state.round}")

    def _check_arch(self, client: str, msg: Join) -> None:
        """A federation of one model (federate="full": every client holds the same parameter vector) refuses a
        device of another architecture at its join: its uploads could never be folded, and it would hold every
        round up until the deadline."""
        cfg = self.cfg
        if cfg.federate != "full" or not msg.arch:  # no --arch: the device builds the federation's own
            return
        runs = cfg.archs[0]
        if msg.arch != runs:
            raise Drop(
                "wrong_arch",
                f"join from '{client}' with --arch {msg.arch}: this federation ({cfg.preset}, federate=full) "
                f"averages one model, architecture '{runs}'; join with --arch {runs} (or without --arch)",
            )

    def _check_lite(self, client: str, msg: Join) -> None:
        """A lite device (no torch) is refused at its join where the federation needs training from it
        (protofl/lite.py): it could never send what the phase waits for."""
        if msg.trains:
            return
        why = lite_refusal(self.cfg, self.public is not None and self.public.graph is not None)
        if why is not None:
            raise Drop("cannot_train", f"join from '{client}', a lite device (no torch): {why}")

    def _expect(self, open_: OpenPhase, client: str) -> None:
        """`client` is expected in the open phase, for what it can send there (a lite device: maybe nothing)."""
        join = self.state.clients.get(client)
        if join is not None and not join.trains:
            if not open_.lite_needs:
                return
            open_.lite.add(client)
        open_.expected.add(client)

    def _gives_up(self, client: str, where: tuple[int, str]) -> bool:
        """Whether `client` giving up on `where` (round, phase) takes it out of the open phase."""
        open_ = self.state.phase
        return (
            open_ is not None
            and (self.state.round, open_.phase.value) == where
            and client in open_.expected
            and not open_.complete(client)
        )

    def _give_up(self, client: str, where: tuple[int, str]) -> list[Effect]:
        open_ = self.state.phase
        assert open_ is not None
        open_.expected.discard(client)
        log.warning(
            "client %s gave up on round %d %s; the phase waits for %d other client(s)",
            client,
            where[0],
            where[1],
            len(open_.expected),
        )
        return self.close_if_complete()

    def _on_join(self, env: Head, msg: Join, nbytes: int) -> list[Effect]:
        s = self.state
        new = env.sender not in s.clients
        s.departed.pop(env.sender, None)
        self._forget_leaving(env.sender)
        s.clients[env.sender] = msg
        s.current.uplink_bytes += nbytes
        if new:
            s.current.downlink_bytes += self.welcome_bytes
            log.info(
                "client %s joined (%s, %d samples); %d/%d",
                env.sender,
                printable(msg.arch) or "default arch",
                msg.n_samples,
                len(s.clients),
                self.quorum,
            )
        if s.round == 0 and not s.finished and len(s.clients) >= self.quorum:
            return self._open_round(1)
        if s.phase is not None and new:
            if self.selection.active:  # not chosen for the open round: it comes back for the next one
                why = f"joined during round {s.round}, chosen before it came"
                return [self._pace(env.sender, s.phase.deadline, why)]
            self._expect(s.phase, env.sender)
        return []

    def _leave(self, client: str) -> list[Effect]:
        """`client` went offline. After its grace without coming back (a `GraceOver` timer) it no longer
        holds up the open phase; a link that reconnects within the grace keeps its place. Until a client
        has said "online" since the resume, its grace is the resume grace (Graces.start)."""
        now = self.clock()
        self.state.leaving.add(client)
        if self.graces.start(client, now) <= now:
            return self._depart(client)
        return []

    def _forget_leaving(self, client: str) -> None:
        self.state.leaving.discard(client)
        self.graces.ends.pop(client, None)

    def _depart(self, client: str) -> list[Effect]:
        s = self.state
        self._forget_leaving(client)
        s.departed[client] = s.clients.pop(client)
        log.info("client %s left; %d client(s) remain", client, len(s.clients))
        open_ = s.phase
        if open_ is not None and not open_.complete(client):
            open_.expected.discard(client)
            return self.close_if_complete()
        return []

    def _come_back(self, client: str) -> list[Effect]:
        """A device is online (reconnected): if it left, it is a client again."""
        s = self.state
        self.graces.unconfirmed.discard(client)
        if client in s.leaving:
            self._forget_leaving(client)  # back within the grace: it never left
            return []
        if s.finished or client not in s.departed:
            return []
        s.clients[client] = s.departed.pop(client)
        if s.phase is not None and (not self.selection.active or client in s.current.selected):
            self._expect(s.phase, client)
        log.info("client %s is back; %d client(s)", client, len(s.clients))
        return []

    def _check_upload(self, env: Head, msg: ProtoUpload | ParamsUpload) -> tuple[OpenPhase, Upload]:
        """Where an upload belongs; raises Drop if it belongs nowhere now."""
        open_, kind = self.check_upload_head(env)
        self.check_base(msg, env.round)
        return open_, kind

    def check_base(self, msg: ProtoUpload | ParamsUpload, round_: int | None = None) -> None:
        """An upload a rule finds stale (e.g. trained from another round's adapter than `round_`, the one its envelope
        names: the open round's but for an asynchronous round's older upload) is dropped as such."""
        why = self.model.rules.stale(msg, self.state.round if round_ is None else round_)
        if why is not None:
            raise Drop("stale", why)

    def check_upload_head(self, env: Head | UploadHead) -> tuple[OpenPhase, Upload]:
        """The checks of an upload that its envelope decides (or a shard's report of one it folded)."""
        s = self.state
        if env.sender not in s.clients:
            raise Drop("unknown_client", f"'{env.sender}' sent {env.kind} without joining")
        open_ = s.phase

        def now() -> str:  # only for a drop's line: this runs twice for every upload
            return f"now round {s.round}/{open_.phase.value if open_ else '-'}"

        older = open_ is not None and self.buffered.takes(s.round, env.round)  # FedBuff: folded, weighted
        if open_ is None or (env.round < s.round and not older):
            raise Drop("stale", f"{env.kind} for round {env.round}/{env.phase} from {env.sender}; {now()}")
        phase = _PHASES.get(env.phase)
        if phase not in self.plan.phases:
            raise Drop("wrong_phase", f"{env.kind} for phase '{env.phase}', which this federation does not have")
        assert phase is not None
        if env.round == s.round and self.plan.phases.index(phase) < self.plan.phases.index(open_.phase):
            raise Drop("stale", f"{env.kind} for round {env.round}/{env.phase} from {env.sender}; {now()}")
        if env.round > s.round or phase is not open_.phase:
            raise Drop("wrong_phase", f"{env.kind} for round {env.round}/{env.phase}, {now()}")
        key = self.buffered.key(env.sender, s.round, env.round)
        if self.selection.active and env.sender not in open_.expected and key not in open_.received:
            raise Drop("not_selected", f"{env.kind} from {env.sender}, who is not in round {s.round}'s selection")
        kind = _UPLOADS[env.kind]
        if self.buffered.active and env.round <= s.versions.get(f"{env.sender}/{env.kind}", 0):
            raise Drop("duplicate", f"{env.kind} from {env.sender} for version {env.round}, folded already")
        if kind in open_.received.get(key, ()):
            raise Drop("duplicate", f"second {env.kind} from {env.sender} in round {env.round}/{env.phase}")
        if kind not in open_.needs_of(env.sender):
            what = " for a lite device" if env.sender in open_.lite else ""
            raise Drop("wrong_phase", f"{env.kind} is not part of the {phase.value} phase{what}")
        return open_, kind

    def _on_upload(self, env: Head, msg: ProtoUpload | ParamsUpload, nbytes: int) -> list[Effect]:
        # `accepts` placed it (membership, round, phase, duplicate): not checked a second time here.
        open_, kind = self.state.phase, _UPLOADS[env.kind]
        assert open_ is not None
        # The phase checks the whole upload before folding any of it: one that raises here leaves it
        # (and everything below) unchanged.
        assert self.run is not None
        r = self.state.round
        if env.round == r:
            self.run.add(kind, msg, env.sender)
        else:  # an asynchronous round's older upload (broker_server/core/buffered.py)
            self.run.add(kind, msg, env.sender, weight=self.buffered.weight(r, env.round))
            self.state.current.staleness[f"{env.sender}@{env.round}"] = r - env.round
        key = self.buffered.key(env.sender, r, env.round)
        open_.received[key] = open_.received.get(key, set()) | {kind}
        if self.buffered.active:
            self.state.versions[f"{env.sender}/{env.kind}"] = env.round
        self.state.current.uplink_bytes += nbytes
        self.count_upload(env, nbytes)
        return self.close_if_complete()

    def count_upload(self, env: UploadHead, nbytes: int) -> None:
        """An accepted upload, counted for the watchers (its sender's, and its kind's)."""
        s = self.state
        seen = s.accepted.get(env.sender)
        s.accepted[env.sender] = Accepted(
            (seen.uploads if seen else 0) + 1, env.round, env.phase, env.kind, nbytes, self.clock()
        )
        s.accepted_kinds[env.kind] = s.accepted_kinds.get(env.kind, 0) + 1

    def close_if_complete(self) -> list[Effect]:
        """Close the open phase when every expected client sent everything, if at least the floor did."""
        open_ = self.state.phase
        assert open_ is not None
        # Every expected client must have sent something first: O(1), where the scan below is O(clients) and
        # would run after every upload of a fleet (issue 27).
        if open_.closing:
            return []
        own = self.closing.progress(self)
        if own is not None:
            return own
        if self.buffered.full(len(open_.received)) and self.buffered.full(len(open_.done_clients())):
            return self._close_phase("buffer")  # FedBuff: K uploads folded (K is its floor), a new version
        target = self.selection.target
        if target and len(open_.received) >= target and len(open_.done_clients()) >= max(target, self.floor):
            return self._close_phase("target")  # over-selection: the first `target` to finish close it
        if len(open_.received) < len(open_.expected):
            return []
        if not open_.expected or not all(open_.complete(c) for c in open_.expected):
            return []
        if len(open_.done_clients()) >= self.floor:
            return self._close_phase("quorum")
        if not self._below_floor_said:
            self._below_floor_said = True
            log.warning(
                "round %d %s: every client still here sent (%d), fewer than --min-clients %d: waiting "
                "for devices to come back, or the deadline",
                self.state.round,
                open_.phase.value,
                len(open_.done_clients()),
                self.floor,
            )
        return []

    # -- phases ---------------------------------------------------------------------------------
    def _open_round(self, r: int) -> list[Effect]:
        self.state.round = r
        self.state.current.round = r
        self.state.current.started = self.clock()
        return self._open_phase(self.plan.first_phase)

    def _round_message(self, phase: Phase, deadline: float) -> RoundStart:
        """The round message that opens `phase`: a function of the model, so that a restarted aggregator
        announces the same one (its deadline aside)."""
        plan = self.plan
        assert self.run is not None
        f = self.run.round_fields()
        return RoundStart(
            deadline=deadline,
            adapter=f.adapter,
            params=f.params,
            targets=f.targets,
            target_label=plan.target_label if f.targets is not None else "",
            participants=sorted(self.state.current.selected) if self.selection.active else None,
            final=False,
            dt=plan.adapter_dtype,
            model=f.model,
        )

    def _open_phase(self, phase: Phase) -> list[Effect]:
        s = self.state
        self.model.round = self.state.round
        self.run = PhaseRun(self.model, phase)
        deadline = self.clock() + self.cfg.round_timeout
        steer: list[Effect] = []
        if self.selection.active and phase is self.plan.first_phase:
            steer = self._select(deadline)
        expected = set(s.clients) & set(s.current.selected) if self.selection.active else set(s.clients)
        message = self._publish(self._round_message(phase, deadline), phase.value)
        # Counted before the boundary's checkpoint, so that a restart (which announces it again without
        # counting) keeps it.
        s.current.downlink_bytes += len(message.payload) * len(s.clients)
        s.phase = OpenPhase(
            phase, set(), self.plan.sends(phase), deadline=deadline, lite_needs=lite_needs(self.plan, phase)
        )
        for client in expected:
            self._expect(s.phase, client)
        self.closing.begin(self)
        self._below_floor_said = False
        running = self._status("running", f"round {s.round}/{self.cfg.rounds} {phase.value}")
        return [Boundary(), running, message, *steer]

    def _select(self, deadline: float) -> list[Effect]:
        """Choose the round's members (the run's selection; a function of the state, the seed and the round), and
        tell every member left out when to come back: at this round's deadline at the latest."""
        s = self.state
        s.current.selected = []
        down = len(self._publish(self._round_message(self.plan.first_phase, deadline), "").payload)
        choice = self.selection.choose(s.round, s.clients, down, {c: a.bytes for c, a in s.accepted.items()})
        s.current.selected, s.current.left_out = list(choice.chosen), dict(choice.left_out)
        if not choice.chosen:
            log.warning(
                "round %d: the run's selection chose none of the %d member(s) (select=%r): the round waits for its "
                "deadline again and again; let devices with those traits join, or change the selection",
                s.round,
                len(s.clients),
                self.cfg.select,
            )
        log.info("round %d: %d member(s) chosen, %d left out", s.round, len(choice.chosen), len(choice.left_out))
        return [self._pace(c, deadline, why) for c, why in sorted(choice.left_out.items())]

    def _pace(self, client: str, until: float, why: str) -> Steer:
        return self.steer(client, Pace(until=until, reason=why), self.plan.first_phase)

    def steer(self, client: str, msg: Message, phase: Phase) -> Steer:
        """`msg` for one device only, on its own topic, as of the open round's `phase`."""
        return Steer(client, msg, self.encode(msg, self.state.round, phase.value))

    def _close_phase(self, why: str) -> list[Effect]:
        assert self.state.phase is not None and self.run is not None
        return self.closing.close(self, why)

    def after_close(self, why: str) -> list[Effect]:
        """The open phase's folds are finished (`run.finish()`): open the next phase, or close the round."""
        s = self.state
        open_ = s.phase
        assert open_ is not None
        self.run = None
        nxt = self.plan.next_phase(open_.phase)
        if nxt is not None:
            return self._open_phase(nxt)
        s.phase = None
        rec = s.current
        # (an asynchronous round's older upload is recorded under "member@version": the member)
        rec.clients = sorted({c.split("@", 1)[0] for c in open_.done_clients()})
        rec.ended = self.clock()
        rec.closed_by = why
        # Read before the next round's first phase starts its counts again.
        rec.clipped, rec.clip_checked = dict(self.model.round_clips.clipped), dict(self.model.round_clips.checked)
        s.records.append(rec)
        log.info(
            "round %d: %d/%d clients (%s), up %s, down %s",
            rec.round,
            len(rec.clients),
            len(open_.expected),
            why,
            human_bytes(rec.uplink_bytes),
            human_bytes(rec.downlink_bytes),
        )
        s.current = RoundRecord(round=rec.round + 1)
        out: list[Effect] = [RoundClosed(rec)]
        stop = privacy.stop_reason(self.dp, rec.round) if rec.round < self.cfg.rounds else None
        if stop is not None:
            log.warning("%s", stop)
            s.stopped = stop
        if rec.round >= self.cfg.rounds or stop is not None:
            s.finished = True
            return out + [Boundary(), *self._finish_messages()]
        return out + self._open_round(rec.round + 1)

    def _finish_messages(self) -> list[Effect]:
        f = self.model.rules.round_fields(Phase.DONE)
        return [
            self._publish(
                RoundStart(
                    deadline=self.clock(),
                    adapter=f.adapter,
                    params=f.params,
                    targets=None,
                    target_label="",
                    participants=None,
                    final=True,
                    predictor=f.predictor,
                    model=f.model,
                    dt=self.plan.adapter_dtype,
                ),
                Phase.DONE.value,
            ),
            self._status(
                "finished", f"{self.state.round} rounds" + (f"; {self.state.stopped}" if self.state.stopped else "")
            ),
        ]

    # -- durability: the state at a phase boundary, and a restart from it ------------------------
    def snapshot(self, state: MachineState | None = None) -> dict[str, Any]:
        """The machine's state as plain values and numpy arrays, taken at a phase boundary: the open phase
        has received nothing yet, so its folds are fresh and need not be saved. `state`: another in place of the
        machine's own (the sharded closing's phase state for the shards: the same, without what a shard never
        reads)."""
        state = self.state if state is None else state
        open_ = state.phase
        if open_ is not None and open_.received:
            raise RuntimeError("snapshot() is taken at phase boundaries only (this phase has uploads)")
        rules = {name: {} if rule.state is None else to_plain(rule.state) for name, rule in self.model.rules.named()}
        return {"cfg": self.cfg.to_dict(), "machine": to_plain(state), "model": to_plain(self.model), "rules": rules}

    def restore(self, saved: dict[str, Any]) -> None:
        """Back to a `snapshot()` (the config must be the one it was taken with); call `resume` once the
        journal after it is replayed."""
        mine = self.cfg.to_dict()
        theirs = saved["cfg"] if SCOPE in saved["cfg"] else canonical(saved["cfg"])  # a flat one: before scoping
        if theirs != mine:
            changed = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))
            raise ValueError(f"the saved federation was run with another config (differs in: {', '.join(changed)})")
        restore_fields(self.model, saved["model"])
        for name, rule in self.model.rules.named():
            if rule.state is not None:
                # A checkpoint written before the rules kept their own state (durable.py format 2) has their
                # fields, under the same names, in the server model's.
                restore_fields(
                    rule.state,
                    saved["rules"].get(name) or {},
                    older=saved["model"],
                    what=f"the state of technique '{name}'",
                )
        self.state = from_plain(MachineState, saved["machine"])
        self.model.round = self.state.round
        self.run = None if self.state.phase is None else PhaseRun(self.model, self.state.phase.phase)
        self.closing.begin(self)

    def resume(self, now: float) -> None:
        """Times start again from `now` (a restart, or the broker connection back): the open phase's
        deadline, and every grace; devices not heard "online" since get the resume grace."""
        s = self.state
        if s.phase is not None:
            s.phase.deadline = now + self.cfg.round_timeout
        self.graces.restart(now, s.clients, s.leaving)

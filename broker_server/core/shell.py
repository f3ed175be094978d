"""The aggregator: the round state machine (rounds.py) behind a thin I/O shell over any `Transport`.

The shell turns what arrives into the machine's inputs - an upload, join or metrics message on a
device's `up/` topic, a device's presence, a timer that fired - and carries out the effects the machine
returns: it publishes messages (retained) and hands closed rounds and metrics on. It drives the machine
through one interface (`Steps`): in memory, or made durable (durable.Durable), where an input that changes
state goes to the journal before it is applied and a phase boundary is checkpointed, so a restart replays
exactly the inputs that were applied, in order (`replay`).

It decodes each message with the federation's limits, checks that the topic's client id is the
message's sender and that the federation is ours. With a member list (join credentials or `--allow`),
a message on a non-member's topic is dropped before it is even decoded, so strangers cost a counter,
not memory. It is the ONE error boundary: whatever is raised while decoding, validating or folding an
input becomes a counted, logged drop with its reason, and the state is unchanged (the machine and its
folds check everything before they change anything). numpy only.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from broker_server.core.member_log import MemberLog
from broker_server.core.rounds import (
    OFFLINE_GRACE_S,
    Boundary,
    Closing,
    DeadlinePassed,
    Drop,
    Effect,
    GraceOver,
    Input,
    MetricsIn,
    Presence,
    Publish,
    Received,
    RoundClosed,
    RoundMachine,
    RoundRecord,
    Steer,
)
from broker_server.core.stages import ServerModel
from protofl import topics
from protofl.adapter import adapter_layout, layout_size
from protofl.algorithms.robust import ClipPolicy
from protofl.config import FederationConfig
from protofl.errors import WireError
from protofl.names import printable
from protofl.plan import Phase, RoundPlan
from protofl.transport import Transport
from protofl.wire import (
    DEVICE_KINDS,
    Config,
    Head,
    Header,
    Join,
    Limits,
    Message,
    Metrics,
    PublicSet,
    RoundStart,
    Status,
    decode_body,
    encode_message,
    read_header,
)
from protofl.wire import fast as fast_reader
from protofl.wire.messages import with_server_time

log = logging.getLogger("protofl.server")
_SAID: list[bool] = []  # the reference reader said once a process


def _say_reference_reader() -> None:
    """Where msgspec is missing every upload goes through the reference reader, ~1.8x the server's CPU per upload
    in-process (bench/results/AGGREGATOR.md, issue 60): said once, so that a slow server is not a mystery."""
    if not _SAID:
        _SAID.append(True)
        log.warning(
            "uploads are read by the reference reader (msgspec is not installed): ~1.8x the CPU per upload; "
            "pip install 'protofl-edge[fast]' for the compiled reader"
        )


SERVER_ID = topics.SERVER_ID

__all__ = ["SERVER_ID", "Aggregator", "RoundRecord", "decoder_limits"]


def decoder_limits(cfg: FederationConfig, model_values: int | None = None) -> Limits:
    """The federation's decoder limits (its largest message), known before any broker or machine exists:
    the local broker's packet limit is set from them."""
    adapter = (
        layout_size(adapter_layout(cfg.proto_dim, cfg.adapter_rank, cfg.num_classes))
        if cfg.federate == "adapter"
        else 0
    )
    return RoundPlan.from_config(cfg).limits(model_values, adapter)


# An input's journal entry: (topic, payload, client, kind, round, phase). Timers have no topic or payload: their
# kind (TIMER_KINDS) and fields say what fired.
Entry = tuple[str, bytes, str, str, int, str]
GRACE_OVER, DEADLINE = "grace_over", "deadline"
LAST_DROPS = 5  # drops `status` shows with their device and reason
MAX_REFUSERS = 10_000  # members whose refusals are counted (a fleet's; more would be a flood of strangers)
# Drops that say a device is misconfigured or its upload broken (not routine: a late or second copy): logged
# at warning, so that `start` without --verbose shows them.
LOUD_DROPS = frozenset({"invalid", "wrong_arch"})
# The presence state of a device that gave up on a round (edge_agent/ops/runner.py): the envelope says which.
GAVE_UP = "gave_up"
# The presence state the server says for a device the fleet revoked (broker_server/ops/enrol.py): it leaves at once.
REVOKED = "revoked"
# What the server says on a device's `down/` topic when it refuses its join for good (Status.state).
REFUSED = "refused"
TIMER_KINDS = (GRACE_OVER, DEADLINE)


class Steps(Protocol):
    """How the shell applies live inputs to its machine, and what it tells of a live phase boundary: the machine in
    memory (`InMemory`), or the machine made durable (durable.Durable: each input that changes state journaled
    before it is applied, a checkpoint at each boundary). A replay applies journaled inputs to the machine itself."""

    def take(self, inp: Input, entry: Entry) -> list[Effect]:
        """Check `inp` (raise Drop, nothing changed), make it durable if it changes state, apply it."""
        ...

    def boundary(self) -> None:
        """A phase opened or the federation finished, live (before that phase's round message goes out)."""
        ...


class InMemory:
    """The machine without durability: an input is checked, then applied."""

    def __init__(self, machine: RoundMachine) -> None:
        self.machine = machine

    def take(self, inp: Input, entry: Entry) -> list[Effect]:
        self.machine.accepts(inp)
        return self.machine.apply(inp)

    def boundary(self) -> None:
        return None


def _named(what: str | Head) -> str:
    if isinstance(what, str):
        return what
    return f"{what.kind} from {what.sender} (round {what.round}/{what.phase or '-'})"


class Aggregator:
    def __init__(
        self,
        cfg: FederationConfig,
        fed: str,
        transport: Transport,
        *,
        clock: Callable[[], float] = time.time,
        initial_params: np.ndarray | None = None,
        public: PublicSet | None = None,
        expected_clients: Sequence[str] | None = None,
        limits: Limits | None = None,
        members: Sequence[str] | None = None,
        max_clients: int | None = None,
        policy: ClipPolicy | None = None,
        on_round_end: Callable[[RoundRecord], None] | None = None,
        on_metrics: Callable[[str, int, Metrics, int], None] | None = None,
        offline_grace: float = OFFLINE_GRACE_S,
        closing: Closing | None = None,
        effects: Callable[[Effect], None] | None = None,
        time_scale: float = 1.0,
    ) -> None:
        self.fed = fed
        self.transport = transport
        self.clock = clock
        model_values = None if initial_params is None else int(np.asarray(initial_params).shape[0])
        self.limits = limits or decoder_limits(cfg, model_values)
        # Uploads read by msgspec's compiled schema where the `fast` extra is installed (the same messages,
        # ~2x the rate); the reference decoder reads everything else and says what is wrong with a bad one.
        self._fast = fast_reader.usable(self.limits)
        if not fast_reader.available():
            _say_reference_reader()
        self.machine = RoundMachine(
            cfg,
            self._encode,
            clock=clock,
            initial_params=initial_params,
            public=public,
            expected_clients=expected_clients,
            policy=policy,
            offline_grace=offline_grace,
            limits={"max_message_bytes": self.limits.max_message_bytes},
            closing=closing,
            time_scale=time_scale,
            fed=fed,
        )
        self.on_round_end = on_round_end
        self.on_metrics = on_metrics
        # Told of every effect carried out live, after the shell's own part: what is composed beside the shell
        # carries out the closing strategy's effects there (the coordinator: the shards' phase and close messages).
        self.effects = effects
        # How live inputs reach the machine: in memory, until `drive` makes them durable (durable.py).
        self.steps: Steps = InMemory(self.machine)
        self.members = frozenset(members) if members is not None else None  # None: anyone may join
        self.max_clients = max_clients
        self.dropped: dict[str, int] = {}
        # The last drops, each "REASON from DEVICE: why", for `status` (the counts say how many, these say whose).
        self.last_drops: deque[str] = deque(maxlen=LAST_DROPS)
        # Members that refused this federation (a technique or model they lack, another architecture, a config they
        # cannot serve): member -> (times, the last reason), for `status` and the live page (issue 55).
        self.refusals: dict[str, tuple[int, str]] = {}
        # Lines about what a member sent: at most LINES_PER_MINUTE per member (a member sets their pace).
        self.member_log = MemberLog(log)
        # Watching (broker_server/watch): told of every input applied live, after it changed the state.
        self.on_applied: Callable[[Input], None] | None = None

    # The machine's state, read by services, simulators and tests.
    @property
    def cfg(self) -> FederationConfig:
        return self.machine.cfg

    @property
    def model(self) -> ServerModel:
        return self.machine.model

    @property
    def round(self) -> int:
        return self.machine.round

    @property
    def finished(self) -> bool:
        return self.machine.finished

    @property
    def records(self) -> list[RoundRecord]:
        return self.machine.records

    @property
    def clients(self) -> dict[str, Join]:
        return self.machine.clients

    @property
    def expected_clients(self) -> list[str] | None:
        return self.machine.expected_clients

    def drive(self, steps: Steps) -> None:
        """Apply live inputs through `steps` from now on (durable.DurableState.bind: the machine made durable)."""
        self.steps = steps

    def start(self, resume: bool = False, subscribe: bool = True) -> None:
        """Announce the federation (or, `resume`d from a checkpoint and journal, its current round and
        phase again, with every time measured from now) and subscribe to uploads and presence (unless what
        is composed beside it subscribes, `subscribe` False: the coordinator)."""
        if resume:
            self.machine.resume(self.clock())
            self._run(self.machine.announce(), live=True)
        else:
            self._run(self.machine.start(), live=True)
        if subscribe:
            self.subscribe()

    def subscribe(self) -> None:
        for pattern, handler in self.subscriptions():
            self.transport.subscribe(pattern, handler)

    def subscriptions(self) -> list[tuple[str, Callable[[str, bytes], None]]]:
        """What the aggregator listens to: devices' `up/` topics and their presence."""
        return [(topics.up_all(self.fed), self.on_message), (topics.presence_all(self.fed), self.on_presence)]

    def reconnected(self) -> None:
        """The broker connection came back: presence seen meanwhile is stale (wills of a restarted broker),
        so devices get the resume grace to say they are online again, and the deadline starts again."""
        self.machine.resume(self.clock())

    def tick(self, now: float | None = None) -> None:
        """Fire the timers that are due: devices whose grace ran out, the open phase's deadline (call
        periodically). Each is journaled like a message, so a replay needs no clock."""
        for timer in self.machine.timers(self.clock() if now is None else now):
            if isinstance(timer, GraceOver):
                entry = ("", b"", timer.client, GRACE_OVER, self.round, "")
            else:
                entry = ("", b"", "", DEADLINE, timer.round, timer.phase.value)
            self.handle(timer, entry, "timer")

    def replay(self, topic: str, payload: bytes, client: str, kind: str, round_: int, phase: str) -> None:
        """Apply a journaled input again (after a restart): the same decoder, checks and machine as live,
        in journal order, so the state is rebuilt exactly; nothing is journaled or published again."""
        inp: Input | None
        if kind == GRACE_OVER:
            inp = GraceOver(client)
        elif kind == DEADLINE:
            inp = DeadlinePassed(round_, Phase(phase))
        elif topics.is_presence(topic):
            inp = self._presence_input(topic, payload)
        else:
            inp = self._received(topic, payload)
        what = f"journaled {kind} from {client or '-'} (round {round_})"
        if inp is None:
            log.warning("%s was refused on replay", what)
            return
        try:
            if not self.reapply(inp):
                log.warning("%s changed nothing on replay", what)
        except Drop as drop:
            self.drop(drop.reason, drop.detail, len(payload))
            log.warning("%s was refused on replay", what)

    def reapply(self, inp: Input) -> bool:
        """Apply a journaled input again, as `replay` does (what journaled it decoded it: the coordinator its
        shards' inputs); False if it changed nothing. Raises Drop if it is refused."""
        if not self.machine.accepts(inp):
            return False
        self._run(self.machine.apply(inp), live=False)
        return True

    # -- the error boundary ---------------------------------------------------------------------
    def on_message(self, topic: str, payload: bytes) -> None:
        inp = self._received(topic, payload)
        if inp is not None:
            env = inp.env
            self.handle(inp, (topic, payload, env.sender, env.kind, env.round, env.phase), env)

    def _received(self, topic: str, payload: bytes) -> Received | None:
        """A message from a device's `up/` topic as the machine's input, or None (a counted drop)."""
        topic_client = topics.client_of(topic)
        nbytes = len(payload)
        if self.members is not None and topic_client not in self.members:
            self.drop(
                "not_member", f"{topic}: '{topic_client}' is not a member of this federation", nbytes, topic_client
            )
            return None
        fast = fast_reader.read_upload(payload, self.limits) if self._fast else None
        if fast is not None:  # a valid upload, read whole in C: the checks below on its envelope, as for any
            head, msg = fast
            return self._judged(topic, head, nbytes, topic_client, msg)
        try:
            head = read_header(payload, self.limits)  # the envelope only: the body is not parsed yet
        except WireError as exc:
            self.drop("malformed", f"{topic}: {exc}", nbytes, topic_client)
            return None
        return self._judged(topic, head, nbytes, topic_client, None)

    def _judged(self, topic: str, head: Head, nbytes: int, topic_client: str, msg: Message | None) -> Received | None:
        """`head`'s message as the machine's input, or None (a counted drop); its body (a `Header`'s) is
        parsed only once its envelope has passed, unless `msg` (the fast reader's) is given: then the machine's
        `accepts` makes the checks `screen` would have made before the body, with the same drops."""
        # Who sent what to whom, from the envelope: a message that cannot be an upload from this topic's
        # device to this federation costs its envelope, never the parsing of its body.
        if head.sender != topic_client:
            self.drop(
                "sender_mismatch", f"topic says '{topic_client}', message says '{head.sender}'", nbytes, topic_client
            )
            return None
        if head.fed != self.fed:
            self.drop("wrong_fed", f"'{head.fed}' on federation '{self.fed}'", nbytes, topic_client)
            return None
        if head.kind not in DEVICE_KINDS:
            self.drop(
                "unexpected_kind",
                f"{head.kind} from {head.sender} (round {head.round}): a device sends "
                f"{', '.join(sorted(DEVICE_KINDS))} on up/",
                nbytes,
                topic_client,
            )
            return None
        if msg is None:
            try:
                self.machine.screen(head)  # round, phase, membership: still before the body
            except Drop as drop:
                self.drop(drop.reason, drop.detail, nbytes, topic_client)
                return None
            assert isinstance(head, Header)
            try:
                msg = decode_body(head.open(), self.limits)
            except WireError as exc:
                self.drop("malformed", f"{topic}: {exc}", nbytes, topic_client)
                return None
        if (
            isinstance(msg, Join)
            and self.max_clients is not None
            and head.sender not in self.clients
            and len(self.clients) >= self.max_clients
        ):
            self.drop(
                "max_clients",
                f"join from '{head.sender}': the federation has its {self.max_clients} clients (--max-clients)",
                nbytes,
                topic_client,
            )
            return None
        return Received(head, msg, nbytes)

    def on_presence(self, topic: str, payload: bytes) -> None:
        """A device's retained presence (its last will says "offline"): it leaves the round's expected set
        after its grace, and is a client again when it is back online. Only a client's own presence counts;
        the rest (strangers, old retained messages) is ignored without a trace."""
        inp = self._presence_input(topic, payload)
        if inp is not None:
            self.handle(inp, (topic, payload, inp.client, "status", self.round, ""), f"presence of {inp.client}")

    def _presence_input(self, topic: str, payload: bytes) -> Presence | None:
        client = topics.client_of(topic)
        if client not in self.clients and client not in self.machine.departed:
            if self.members is None or client in self.members:  # anyone who may join may say why it cannot
                self._cannot_serve(client, payload)
            return None
        try:
            head = read_header(payload, self.limits)
            # Checked on the envelope: a presence that is not this client's status costs no body parsing.
            if head.kind != Status.KIND or head.sender != client or head.fed != self.fed:
                self.drop("invalid", f"{topic}: not {client}'s presence", len(payload), client)
                return None
            msg = decode_body(head.open(), self.limits)
        except WireError as exc:
            self.drop("malformed", f"{topic}: {exc}", len(payload), client)
            return None
        assert isinstance(msg, Status)
        if msg.state == GAVE_UP:
            # It failed the round of its envelope every time it tried: it leaves that phase (still a client).
            said = printable(msg.detail) or f"gave up on round {head.round} {head.phase}"
            self.member_log(logging.WARNING, client, "device %s: %s", client, said)
            if client not in self.clients:
                return None
            return Presence(client, online=True, gave_up=(head.round, head.phase))
        if msg.detail and msg.state == "online":
            # A device reports a round that failed there on its presence topic (the rest is its profile).
            level = logging.WARNING if "failed" in msg.detail else logging.DEBUG
            self.member_log(level, client, "device %s: %s", client, printable(msg.detail))
        if (
            msg.state == "online"
            and self.max_clients is not None
            and client not in self.clients
            and len(self.clients) >= self.max_clients
        ):
            return None  # its place was taken while it was away
        return Presence(client, online=msg.state == "online", traits=msg.traits, revoked=msg.state == REVOKED)

    def _cannot_serve(self, client: str, payload: bytes) -> None:
        """A member of a fleet that cannot serve this run (a model it cannot import, a technique it lacks) says why
        on its presence instead of joining: the run's log says so (bounded per member). It is no client of this run:
        nothing else of its presence counts, and a presence that is not its own status is ignored, as a stranger's."""
        try:
            head = read_header(payload, self.limits)
            if head.kind != Status.KIND or head.sender != client or head.fed != self.fed:
                return
            msg = decode_body(head.open(), self.limits)
        except WireError:
            return
        if isinstance(msg, Status) and msg.state == "online" and msg.detail.startswith(topics.CANNOT_SERVE_PREFIXES):
            said = printable(msg.detail)
            last = self.refusals.get(client, (0, ""))[1]
            if not (last and last in said):  # a device repeating the server's own refusal is not another one
                self.refused(client, said)
            self.member_log(logging.WARNING, client, "device %s: %s", client, said)

    def handle(self, inp: Input, entry: Entry, what: str | Head) -> None:
        """Check, journal (if it changes state and the machine is durable) and apply one input; any failure is a
        counted drop. `what` names the input in a drop's line (a message's envelope: its line is only written for a
        drop)."""
        nbytes, client = len(entry[1]), entry[2]
        try:
            effects = self.steps.take(inp, entry)  # durable: on disk before it changes anything (and before the ack)
        except Drop as drop:
            self.drop(drop.reason, drop.detail, nbytes, client)
            if drop.reason in ("wrong_arch", "cannot_train"):  # its join, refused for good: it is told why
                self.refused(client, printable(drop.detail))
                self._refuse(client, drop.detail)
            return
        except (WireError, ValueError) as exc:
            self.drop("invalid", f"{_named(what)}: {exc}", nbytes, client)
            return
        except Exception as exc:  # a bug in a stage must not take the federation down with it
            log.exception("unexpected error while handling %s", _named(what))
            self.drop("invalid", f"{_named(what)}: {type(exc).__name__}: {exc}", nbytes, client)
            return
        if self.on_applied is not None:
            self.on_applied(inp)
        self._run(effects, live=True)

    def drop(self, reason: str, detail: str, nbytes: int, client: str = "") -> None:
        """Count and log a drop (the error boundary's; also what is composed beside the shell refuses), with its
        reason and the device it came from (`client`: its topic's; "" where no device is known)."""
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        who = client or "-"
        detail = printable(detail)  # it may quote what the member sent
        level = logging.WARNING if reason in LOUD_DROPS else logging.INFO
        self.member_log(level, who, "dropped a message from %s (%s, %d bytes): %s", who, reason, nbytes, detail)
        self.last_drops.append(f"{reason} from {who}: {detail}")

    def refused(self, client: str, reason: str) -> None:
        """Count a refusal: `client` cannot take part in this federation, for `reason` (said by it, or the
        server's: another architecture). Its line in the log is the caller's."""
        times, _ = self.refusals.get(client, (0, ""))
        if times or len(self.refusals) < MAX_REFUSERS:
            self.refusals[client] = (times + 1, reason)

    def _refuse(self, client: str, why: str) -> None:
        """Tell `client`, on its own `down/` topic, that its join is refused and why (the device stops)."""
        if not client:
            return
        payload = encode_message(Status(state=REFUSED, detail=why), fed=self.fed, sender=SERVER_ID)
        self.transport.publish(topics.down(self.fed, client), payload, qos=1)

    # -- effects --------------------------------------------------------------------------------
    def _run(self, effects: list[Effect], *, live: bool) -> None:
        """Carry out the machine's effects. While replaying a journal (`live` False) nothing is published
        or checkpointed (the restarted aggregator announces its state once, afterwards); closed rounds
        are still handed on, so that a round the crash kept from the rounds log gets its line."""
        for effect in effects:
            if isinstance(effect, Publish):
                if live:
                    self.transport.publish(self._topic(effect.message), effect.payload, retain=True)
            elif isinstance(effect, Steer):
                if live:  # one device's own topic, not retained: it is about this round only
                    self.transport.publish(topics.down(self.fed, effect.client), effect.payload, qos=1)
            elif isinstance(effect, Boundary):
                if live:
                    self.steps.boundary()  # durable: the checkpoint, before the phase's round message goes out
            elif isinstance(effect, RoundClosed):
                if self.on_round_end is not None:
                    self.on_round_end(effect.record)
            elif isinstance(effect, MetricsIn):
                if self.on_metrics is not None:
                    self.on_metrics(effect.client, effect.round, effect.metrics, effect.nbytes)
            if live and self.effects is not None:
                self.effects(effect)

    def _encode(self, msg: Message, round_: int, phase: str) -> bytes:
        if isinstance(msg, Status):  # the retained server status says when (a device's doctor checks its clock)
            msg = Status(state=msg.state, detail=with_server_time(msg.detail, time.time()), traits=msg.traits)
        return encode_message(msg, fed=self.fed, sender=SERVER_ID, round=round_, phase=phase)

    def _topic(self, msg: Message) -> str:
        if isinstance(msg, Config):
            return topics.config(self.fed)
        if isinstance(msg, PublicSet):
            return topics.public(self.fed)
        if isinstance(msg, RoundStart):
            return topics.round_(self.fed)
        if isinstance(msg, Status):
            return topics.server_status(self.fed)
        raise TypeError(f"the aggregator does not publish {type(msg).__name__}")

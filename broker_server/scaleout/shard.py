"""One aggregator shard: screens, folds and journals its share of the uploads (docs/design.md, "Scale-out").

N shards subscribe to the devices' `up/` topics through one MQTT 5 shared subscription, so the broker hands
each upload to one of them. A shard knows the open phase from the coordinator's retained `shards/phase`
message (the machine at the phase's boundary: model, clipping centres and radii), so each folds exactly as
one aggregator would. For each upload it: checks the envelope (member, sender, federation, round, phase,
kind; a second one from the same device is answered by saying again that it has it), decodes and folds it
(`PhaseRun.add`: the plan's and the folds' checks, clipping), appends the bytes to its journal (fsynced
before the broker gets the acknowledgement) and tells the coordinator (`progress`). Joins and metrics it
passes on to the coordinator unchanged (`shards/relay/<client>`). When the coordinator closes the phase
(`shards/close`, with the uploads it counted from each shard) the shard answers with its partial phase
over exactly those (normally all it folded; if the coordinator counted a duplicate from another shard, or
refused one, the shard folds its journal again without it), retained so that a restarted coordinator gets it.

Restart (SIGKILL included): the shard reads the phase it was in and its journal, folds the journal again
(the same bytes through the same checks: the same sums), tells the coordinator again what it has (progress
is idempotent), and takes up its broker session, where the uploads it never acknowledged wait. numpy only.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from broker_server.core.rounds import UPLOAD_KINDS, Drop, RoundMachine
from broker_server.core.shell import SERVER_ID
from broker_server.core.stages import PhaseRun, check_mergeable
from broker_server.ops.security import shard_id
from broker_server.scaleout import shard_wire
from broker_server.scaleout.shard_log import ShardLog
from protofl import topics
from protofl.algorithms.robust import ClipPolicy
from protofl.checkpoint import read_checkpoint, write_checkpoint
from protofl.config import FederationConfig
from protofl.errors import WireError
from protofl.plan import Phase, Upload
from protofl.transport import Transport
from protofl.wire import (
    DEFAULT_LIMITS,
    Header,
    Join,
    Message,
    Metrics,
    ParamsUpload,
    ProtoUpload,
    decode_body,
    encode_message,
    read_header,
)
from protofl.wire.fast import read_upload, usable

log = logging.getLogger("protofl.shard")

__all__ = ["Shard", "shard_id"]


class Shard:
    """A shard has no config of its own: the coordinator's phase message brings the federation's config,
    clipping policy, decoder limits and member list with the machine's state."""

    def __init__(
        self,
        fed: str,
        transport: Transport,
        *,
        shard: str,
        state_dir: Path | str | None = None,
        fsync: bool = True,
        group_commit: bool = False,
        batch: bool = False,
    ) -> None:
        self.fed, self.transport, self.shard = fed, transport, shard
        self.limits = DEFAULT_LIMITS  # the envelope of a phase message; the federation's come with it
        self._fast = usable(self.limits)
        self.members: frozenset[str] | None = None
        self.cfg: FederationConfig | None = None
        self.policy: ClipPolicy | None = None
        self.dir = Path(state_dir) if state_dir is not None else None
        # group_commit: the journal is fsynced by `sync()` (the transport's before_ack hook), once a batch.
        self.log = ShardLog(self.dir / "journal.log" if self.dir else None, fsync=fsync, group_commit=group_commit)
        self.machine: RoundMachine | None = None
        self.run: PhaseRun | None = None
        self.where: tuple[int, str] = (0, "")  # the phase being folded (round, phase); (0, "") before any
        self.finished = False
        self.closed = False  # the coordinator closed this phase: its partial is sent
        self.accepted: dict[tuple[str, str], int] = {}  # (sender, kind) -> bytes, in this phase
        self.early: set[tuple[int, str, str, str]] = set()  # journaled for a later phase: (round, phase, sender, kind)
        self._phase_payload = b""
        self._partial_payload = b""
        # batch: progress waits for `flush()` (the service calls it after each batch the transport pumps),
        # one message for many uploads; otherwise it goes out at once.
        self.batch = batch
        self._pending: list[list[Any]] = []
        self.dropped: dict[str, int] = {}
        self.folded = 0

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Resume from the state dir (if any), then listen: the coordinator's topics first (their retained
        messages say which phase is open), then the uploads."""
        saved = read_checkpoint(self.dir / "phase.bin") if self.dir is not None else None
        if saved is not None:
            self._open(saved["payload"], persist=False)
            log.warning(
                "%s resumed round %d %s with %d upload(s) from its journal", self.shard, *self.where, len(self.accepted)
            )
        self.transport.subscribe(topics.shards(self.fed, "phase"), self.on_phase)
        self.transport.subscribe(topics.shards(self.fed, "close"), self.on_close)
        self.transport.subscribe(topics.shared_up(self.fed), self.on_message)

    def sync(self) -> None:
        self.log.sync()

    def close(self) -> None:
        self.log.close()

    # -- the coordinator's messages -------------------------------------------------------------
    def _control(self, topic: str, payload: bytes, kind: str) -> dict[str, Any] | None:
        """The coordinator's `kind` message, or None (logged: a coordinator of another version)."""
        try:
            return shard_wire.decode(payload, kind, self._max_control())
        except WireError as exc:
            log.error("%s: %s", topic, exc)
            return None

    def on_phase(self, topic: str, payload: bytes) -> None:
        msg = self._control(topic, payload, "phase") if payload else None  # empty: cleared by a new coordinator
        if msg is None:
            return
        if msg["finished"]:
            self.finished, self.run = True, None
            return
        if _order(msg["round"], msg["phase"]) < _order(*self.where):
            log.warning(
                "%s: the coordinator opens round %d %s, before this shard's round %d %s: a shard's state "
                "dir belongs to one federation; start it with a new --state-dir for a new one",
                self.shard,
                msg["round"],
                msg["phase"],
                *self.where,
            )
        if _order(msg["round"], msg["phase"]) <= _order(*self.where):
            return  # the phase it already folds (the retained message again), or an older one
        self._open(payload, persist=True)

    def _open(self, payload: bytes, *, persist: bool) -> None:
        """Fold the phase `payload` opens: with the uploads journaled for it (after a restart, or ones that
        arrived before the phase message), whose progress goes to the coordinator (again: it is idempotent)."""
        msg = shard_wire.decode(payload, "phase", self._max_control())
        self.cfg = FederationConfig.from_dict(msg["machine"]["cfg"])
        self.policy = shard_wire.policy_of(msg["policy"])
        check_mergeable(self.cfg, self.policy)  # the coordinator checked too: a shard of another version may not
        self.limits = shard_wire.limits_of(msg["limits"])
        self._fast = usable(self.limits)
        self.members = frozenset(msg["members"]) if msg["members"] is not None else None
        machine = self._machine(msg)
        self.machine, self.run = machine, machine.run
        self.flush()  # the previous phase's progress goes out with its own round and phase
        self.where, self.closed, self.finished = (msg["round"], msg["phase"]), False, False
        self.accepted, self.early, self._phase_payload = {}, set(), payload
        if persist and self.dir is not None:
            write_checkpoint(self.dir / "phase.bin", {"payload": payload})
        here = _order(*self.where)
        self.log.keep(lambda r: _order(r.round, r.phase) >= here)  # the closed phases' uploads go
        for rec in self.log.records():
            if (rec.round, rec.phase) != self.where:
                self.early.add((rec.round, rec.phase, rec.client, rec.kind))
                continue
            try:
                self._fold(rec.topic, rec.payload, journaled=True)
            except (Drop, WireError, ValueError) as exc:
                log.warning("%s: journaled %s from %s refused: %s", self.shard, rec.kind, rec.client, exc)
        for key in sorted(self.accepted):
            self._progress(*key)
        log.info("%s: round %d %s open (%d upload(s) journaled for it)", self.shard, *self.where, len(self.accepted))

    def on_close(self, topic: str, payload: bytes) -> None:
        msg = self._control(topic, payload, "close") if payload else None
        if msg is None:
            return
        if (msg["round"], msg["phase"]) != self.where or self.run is None:
            return  # another phase's (an old retained one, or one this shard never saw: nothing of it here)
        if self.closed:
            self.transport.publish(topics.shards(self.fed, "partial", self.shard), self._partial_payload, retain=True)
            return
        self.flush()
        mine = {(str(s), str(k)) for s, k in msg["assignment"].get(self.shard, [])}
        run = self.run if mine == set(self.accepted) else self._refold(mine)
        self.closed = True
        self._partial_payload = shard_wire.encode(
            "partial", shard=self.shard, round=self.where[0], phase=self.where[1], uploads=len(mine), part=run.partial()
        )
        self.transport.publish(topics.shards(self.fed, "partial", self.shard), self._partial_payload, retain=True)
        log.info("%s: round %d %s partial sent (%d upload(s))", self.shard, *self.where, len(mine))

    def _refold(self, keep: set[tuple[str, str]]) -> PhaseRun:
        """The phase folded again from the journal with only the uploads in `keep` (the coordinator counted
        another shard's copy of some, or refused some)."""
        missing = keep - set(self.accepted)
        if missing:
            log.error("%s: the coordinator counts uploads this shard never folded: %s", self.shard, sorted(missing))
        machine = self._machine(shard_wire.decode(self._phase_payload, "phase", self._max_control()))
        assert machine.run is not None
        for rec in self.log.records():
            if (rec.round, rec.phase) == self.where and (rec.client, rec.kind) in keep:
                upload = decode_body(read_header(rec.payload, self.limits).open(), self.limits)
                machine.run.add(Upload(rec.kind), upload, rec.client)
        log.warning(
            "%s: round %d %s folded again without %d upload(s) the coordinator took from elsewhere",
            self.shard,
            *self.where,
            len(set(self.accepted) - keep),
        )
        return machine.run

    # -- devices' messages ------------------------------------------------------------------------
    def on_message(self, topic: str, payload: bytes) -> None:
        try:
            self._fold(topic, payload, journaled=False)
        except Drop as drop:
            self._drop(drop.reason, f"{topic}: {drop.detail}")
        except (WireError, ValueError) as exc:
            self._drop("invalid", f"{topic}: {exc}")
        except Exception as exc:  # a bug in a fold must not take the shard down
            log.exception("unexpected error on %s", topic)
            self._drop("invalid", f"{topic}: {type(exc).__name__}: {exc}")

    def _fold(self, topic: str, payload: bytes, *, journaled: bool) -> None:
        client = topics.client_of(topic)
        if self.members is not None and client not in self.members:
            raise Drop("not_member", f"'{client}' is not a member of this federation")
        # An upload read whole by the compiled reader where the `fast` extra is installed (protofl/wire/fast.py).
        fast = read_upload(payload, self.limits) if self._fast else None
        head = fast[0] if fast is not None else read_header(payload, self.limits)
        if head.sender != client or head.fed != self.fed:
            raise Drop("sender_mismatch", f"'{head.sender}' of '{head.fed}' on {client}'s topic")
        if head.kind in (Join.KIND, Metrics.KIND):
            self.transport.publish(topics.shards(self.fed, "relay", client), payload)
            return
        if head.kind not in UPLOAD_KINDS:
            raise Drop("unexpected_kind", f"{head.kind} from {client}")
        if _order(head.round, head.phase) > _order(*self.where):
            self._hold(topic, payload, head.round, head.phase, client, head.kind)
            return
        if self.run is None or self.closed or (head.round, head.phase) != self.where:
            raise Drop(
                "stale",
                f"{head.kind} for round {head.round}/{head.phase}; this shard folds {self.where}"
                + (" (closed)" if self.closed else ""),
            )
        key = (client, head.kind)
        if key in self.accepted:
            self._progress(*key)  # the coordinator may not have heard it (a restart): idempotent
            raise Drop("duplicate", f"second {head.kind} from {client}")
        if fast is not None:
            msg: Message = fast[1]
        else:
            assert isinstance(head, Header)
            msg = decode_body(head.open(), self.limits)
        assert isinstance(msg, (ProtoUpload, ParamsUpload)) and self.machine is not None
        self.machine.check_base(msg)
        self.run.add(Upload(head.kind), msg, client)  # checks all of it, then folds
        self.accepted[key] = len(payload)
        self.folded += 1
        if not journaled:
            self.log.append(topic, payload, client, head.kind, head.round, head.phase)
            self._progress(*key)

    def _hold(self, topic: str, payload: bytes, round_: int, phase: str, client: str, kind: str) -> None:
        """An upload for a phase this shard has not heard of yet (it restarted, and its session delivered the
        upload before the retained phase message): journaled, and folded when that phase opens."""
        if round_ > self.where[0] + 1 or phase not in _PHASES:
            raise Drop("wrong_phase", f"{kind} for round {round_}/{phase}; this shard folds {self.where}")
        key = (round_, phase, client, kind)
        if key in self.early:
            raise Drop("duplicate", f"second {kind} from {client} for round {round_}/{phase}")
        self.log.append(topic, payload, client, kind, round_, phase)
        self.early.add(key)

    def _progress(self, sender: str, kind: str) -> None:
        self._pending.append([sender, kind, self.accepted[(sender, kind)]])
        if not self.batch:
            self.flush()

    def flush(self) -> None:
        """Tell the coordinator what this shard folded since the last flush: one message (a batch's worth)."""
        for start in range(0, len(self._pending), PROGRESS_BATCH):
            self.transport.publish(
                topics.shards(self.fed, "progress", self.shard),
                shard_wire.encode(
                    "progress",
                    shard=self.shard,
                    round=self.where[0],
                    phase=self.where[1],
                    entries=self._pending[start : start + PROGRESS_BATCH],
                ),
            )
        self._pending = []

    # -- helpers ----------------------------------------------------------------------------------
    def _machine(self, msg: dict[str, Any]) -> RoundMachine:
        """The coordinator's machine at the phase's boundary (this shard folds with its `run`)."""
        assert self.cfg is not None
        machine = RoundMachine(self.cfg, self._encode, clock=lambda: 0.0, policy=self.policy)
        machine.restore(msg["machine"])
        return machine

    def _max_control(self) -> int:
        return max(256 << 20, 8 * self.limits.max_message_bytes)

    def _encode(self, msg: Message, round_: int, phase: str) -> bytes:
        return encode_message(msg, fed=self.fed, sender=SERVER_ID, round=round_, phase=phase)

    def _drop(self, reason: str, detail: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        log.info("%s dropped (%s): %s", self.shard, reason, detail)


_PHASES = (Phase.PROTO.value, Phase.TRAIN.value)
PROGRESS_BATCH = 4096  # uploads per progress message at most (about 100 KB)


def _order(round_: int, phase: str) -> tuple[int, int]:
    """Phases in the order they open: (round, its phase's place)."""
    return round_, _PHASES.index(phase) if phase in _PHASES else -1

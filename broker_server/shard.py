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
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from broker_server import shard_wire
from broker_server.journal import Journal, scan
from broker_server.rounds import UPLOAD_KINDS, Drop, RoundMachine
from broker_server.shell import SERVER_ID, decoder_limits
from broker_server.stages import PhaseRun, check_mergeable
from protofl import topics
from protofl.algorithms.robust import ClipPolicy
from protofl.checkpoint import read_checkpoint, write_checkpoint
from protofl.config import FederationConfig
from protofl.errors import WireError
from protofl.plan import Phase, Upload
from protofl.transport import Transport
from protofl.wire import (
    Join,
    Limits,
    Message,
    Metrics,
    ParamsUpload,
    ProtoUpload,
    PublicSet,
    decode_body,
    encode_message,
    read_header,
)

log = logging.getLogger("protofl.shard")

__all__ = ["Shard", "shard_id"]


def shard_id(index: int) -> str:
    return f"shard-{index}"


class Shard:
    def __init__(self, cfg: FederationConfig, fed: str, transport: Transport, *, shard: str,
                 state_dir: Path | str | None = None, members: Sequence[str] | None = None,
                 limits: Limits | None = None, policy: ClipPolicy | None = None,
                 initial_params: np.ndarray | None = None, public: PublicSet | None = None,
                 fsync: bool = True) -> None:
        check_mergeable(cfg, policy)  # NotMergeable with its reason before anything runs
        self.cfg, self.fed, self.transport, self.shard = cfg, fed, transport, shard
        model_values = None if initial_params is None else int(np.asarray(initial_params).shape[0])
        self.limits = limits or decoder_limits(cfg, model_values)
        self.members = frozenset(members) if members is not None else None
        self._machine_args: dict[str, Any] = dict(initial_params=initial_params, public=public, policy=policy)
        self.dir = Path(state_dir) if state_dir is not None else None
        self.fsync = fsync
        self.machine: RoundMachine | None = None
        self.run: PhaseRun | None = None
        self.where: tuple[int, str] = (0, "")  # the phase being folded (round, phase); (0, "") before any
        self.finished = False
        self.closed = False  # the coordinator closed this phase: its partial is sent
        self.accepted: dict[tuple[str, str], int] = {}  # (sender, kind) -> bytes, in this phase
        self.records: list[tuple[str, bytes, str, str]] = []  # without a state dir: (topic, payload, sender, kind)
        self.journal: Journal | None = None
        self._phase_payload = b""
        self._partial_payload = b""
        self.dropped: dict[str, int] = {}
        self.folded = 0

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Resume from the state dir (if any), then listen: the coordinator's topics first (their retained
        messages say which phase is open), then the uploads."""
        self._resume()
        self.transport.subscribe(topics.shards(self.fed, "phase"), self.on_phase)
        self.transport.subscribe(topics.shards(self.fed, "close"), self.on_close)
        self.transport.subscribe(topics.shared_up(self.fed), self.on_message)

    def _resume(self) -> None:
        if self.dir is None:
            return
        saved = read_checkpoint(self.dir / "phase.bin")
        if saved is None:
            return
        self._open(saved["payload"], persist=False)
        if self.journal is not None:
            for rec in self.journal.records:
                if (rec.round, rec.phase) == self.where:
                    try:
                        self._fold(rec.topic, rec.payload, replay=True)
                    except (Drop, WireError, ValueError) as exc:
                        log.warning("%s: journaled %s from %s refused on replay: %s", self.shard, rec.kind,
                                    rec.client, exc)
            self.journal.records = []
        log.warning("%s resumed round %d %s: %d upload(s) from its journal", self.shard, *self.where,
                    len(self.accepted))
        for key in sorted(self.accepted):
            self._progress(*key)

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()

    # -- the coordinator's messages -------------------------------------------------------------
    def _control(self, topic: str, payload: bytes, kind: str) -> dict[str, Any] | None:
        """The coordinator's `kind` message, or None (logged: a coordinator of another version)."""
        try:
            return shard_wire.decode(payload, kind, self._max_control())
        except WireError as exc:
            log.error("%s: %s", topic, exc)
            return None

    def on_phase(self, topic: str, payload: bytes) -> None:
        msg = self._control(topic, payload, "phase")
        if msg is None:
            return
        if msg["finished"]:
            self.finished, self.run = True, None
            return
        if self._order(msg["round"], msg["phase"]) <= self._order(*self.where):
            return  # the phase it already folds (the retained message again), or an older one
        self._open(payload, persist=True)

    def _open(self, payload: bytes, *, persist: bool) -> None:
        msg = shard_wire.decode(payload, "phase", self._max_control())
        machine = RoundMachine(self.cfg, self._encode, clock=lambda: 0.0, **self._machine_args)
        machine.restore(msg["machine"])
        self.machine, self.run = machine, machine.run
        self.where, self.closed, self.finished = (msg["round"], msg["phase"]), False, False
        self.accepted, self.records, self._phase_payload = {}, [], payload
        if self.dir is not None:
            if persist:
                write_checkpoint(self.dir / "phase.bin", {"payload": payload})
            # One journal per phase: a new phase starts it again (the phase file above is the older one's end).
            if self.journal is not None:
                self.journal.close()
            path = self.dir / "journal.log"
            if persist and path.exists():
                os.unlink(path)
            self.journal = Journal(path, fsync=self.fsync)
        log.info("%s: round %d %s open", self.shard, *self.where)

    def on_close(self, topic: str, payload: bytes) -> None:
        msg = self._control(topic, payload, "close")
        if msg is None:
            return
        if (msg["round"], msg["phase"]) != self.where or self.run is None:
            return  # another phase's (an old retained one, or one this shard never saw: nothing of it here)
        if self.closed:
            self.transport.publish(topics.shards(self.fed, "partial", self.shard), self._partial_payload, retain=True)
            return
        mine = {(str(s), str(k)) for s, k in msg["assignment"].get(self.shard, [])}
        run = self.run if mine == set(self.accepted) else self._refold(mine)
        self.closed = True
        self._partial_payload = shard_wire.encode("partial", shard=self.shard, round=self.where[0],
                                                  phase=self.where[1], uploads=len(mine), part=run.partial())
        self.transport.publish(topics.shards(self.fed, "partial", self.shard), self._partial_payload, retain=True)
        log.info("%s: round %d %s partial sent (%d upload(s))", self.shard, *self.where, len(mine))

    def _refold(self, keep: set[tuple[str, str]]) -> PhaseRun:
        """The phase folded again from the journal with only the uploads in `keep` (the coordinator counted
        another shard's copy of some, or refused some)."""
        missing = keep - set(self.accepted)
        if missing:
            log.error("%s: the coordinator counts uploads this shard never folded: %s", self.shard, sorted(missing))
        machine = RoundMachine(self.cfg, self._encode, clock=lambda: 0.0, **self._machine_args)
        machine.restore(shard_wire.decode(self._phase_payload, "phase", self._max_control())["machine"])
        assert machine.run is not None
        records = (self.records if self.journal is None else
                   [(r.topic, r.payload, r.client, r.kind) for r in scan(self.journal.path.read_bytes())[0]
                    if (r.round, r.phase) == self.where])
        for _, payload, sender, kind in records:
            if (sender, kind) in keep:
                msg = decode_body(read_header(payload, self.limits).open(), self.limits)
                machine.run.add(Upload(kind), msg)
        log.warning("%s: round %d %s folded again without %d upload(s) the coordinator took from elsewhere",
                    self.shard, *self.where, len(set(self.accepted) - keep))
        return machine.run

    # -- devices' messages ------------------------------------------------------------------------
    def on_message(self, topic: str, payload: bytes) -> None:
        try:
            self._fold(topic, payload, replay=False)
        except Drop as drop:
            self._drop(drop.reason, f"{topic}: {drop.detail}")
        except (WireError, ValueError) as exc:
            self._drop("invalid", f"{topic}: {exc}")
        except Exception as exc:  # a bug in a fold must not take the shard down
            log.exception("unexpected error on %s", topic)
            self._drop("invalid", f"{topic}: {type(exc).__name__}: {exc}")

    def _fold(self, topic: str, payload: bytes, *, replay: bool) -> None:
        client = topics.client_of(topic)
        if self.members is not None and client not in self.members:
            raise Drop("not_member", f"'{client}' is not a member of this federation")
        head = read_header(payload, self.limits)
        if head.sender != client or head.fed != self.fed:
            raise Drop("sender_mismatch", f"'{head.sender}' of '{head.fed}' on {client}'s topic")
        if head.kind in (Join.KIND, Metrics.KIND):
            self.transport.publish(topics.shards(self.fed, "relay", client), payload)
            return
        if head.kind not in UPLOAD_KINDS:
            raise Drop("unexpected_kind", f"{head.kind} from {client}")
        if self.run is None or self.closed or (head.round, head.phase) != self.where:
            raise Drop("stale" if self._order(head.round, head.phase) <= self._order(*self.where) else "early",
                       f"{head.kind} for round {head.round}/{head.phase}; this shard folds {self.where}"
                       + (" (closed)" if self.closed else ""))
        key = (client, head.kind)
        if key in self.accepted:
            self._progress(*key)  # the coordinator may not have heard it (a restart): idempotent
            raise Drop("duplicate", f"second {head.kind} from {client}")
        msg = decode_body(head.open(), self.limits)
        assert isinstance(msg, (ProtoUpload, ParamsUpload)) and self.machine is not None
        self.machine.check_base(msg)
        self.run.add(Upload(head.kind), msg)  # checks all of it, then folds
        self.accepted[key] = len(payload)
        self.folded += 1
        if replay:
            return
        if self.journal is not None:
            self.journal.append(topic, payload, client, head.kind, head.round, head.phase)
        else:
            self.records.append((topic, payload, client, head.kind))
        self._progress(*key)

    def _progress(self, sender: str, kind: str) -> None:
        self.transport.publish(topics.shards(self.fed, "progress", self.shard), shard_wire.encode(
            "progress", shard=self.shard, round=self.where[0], phase=self.where[1], sender=sender, kind=kind,
            nbytes=self.accepted[(sender, kind)]))

    # -- helpers ----------------------------------------------------------------------------------
    def _order(self, round_: int, phase: str) -> tuple[int, int]:
        phases = [p.value for p in (Phase.PROTO, Phase.TRAIN)]
        return round_, phases.index(phase) if phase in phases else -1

    def _max_control(self) -> int:
        return max(64 << 20, 8 * self.limits.max_message_bytes)

    def _encode(self, msg: Message, round_: int, phase: str) -> bytes:
        return encode_message(msg, fed=self.fed, sender=SERVER_ID, round=round_, phase=phase)

    def _drop(self, reason: str, detail: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        log.info("%s dropped (%s): %s", self.shard, reason, detail)

"""The coordinator of N aggregator shards (docs/design.md, "Sharded aggregators"), numpy only: the one round machine
of a sharded federation, behind the same I/O shell as one aggregator (shell.py), its phases closed by the sharded
closing strategy (shard_closing.py). The coordinator is composed beside that shell, not a kind of it: it talks to
the shards over the transport and hands the shell their inputs through its public interface (`handle`, `reapply`),
and carries out the strategy's effects the shell passes on (`effects`).

It does not see uploads: each shard tells it which ones it folded (`progress`), and the machine places
those exactly as it would the uploads themselves (membership, round, phase, one per device and kind, a
copy another shard also folded refused as a duplicate), so quorum, deadlines and `--min-clients` behave
as with one aggregator. Joins and metrics reach it through the shards (`shards/relay/<client>`), presence
directly. At each phase boundary it publishes the machine's state to the shards (`shards/phase`, retained),
so that every shard clips around the same centres with the same radii; when a phase closes it asks each
shard for its partial phase over the uploads it counted from it (`shards/close`), merges them once all N
are in, finishes the phase and publishes the round, as one aggregator would. Progress and the merged
partials go to the journal like any input, so a restarted coordinator rebuilds the same state.

A shard whose partial does not come within `shard_timeout` seconds of the close (a remote shard whose
machine is gone: `start` restarts the shards it spawned, which resume from their journals in seconds) is given
up on for that phase once another shard's partial is in: the phase closes with the other shards' partials,
without the uploads it folded (counted as `shard_lost` drops, their senders as if they had not sent them), and
that decision is journaled too. Later closes do not wait for it; it counts again from the first upload it
reports (run again, it resumes).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from broker_server.core.rounds import Boundary, Drop, Effect, Input, RoundMachine
from broker_server.core.shell import Aggregator, Steps
from broker_server.core.stages import ServerModel, check_mergeable
from broker_server.ops.security import shard_id, site_shard
from broker_server.scaleout import shard_wire
from broker_server.scaleout.shard_closing import Gather, Partials, Progress, ShardClosing, ShardLost
from broker_server.settings import DEFAULT_SHARD_TIMEOUT_S
from protofl import topics
from protofl.config import FederationConfig
from protofl.errors import WireError
from protofl.transport import Transport
from protofl.wire import Join, Limits

log = logging.getLogger("protofl.server")

__all__ = ["Coordinator"]
PROGRESS, PARTIALS, LOST = "progress", "partials", "shard_lost"


class Coordinator:
    """`shards` shards fold the uploads on this broker; each of `sites` is a site pre-aggregator (a shard at a
    site broker bridged to this one, named site-<name>) that folds its site's. Without shards the coordinator
    folds this broker's uploads itself and merges the sites' partials into them. `shell_options` are the shell's
    (shell.Aggregator: clock, expected clients, members, policy, ...)."""

    def __init__(
        self,
        cfg: FederationConfig,
        fed: str,
        transport: Transport,
        *,
        shards: int,
        sites: Sequence[str] = (),
        shard_timeout: float = DEFAULT_SHARD_TIMEOUT_S,
        **shell_options: Any,
    ) -> None:
        if not shard_timeout > 0:
            raise ValueError(f"the shard timeout must be > 0 seconds, got {shard_timeout}")
        if shards < 0 or (shards == 0 and not sites):
            raise ValueError(f"a sharded federation needs at least 1 shard or site, got {shards} and {list(sites)}")
        check_mergeable(cfg, shell_options.get("policy"))  # NotMergeable, with its reason, before anything runs
        self.closing = ShardClosing()
        self.shell = Aggregator(cfg, fed, transport, closing=self.closing, effects=self._carry_out, **shell_options)
        self.fed, self.transport = fed, transport
        self.direct = shards == 0  # this broker's uploads come to the coordinator itself
        self.shards = [shard_id(i) for i in range(shards)] + [site_shard(s) for s in sites]
        self.shard_timeout = shard_timeout
        self._parts: dict[str, dict[str, Any]] = {}  # the closing phase's partials received so far
        self._lost: set[str] = set()  # shards given up on in the closing phase (no partial within the timeout)
        self._waiting: dict[str, list[Progress]] = {}  # progress of devices whose join is not in yet
        self._closing_since: float | None = None  # when the open phase began waiting for partials
        self._said = 0.0

    # -- the shell's state, read by the service, watchers, durability and tests ------------------------
    @property
    def machine(self) -> RoundMachine:
        return self.shell.machine

    @property
    def cfg(self) -> FederationConfig:
        return self.shell.cfg

    @property
    def model(self) -> ServerModel:
        return self.shell.model

    @property
    def round(self) -> int:
        return self.shell.round

    @property
    def finished(self) -> bool:
        return self.shell.finished

    @property
    def records(self) -> list[Any]:
        return self.shell.records

    @property
    def clients(self) -> dict[str, Join]:
        return self.shell.clients

    @property
    def dropped(self) -> dict[str, int]:
        return self.shell.dropped

    @property
    def last_drops(self) -> deque[str]:
        return self.shell.last_drops

    @property
    def refusals(self) -> dict[str, tuple[int, str]]:
        return self.shell.refusals

    @property
    def members(self) -> frozenset[str] | None:
        return self.shell.members

    @property
    def expected_clients(self) -> list[str] | None:
        return self.shell.expected_clients

    @property
    def limits(self) -> Limits:
        return self.shell.limits

    @property
    def on_applied(self) -> Callable[[Input], None] | None:
        return self.shell.on_applied

    @on_applied.setter
    def on_applied(self, observe: Callable[[Input], None] | None) -> None:
        self.shell.on_applied = observe  # watchers (FederationObserver) see what the shell applies

    def drive(self, steps: Steps) -> None:
        """The shell's machine made durable (durable.DurableState.bind); journal entries replay through `replay`."""
        self.shell.drive(steps)

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self, resume: bool = False) -> None:
        if not resume:  # a previous federation's phase, close and partials must not reach this one's shards
            for topic in (
                topics.shards(self.fed, "phase"),
                topics.shards(self.fed, "close"),
                *(topics.shards(self.fed, "partial", s) for s in self.shards),
            ):
                self.transport.publish(topic, b"", retain=True)
        self.shell.start(resume, subscribe=False)
        for pattern, handler in self.subscriptions():
            self.transport.subscribe(pattern, handler)
        if resume and not self.finished:
            # The phase message may not have gone out before the crash (it follows the boundary's checkpoint);
            # a shard that has it already ignores it.
            self._publish_phase()

    def reconnected(self) -> None:
        self.shell.reconnected()

    def tick(self, now: float | None = None) -> None:
        self.shell.tick(now)
        open_ = self.machine.phase
        if open_ is None or not open_.closing:
            self._closing_since = None
            return
        t = self.shell.clock() if now is None else now
        missing = [s for s in self.shards if s not in self._parts and s not in self._lost]
        if self._closing_since is None:
            self._closing_since = self._said = t
        elif t - self._closing_since >= self.shard_timeout and missing and self._parts:
            # Only while another shard answered: when none does, the fault is more likely this side's (or every
            # shard's), and closing on nothing would lose every upload; they resume from their journals.
            self._give_up(missing)
        elif t - self._said >= 30:
            self._said = t
            log.warning(
                "round %d %s: waiting %.0f s for the partials of shard(s) %s (a shard that died is restarted "
                "by `start`; on another machine, run its `protofl-server shard` command again; after "
                "%.0f s (--shard-timeout) the phase closes without its uploads)",
                self.round,
                open_.phase.value,
                t - self._closing_since,
                ", ".join(missing),
                self.shard_timeout,
            )

    def _give_up(self, missing: list[str]) -> None:
        """The closing phase without the uploads of the shards in `missing` (journaled: a restart decides the same)."""
        open_ = self.machine.phase
        assert open_ is not None
        for shard in missing:
            owned = sum(1 for s in open_.owners.values() if s == shard)
            body = shard_wire.encode("lost", shard=shard, round=self.round, phase=open_.phase.value)
            self.shell.handle(
                ShardLost(shard, self.round, open_.phase.value),
                (topics.shards(self.fed, "partial", shard), body, "", LOST, self.round, open_.phase.value),
                f"the loss of {shard}",
            )
            self._lost.add(shard)
            if owned:
                self.dropped["shard_lost"] = self.dropped.get("shard_lost", 0) + owned
            log.error(
                "round %d %s: no partial from %s in %.0f s (--shard-timeout): the phase closes without its %d "
                "upload(s); run its `protofl-server shard` command again for it to take part from the next "
                "phase",
                self.round,
                open_.phase.value,
                shard,
                self.shard_timeout,
                owned,
            )
        self._merge_if_complete()

    def subscriptions(self) -> list[tuple[str, Callable[[str, bytes], None]]]:
        """Not the uploads (the shards have those, unless `direct`): what the shards send, and devices' presence."""
        return [
            *([(topics.up_all(self.fed), self.on_message)] if self.direct else []),
            (topics.shards(self.fed, "relay", "+"), self.on_relay),
            (topics.presence_all(self.fed), self.shell.on_presence),
            (topics.shards(self.fed, "progress", "+"), self.on_progress),
            (topics.shards(self.fed, "partial", "+"), self.on_partial),
        ]

    # -- what devices and the shards send -------------------------------------------------------------
    def on_message(self, topic: str, payload: bytes) -> None:
        """A device's message (from up/ when `direct`, or relayed by a shard), handled by the shell; then the
        progress of its device held until its join was in is placed (a join travels through one shard, its uploads
        through others)."""
        self.shell.on_message(topic, payload)
        waiting = self._waiting.pop(topics.client_of(topic), None)
        for inp in waiting or ():
            self._place(inp)

    def on_relay(self, topic: str, payload: bytes) -> None:
        """A device's join or metrics, passed on by the shard that received it: handled as if from up/."""
        client = topic.rsplit("/", 1)[-1]
        self.on_message(topics.up(self.fed, client), payload)

    def on_progress(self, topic: str, payload: bytes) -> None:
        for inp in self._progress_inputs(topic, payload):
            self._place(inp)

    def _place(self, inp: Progress) -> None:
        """One upload a shard folded, placed by the machine (journaled alone: a replay needs no batch)."""
        try:
            self.machine.accepts(inp)
        except Drop as drop:
            if drop.reason == "unknown_client" and inp.round >= self.round:
                # Its join travels through another shard and may arrive after this: placed once it has.
                self._waiting.setdefault(inp.sender, []).append(inp)
                return
        body = shard_wire.encode(
            "progress", shard=inp.shard, round=inp.round, phase=inp.phase, entries=[[inp.sender, inp.kind, inp.nbytes]]
        )
        self.shell.handle(
            inp,
            (topics.shards(self.fed, "progress", inp.shard), body, inp.sender, PROGRESS, inp.round, inp.phase),
            f"{inp.kind} of {inp.sender} from {inp.shard}",
        )
        self._back(inp.shard)

    def _back(self, shard: str) -> None:
        """A shard given up on that folds an upload of the open phase again: its partial is awaited again."""
        open_ = self.machine.phase
        if shard in self._lost and open_ is not None and shard in open_.owners.values():
            self._lost.discard(shard)
            log.warning("%s is back: its partial is awaited again from this phase on", shard)

    def _progress_inputs(self, topic: str, payload: bytes) -> list[Progress]:
        try:
            msg = shard_wire.decode(payload, "progress", self._max_control())
            entries = shard_wire.progress_entries(msg)
        except WireError as exc:
            self.shell.drop("malformed", f"{topic}: {exc}", len(payload))
            return []
        if msg["shard"] not in self.shards or topic != topics.shards(self.fed, "progress", msg["shard"]):
            self.shell.drop(
                "invalid",
                f"{topic}: progress of '{msg['shard']}', not one of this federation's shards "
                f"({', '.join(self.shards)})",
                len(payload),
                str(msg["shard"]),
            )
            return []
        return [
            Progress(msg["shard"], sender, kind, msg["round"], msg["phase"], nbytes) for sender, kind, nbytes in entries
        ]

    def on_partial(self, topic: str, payload: bytes) -> None:
        open_ = self.machine.phase
        if open_ is None or not open_.closing or not payload:
            return  # an old retained partial, or nothing is closing
        try:
            msg = shard_wire.decode(payload, "partial", self._max_control())
        except WireError as exc:
            self.shell.drop("malformed", f"{topic}: {exc}", len(payload))
            return
        shard = msg["shard"]
        if (msg["round"], msg["phase"]) != (self.round, open_.phase.value):
            return  # another phase's (retained from before)
        expected = sum(1 for s in open_.owners.values() if s == shard)
        if shard not in self.shards or topic != topics.shards(self.fed, "partial", shard) or msg["uploads"] != expected:
            self.shell.drop(
                "invalid",
                f"{topic}: partial of '{shard}' over {msg['uploads']} upload(s), expected {expected}",
                len(payload),
                str(shard),
            )
            return
        try:
            assert self.machine.run is not None
            self.machine.run.check_partial(msg["part"])
        except ValueError as exc:
            log.error("shard %s sent a partial the coordinator cannot merge (%s); waiting for a good one", shard, exc)
            self.shell.drop("invalid", f"{topic}: {exc}", len(payload), str(shard))
            return
        self._parts[shard] = msg["part"]
        self._merge_if_complete()

    def _merge_if_complete(self) -> None:
        """Merge and close once every shard not given up on has sent its partial."""
        open_ = self.machine.phase
        if open_ is None or not open_.closing:
            return
        if set(self._parts) >= set(self.shards) - self._lost:
            parts, self._parts = self._parts, {}
            body = shard_wire.encode("partials", round=self.round, phase=open_.phase.value, parts=parts)
            self.shell.handle(
                Partials(self.round, open_.phase.value, parts),
                ("", body, "", PARTIALS, self.round, open_.phase.value),
                "the shards' partials",
            )

    # -- effects and replay -------------------------------------------------------------------------
    def _carry_out(self, effect: Effect) -> None:
        """What the shell passes on of each live effect: the shards' side of a boundary and of a close."""
        if isinstance(effect, Boundary):
            self._publish_phase()
        elif isinstance(effect, Gather):
            self._parts = {}
            assignment = {s: [list(p) for p in pairs] for s, pairs in effect.assignment.items()}
            self.transport.publish(
                topics.shards(self.fed, "close"),
                shard_wire.encode("close", round=effect.round, phase=effect.phase.value, assignment=assignment),
                retain=True,
            )
            log.info(
                "round %d %s closing: partials asked of %d shard(s)", effect.round, effect.phase.value, len(self.shards)
            )

    def _publish_phase(self) -> None:
        """The machine at this phase boundary, for the shards (before the round message goes to devices)."""
        m = self.machine
        payload = shard_wire.encode(
            "phase",
            round=m.round,
            phase=m.phase.phase.value if m.phase else "",
            finished=m.finished,
            machine=self.closing.phase_state(m),
            policy=dataclasses.asdict(m.model.policy),
            limits=dataclasses.asdict(self.limits),
            members=sorted(self.members) if self.members is not None else None,
        )
        self._waiting = {}  # progress of devices that never joined in the phase that closed
        self.transport.publish(topics.shards(self.fed, "phase"), payload, retain=True)

    def replay(self, topic: str, payload: bytes, client: str, kind: str, round_: int, phase: str) -> None:
        """A journaled input again (durable.DurableState.restore): the shards' ones decoded here, the rest by the
        shell."""
        if kind not in (PROGRESS, PARTIALS, LOST):
            self.shell.replay(topic, payload, client, kind, round_, phase)
            return
        inputs: list[Input]
        if kind == PROGRESS:
            inputs = list(self._progress_inputs(topic, payload))
        elif kind == LOST:
            msg = shard_wire.decode(payload, "lost", self._max_control())
            inputs = [ShardLost(msg["shard"], msg["round"], msg["phase"])]
            self._lost.add(msg["shard"])
        else:
            msg = shard_wire.decode(payload, "partials", self._max_control())
            inputs = [Partials(msg["round"], msg["phase"], msg["parts"])]
        for inp in inputs:
            try:
                self.shell.reapply(inp)
                if isinstance(inp, Progress):
                    self._back(inp.shard)
            except Drop as drop:
                log.warning("journaled %s (round %d) was refused on replay: %s", kind, round_, drop.detail)

    def _max_control(self) -> int:
        return max(64 << 20, 8 * self.limits.max_message_bytes * max(1, len(self.shards)))

"""The service thread's view of its aggregator, turned into `Snapshot`s for everyone else.

`FederationObserver` lives on the thread that owns the `Aggregator` (service.py) and is the only
code of this package that reads it: it is told of inputs applied and of rounds logged with their
accuracies, and `snapshot()` copies what the watchers show into an immutable `Snapshot`. Other threads
(HTTP servers) only ever read snapshots. What it counts (uploads accepted, each member's last one) is the round
machine's state, and a restarted server's history takes the accuracies logged before it from rounds.jsonl
(`remember`), so the watch shows what happened before a restart (docs/design.md, "Watching a federation"). It also
logs joins, departures and returns at INFO, so the default log says who is in the federation (the round machine's
own lines need `-v`). numpy only.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from broker_server.core.progress import accuracies
from broker_server.core.rounds import GraceOver, Presence, Received, RoundRecord
from broker_server.ops.privacy_ledger import FleetView, run_spend
from broker_server.scaleout.shard_closing import Progress
from broker_server.watch.snapshot import (
    ACCURACY_KEYS,
    LEFT,
    NOT_JOINED,
    OFFLINE,
    ONLINE,
    Member,
    Refused,
    RoundRow,
    Snapshot,
    Upload,
)
from protofl import privacy
from protofl.learning import LearningWatch
from protofl.sparse import SparseVector
from protofl.wire import Message, Metrics, ParamsUpload, ProtoUpload

if TYPE_CHECKING:
    from broker_server.core.rounds import Input
    from broker_server.core.shell import Aggregator

log = logging.getLogger("protofl.service")
HISTORY = 200  # closed rounds a snapshot carries (the retained summary stays small on long runs)
SKIPPED_KEY = "skipped_files"  # Metrics.extra: the files a device's loader skipped (protofl/data/own.py)
MAX_SKIPPED = 10**9  # more files than that skipped is no count a device can hold: the value is refused


def skipped_files(client: str, extra: Mapping[str, float]) -> int | None:
    """The count of skipped files `client`'s metrics report (`extra[SKIPPED_KEY]`), or None where they report none
    or a value no count can be (negative, fractional, not finite, over MAX_SKIPPED): that is logged and ignored."""
    v = extra.get(SKIPPED_KEY)
    if v is None:
        return None
    if not (0 <= v <= MAX_SKIPPED) or v != int(v):  # NaN fails the first test
        log.warning(
            "device %s: its metrics' %s = %r is not a count of files (0 to %d): ignored",
            client,
            SKIPPED_KEY,
            v,
            MAX_SKIPPED,
        )
        return None
    return int(v)


def encoding(msg: Message) -> str:
    """How an upload's values travelled: wire dtype, and K for a sparse update."""
    if isinstance(msg, ParamsUpload):
        if isinstance(msg.update, SparseVector):
            return f"{msg.dt} K={len(msg.update.indices)}"
        return msg.dt
    if isinstance(msg, ProtoUpload):
        protos = msg.local or msg.public
        return protos.dt if protos is not None else ""
    return ""


class FederationObserver:
    def __init__(self, aggregator: Aggregator, fleet_privacy: FleetView | None = None) -> None:
        self.agg = aggregator
        self.fleet_privacy = fleet_privacy  # a fleet run: each device's spend over the fleet's runs, shown
        self.started = time.time()
        self.pid = os.getpid()
        # How each member's last upload travelled (its encoding), as seen live by this process: the counts and the
        # rest of the last upload are the machine's state (durable: a restart keeps them), its encoding is not.
        self._encodings: dict[str, tuple[int, str, str, str]] = {}
        self._accuracies: dict[int, dict[str, float | None]] = {}
        self.learning = LearningWatch()  # protofl/learning.py: the note once the federation is not learning
        self._states: dict[str, str] = {}
        self._skipped: dict[str, int] = {}  # member -> files its loader skipped, as its last metrics said
        self.stopped = False
        # Incremental members: the inputs applied since the last snapshot name the members they changed (an input
        # changes its own device's row only); what changes every row (a round closed, a resume, a shard lost) or
        # names none sets `_everyone`, and the next snapshot builds every row again.
        self._touched: set[str] = set()
        self._everyone = True
        aggregator.on_applied = self.on_applied

    @property
    def accepted(self) -> dict[str, int]:
        """Uploads accepted, by kind (the federation's, restarts included: the machine's state)."""
        return dict(self.agg.machine.state.accepted_kinds)

    # -- events (service thread) ----------------------------------------------------------------
    def on_applied(self, inp: Input) -> None:
        if isinstance(inp, (Presence, GraceOver)):
            self._touched.add(inp.client)
            return
        if isinstance(inp, Progress):  # a shard's: the upload's encoding stays at the shard
            self._touched.add(inp.sender)
            return
        if not isinstance(inp, Received):
            self._everyone = True  # a deadline, a shard's partials or its loss: rows may change anywhere
            return
        env = inp.env
        self._touched.add(env.sender)
        if isinstance(inp.msg, (ProtoUpload, ParamsUpload)):
            self._encodings[env.sender] = (env.round, env.phase, env.kind, encoding(inp.msg))

    def invalidate(self) -> None:
        """Every member's row may have changed (a round closed, the machine resumed): the next `changes` has all."""
        self._everyone = True

    def remember(self, accuracies: Mapping[int, Mapping[str, float | None]]) -> None:
        """The accuracies of rounds logged before this process (rounds.jsonl, `round_accuracies`): a restarted
        server's history keeps them."""
        last = max(accuracies, default=0)
        for round_, accs in accuracies.items():
            if round_ > last - HISTORY:
                self._accuracies.setdefault(round_, dict(accs))

    def resumed(self) -> None:
        """The machine was rebuilt from a state dir: its members are where they were, not new joins."""
        self._states = {m.id: m.state for m in self.members()}

    def on_round_logged(
        self,
        rec: RoundRecord,
        metrics: Mapping[str, Metrics],
        scored: Mapping[str, float | None] | None = None,
        collapsed: str | None = None,
    ) -> dict[str, float | None]:
        """A closed round's metrics are in (or their grace passed): its accuracies, kept for the history; `scored`:
        what the server scored itself (the global predictor on its validation data), `collapsed` the note where its
        predictions fell in one class. Both feed whether the federation is learning (`learning`)."""
        accs = {**accuracies(metrics.values()), **(scored or {})}
        for cid, msg in metrics.items():
            n = skipped_files(cid, msg.extra)
            if n is not None and self._skipped.get(cid) != n:
                self._skipped[cid] = n
                self._touched.add(cid)
        self.learning.update({"round": rec.round, **accs}, collapsed)
        self._accuracies[rec.round] = accs
        for old in [r for r in self._accuracies if r <= rec.round - HISTORY]:
            del self._accuracies[old]
        return accs

    def _last_upload(self, cid: str) -> Upload | None:
        a = self.agg.machine.state.accepted.get(cid)
        if a is None or not a.uploads:
            return None
        seen = self._encodings.get(cid)
        enc = seen[3] if seen is not None and seen[:3] == (a.round, a.phase, a.kind) else ""
        return Upload(a.round, a.phase, a.kind, a.bytes, enc, a.at)

    # -- the snapshot ---------------------------------------------------------------------------
    def state(self) -> str:
        m = self.agg.machine
        if m.finished:
            return "finished"
        if self.stopped:
            return "stopped"
        return "running" if m.phase is not None else "waiting"

    def members(self) -> tuple[Member, ...]:
        m = self.agg.machine
        s = m.state
        ids = set(s.clients) | set(s.departed) | set(self.agg.members or ()) | set(m.expected_clients or ())
        return tuple(self._member(cid) for cid in sorted(ids))

    def _member(self, cid: str) -> Member:
        m = self.agg.machine
        s = m.state
        join = s.clients.get(cid) or s.departed.get(cid)
        if cid in s.leaving:
            state = OFFLINE
        elif cid in s.clients:
            state = ONLINE
        else:
            state = LEFT if cid in s.departed else NOT_JOINED
        a = s.accepted.get(cid)
        return Member(
            cid,
            state,
            arch=join.arch if join else "",
            n_samples=join.n_samples if join else 0,
            profile=join.profile if join else "",
            traits=join.traits.describe() if join and join.traits else "",
            uploads=a.uploads if a is not None else 0,
            last_upload=self._last_upload(cid),
            skipped_files=self._skipped.get(cid, 0),
            # a finished federation waits for nobody: no place to keep
            grace_ends=None if m.finished else m.grace_end(cid),
        )

    def changes(self) -> tuple[bool, dict[str, Member]]:
        """(every row, rows): the members' rows changed since the last call, all of them (True) where an input named
        none, or after `invalidate`; the cost is the rows changed, not the fleet (the live watch, off the folding
        thread, keeps the rest). Logs joins, departures and returns as `snapshot` does."""
        if self._everyone:
            rows = {m.id: m for m in self.members()}
            everyone = True
        else:
            rows = {cid: self._member(cid) for cid in sorted(self._touched)}
            everyone = False
        self._touched.clear()
        self._everyone = False
        self._log_changes(rows.values())
        return everyone, rows

    def history(self) -> tuple[RoundRow, ...]:
        rows = []
        for rec in self.agg.records[-HISTORY:]:
            accs = self._accuracies.get(rec.round, {})
            rows.append(
                RoundRow(
                    rec.round,
                    len(rec.clients),
                    rec.closed_by,
                    rec.started,
                    rec.ended,
                    rec.uplink_bytes,
                    rec.downlink_bytes,
                    left_out=len(rec.left_out),
                    **accs,
                )
            )
        return tuple(rows)

    def snapshot(self, broker_restarts: int = 0, broker_dropped: int = 0, resend_requests: int = 0) -> Snapshot:
        """Every member's row built again (what the live watch keeps up incrementally: `changes`)."""
        members = self.members()
        self._touched.clear()
        self._everyone = False
        self._log_changes(members)
        return self.frame(members, broker_restarts, broker_dropped, resend_requests)

    def frame(
        self, members: tuple[Member, ...], broker_restarts: int = 0, broker_dropped: int = 0, resend_requests: int = 0
    ) -> Snapshot:
        """The snapshot of everything but the members' rows, which are given."""
        agg = self.agg
        m = agg.machine
        current = m.state.current
        open_ = m.phase
        return Snapshot(
            fed=agg.fed,
            preset=agg.cfg.preset,
            state=self.state(),
            round=m.round,
            rounds=agg.cfg.rounds,
            updated=time.time(),
            phase=open_.phase.value if open_ is not None else None,
            deadline=open_.deadline if open_ is not None else None,
            quorum=m.quorum,
            completed=len(m.records),
            members=members,
            uplink_bytes=sum(r.uplink_bytes for r in m.records) + (0 if m.finished else current.uplink_bytes),
            downlink_bytes=sum(r.downlink_bytes for r in m.records) + (0 if m.finished else current.downlink_bytes),
            accepted=self.accepted,
            dropped=dict(agg.dropped),
            last_drops=tuple(agg.last_drops),
            refusals=tuple(Refused(member, n, why) for member, (n, why) in sorted(agg.refusals.items())),
            clipped=dict(agg.model.clipped),
            history=self.history(),
            broker_restarts=broker_restarts,
            broker_dropped=broker_dropped,
            resend_requests=resend_requests,
            server_pid=self.pid,
            started=self.started,
            privacy=None if m.dp is None else privacy.ledger(m.dp, len(m.records)),
            fleet_privacy=self._fleet_privacy(),
            learning=self.learning.note,
        )

    def _fleet_privacy(self) -> dict[str, Any] | None:
        view = self.fleet_privacy
        if view is None:
            return None
        m = self.agg.machine
        return view.now(run_spend(view.run, m.dp, m.state.accepted, len(m.records), final=False))

    def _log_changes(self, members: Iterable[Member]) -> None:
        """Say who joined, went offline, left or came back since the last snapshot."""

        online: list[int] = []  # counted once, when a line needs it: once per line is n**2 at a fleet's join

        def n_online() -> int:
            if not online:
                s = self.agg.machine.state
                online.append(sum(1 for c in s.clients if c not in s.leaving))
            return online[0]

        finished = self.agg.machine.finished
        for member in members:
            before = self._states.get(member.id)
            self._states[member.id] = member.state
            if before == member.state or (before is None and member.state == NOT_JOINED):
                continue
            if finished and member.state in (OFFLINE, LEFT):  # devices going home after the end: no news
                log.debug("device %s is %s (the federation is finished)", member.id, member.state)
                continue
            if member.state == ONLINE:
                what = "is back" if before in (OFFLINE, LEFT) else "joined"
                log.info(
                    "device %s %s (%s, %d samples); %d online",
                    member.id,
                    what,
                    member.arch or "default arch",
                    member.n_samples,
                    n_online(),
                )
            elif member.state == OFFLINE:
                left = max(0.0, (member.grace_ends or 0.0) - time.time())
                log.info("device %s went offline; it keeps its place in the round for %.0f s", member.id, left)
            elif member.state == LEFT:
                log.info("device %s left (offline past its grace); %d online", member.id, n_online())


def round_accuracies(path: Path) -> dict[int, dict[str, float | None]]:
    """round -> its accuracies, from a server's rounds.jsonl (the durable record of what rounds logged; a torn last
    line from a crash is skipped): what a restarted server's history shows for the rounds before it."""
    out: dict[int, dict[str, float | None]] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            row = json.loads(line)
            out[int(row["round"])] = {k: row[k] for k in ACCURACY_KEYS if isinstance(row.get(k), (int, float))}
        except (ValueError, KeyError, TypeError):
            continue
    return out

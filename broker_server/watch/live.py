"""The service thread's half of watching: a fresh snapshot after its steps, handed to every reader.

`LiveWatch` is driven by `AggregatorService` on the thread that owns the aggregator. After a step that
changed something (at most every `REFRESH_S`, and every `HEARTBEAT_S` anyway, so readers can tell a live
server from a dead one by `updated`) it takes what changed from the aggregator on that thread - the rows of
the members whose inputs were applied since, and the federation's counters: a cost independent of the fleet's
size and of the upload rate - and hands it to its own thread ("watch"), which keeps every member's row, builds
the snapshot, encodes it once (each unchanged row's encoding kept) and hands it on:
- to the `SnapshotBoard` the HTTP servers read (metrics.py, ui.py),
- to `state_dir/status.json` (written atomically) for `protofl-server status --state-dir`,
- retained on `server/summary` (when it changed, at most every `SUMMARY_S`, QoS 0 and only while
  connected: a summary is superseded by the next one, so none is queued), for `status --broker`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from broker_server.watch.board import SnapshotBoard
from broker_server.watch.observer import FederationObserver
from broker_server.watch.snapshot import Member, Snapshot, SnapshotEncoder
from protofl import topics
from protofl.transport.mqtt import TransportError
from protofl.wire import Metrics

if TYPE_CHECKING:
    from broker_server.core.rounds import RoundRecord
    from broker_server.core.shell import Aggregator
    from broker_server.ops.privacy_ledger import FleetView
    from broker_server.watch.metrics import FederationMetrics
    from protofl.learning import LearningWatch
    from protofl.transport import Connection

log = logging.getLogger("protofl.service")
REFRESH_S = 0.25
HEARTBEAT_S = 2.0
SUMMARY_S = 1.0
SUMMARY_HEARTBEAT_S = 15.0
COST_SHARE = 20  # a refresh waits at least this many times its last cost: watching takes <= 1/20 of the process
FULL_S = 30.0  # every member's row taken again at least this often (what no input names: none known; a safety net)
STATUS_FILE = "status.json"


class LiveWatch:
    def __init__(
        self,
        aggregator: Aggregator,
        *,
        board: SnapshotBoard | None = None,
        state_dir: Path | None = None,
        transport: Connection | None = None,
        metrics: FederationMetrics | None = None,
        broker_restarts: Callable[[], int] | None = None,
        fleet_privacy: FleetView | None = None,
    ) -> None:
        self.observer = FederationObserver(aggregator, fleet_privacy)
        self.board = board or SnapshotBoard()
        self.status_file = state_dir / STATUS_FILE if state_dir is not None else None
        self.transport = transport
        self.metrics = metrics
        self.broker_restarts = broker_restarts
        # (messages the broker dropped, re-send requests sent) so far: set by the service (resend.py)
        self.resends: Callable[[], tuple[int, int]] | None = None
        self._dirty = True
        self._built = 0.0
        self._summary: Snapshot | None = None  # the last one published, `updated` zeroed
        self._summary_at = 0.0
        self._summary_due = False  # a change not published yet (it came within SUMMARY_S of the last one)
        self._topic = topics.server_summary(aggregator.fed)
        self._status_failed = False
        self._cost = 0.0  # seconds the last refresh took (the folding thread's part and the watch thread's)
        self._full_at = float("-inf")
        # The watch thread's: every member's row, in order, and the encoder that keeps their encodings.
        self._rows: dict[str, Member] = {}
        self._order: list[str] = []
        self._encoder = SnapshotEncoder()
        self._build_lock = threading.Lock()  # one build at a time (the watch thread's, or a synchronous refresh)
        self._handed: list[tuple[Snapshot, bool, dict[str, Member]]] = []  # what the folding thread handed on
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._built_cost = 0.0  # the watch thread's last build, seconds

    # -- events ---------------------------------------------------------------------------------
    def round_closed(self, rec: RoundRecord) -> None:
        if self.metrics is not None:
            self.metrics.round_duration.observe(max(0.0, rec.ended - rec.started))
        self.observer.invalidate()  # the finished federation's rows keep no grace
        self._dirty = True

    def resumed(self) -> None:
        """The machine resumed (the broker connection came back): every offline member's grace starts again."""
        self.observer.invalidate()
        self._dirty = True

    def round_logged(
        self,
        rec: RoundRecord,
        metrics: Mapping[str, Metrics],
        scored: Mapping[str, float | None] | None = None,
        collapsed: str | None = None,
    ) -> dict[str, float | None]:
        self._dirty = True
        return self.observer.on_round_logged(rec, metrics, scored, collapsed)

    @property
    def learning(self) -> LearningWatch:
        """Whether the federation is learning (protofl/learning.py), from the rounds logged so far."""
        return self.observer.learning

    def changed(self) -> None:
        """Something watchers see changed outside a handled message (e.g. re-send requests went out)."""
        self._dirty = True

    def observe_fsync(self, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.fsync.observe(seconds)

    # -- after each step ------------------------------------------------------------------------
    def after_step(self, handled: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._dirty = self._dirty or handled > 0
        # A snapshot lists every device: at a fleet's size building and encoding one takes a good part of
        # REFRESH_S, and refreshing that often would take the process's time from the folding (measured at 1,000
        # devices: half the thread's time, issue 27). So a refresh waits at least COST_SHARE times its last cost.
        due = max(REFRESH_S if self._dirty else HEARTBEAT_S, self._cost * COST_SHARE)
        if now - self._built >= due or (self._summary_due and now - self._summary_at >= max(SUMMARY_S, due)):
            self._hand_on(now)

    def _take(self, now: float) -> tuple[Snapshot, bool, dict[str, Member]]:
        """On the folding thread: the snapshot's frame (no rows) and the rows that changed (all where `every`)."""
        if now - self._full_at >= FULL_S:
            self.observer.invalidate()
        every, rows = self.observer.changes()
        if every:
            self._full_at = now
        dropped, asked = self.resends() if self.resends else (0, 0)
        frame = self.observer.frame((), self.broker_restarts() if self.broker_restarts else 0, dropped, asked)
        self._built, self._dirty = now, False
        return frame, every, rows

    def _hand_on(self, now: float) -> None:
        started = time.perf_counter()
        taken = self._take(now)
        with self._wake:
            self._handed.append(taken)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="watch", daemon=True)
                self._thread.start()
            self._wake.notify()
        self._cost = time.perf_counter() - started + self._built_cost

    def _serve(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: bool(self._handed) or self._closed)
                if self._closed:
                    return
            started = time.perf_counter()
            with self._build_lock:  # taken under the build lock: a synchronous refresh's newer one is never undone
                with self._wake:
                    handed, self._handed = self._handed, []
                if handed:
                    self._build(handed, time.monotonic())
            self._built_cost = time.perf_counter() - started

    def _build(self, handed: list[tuple[Snapshot, bool, dict[str, Member]]], now: float) -> Snapshot:
        """On the watch thread (or a synchronous refresh): the rows merged in order, the last frame filled with
        them, encoded once (for the board, the status file and the summary alike) and handed on."""
        for _, every, rows in handed:
            if every:
                self._rows = dict(rows)
                self._order = sorted(rows)
                continue
            new = [cid for cid in rows if cid not in self._rows]
            self._rows.update(rows)
            if new:
                self._order = sorted(self._rows)
        frame = handed[-1][0]
        rows_now = self._rows
        snap = dataclasses.replace(frame, members=tuple(rows_now[cid] for cid in self._order))
        body = self._encoder.encode(snap)
        self.board.publish(snap, body)
        self._write_status(body)
        self._publish_summary(snap, now, body)
        return snap

    def refresh(self, now: float | None = None) -> Snapshot:
        """A snapshot now, built and handed on before this returns (on the calling thread: the folding one)."""
        started = time.perf_counter()
        now = time.monotonic() if now is None else now
        self.observer.invalidate()
        taken = self._take(now)
        with self._build_lock:
            with self._wake:  # what the watch thread has not built yet comes first
                handed, self._handed = [*self._handed, taken], []
            snap = self._build(handed, now)
        self._cost = time.perf_counter() - started
        return snap

    def stopped(self) -> None:
        """The server is stopping: a last snapshot that says so (a finished federation stays finished); the watch
        thread ends."""
        self.observer.stopped = True
        self._summary_at = float("-inf")
        self.refresh()
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _write_status(self, body: bytes) -> None:
        if self.status_file is None:
            return
        tmp = self.status_file.with_name(self.status_file.name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it names devices: owner only
            with os.fdopen(fd, "wb") as f:
                f.write(body)
            os.replace(tmp, self.status_file)
        except OSError as exc:  # a watcher's file: the federation goes on without it
            if not self._status_failed:
                log.warning(
                    "cannot write %s (%s); protofl-server status --state-dir will not see this server",
                    self.status_file,
                    exc,
                )
            self._status_failed = True

    def _publish_summary(self, snap: Snapshot, now: float, body: bytes) -> None:
        transport = self.transport
        if transport is None or not transport.connected:
            return
        same = dataclasses.replace(snap, updated=0.0)
        if same == self._summary and now - self._summary_at < SUMMARY_HEARTBEAT_S:
            self._summary_due = False
            return
        if now - self._summary_at < SUMMARY_S:
            self._summary_due = True  # published by the first step once SUMMARY_S has passed
            return
        with contextlib.suppress(TransportError, ValueError):  # a watcher's message never stops the federation
            transport.publish(self._topic, body, retain=True, qos=0)
            self._summary, self._summary_at, self._summary_due = same, now, False

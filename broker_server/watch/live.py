"""The service thread's half of watching: a fresh snapshot after its steps, handed to every reader.

`LiveWatch` is driven by `AggregatorService` on the thread that owns the aggregator. After a step that
changed something it rebuilds the snapshot (at most every `REFRESH_S`, and every `HEARTBEAT_S` anyway,
so readers can tell a live server from a dead one by `updated`) and hands it on:
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
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from broker_server.watch.board import SnapshotBoard
from broker_server.watch.observer import FederationObserver
from broker_server.watch.snapshot import Snapshot
from protofl import topics
from protofl.transport.mqtt import TransportError
from protofl.wire import Metrics

if TYPE_CHECKING:
    from broker_server.rounds import RoundRecord
    from broker_server.shell import Aggregator
    from broker_server.watch.metrics import FederationMetrics
    from protofl.transport import Connection

log = logging.getLogger("protofl.service")
REFRESH_S = 0.25
HEARTBEAT_S = 2.0
SUMMARY_S = 1.0
SUMMARY_HEARTBEAT_S = 15.0
COST_SHARE = 20  # a refresh waits at least this many times its last cost: watching takes <= 1/20 of the thread
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
    ) -> None:
        self.observer = FederationObserver(aggregator)
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
        self._cost = 0.0  # seconds the last refresh took

    # -- events ---------------------------------------------------------------------------------
    def round_closed(self, rec: RoundRecord) -> None:
        if self.metrics is not None:
            self.metrics.round_duration.observe(max(0.0, rec.ended - rec.started))
        self._dirty = True

    def round_logged(
        self, rec: RoundRecord, metrics: Mapping[str, Metrics], scored: Mapping[str, float | None] | None = None
    ) -> dict[str, float | None]:
        self._dirty = True
        return self.observer.on_round_logged(rec, metrics, scored)

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
        # REFRESH_S, and refreshing that often would take the thread that folds the uploads (measured at 1,000
        # devices: half its time, issue 27). So a refresh waits at least COST_SHARE times its own last cost.
        due = max(REFRESH_S if self._dirty else HEARTBEAT_S, self._cost * COST_SHARE)
        if now - self._built >= due or (self._summary_due and now - self._summary_at >= max(SUMMARY_S, due)):
            self.refresh(now)

    def refresh(self, now: float | None = None) -> Snapshot:
        started = time.perf_counter()
        now = time.monotonic() if now is None else now
        dropped, asked = self.resends() if self.resends else (0, 0)
        snap = self.observer.snapshot(self.broker_restarts() if self.broker_restarts else 0, dropped, asked)
        self._built, self._dirty = now, False
        body = snap.encode()  # once, for the board, the status file and the summary alike
        self.board.publish(snap, body)
        self._write_status(body)
        self._publish_summary(snap, now, body)
        self._cost = time.perf_counter() - started
        return snap

    def stopped(self) -> None:
        """The server is stopping: a last snapshot that says so (a finished federation stays finished)."""
        self.observer.stopped = True
        self._summary_at = float("-inf")
        self.refresh()

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

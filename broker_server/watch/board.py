"""The latest snapshot, handed from the service thread to the HTTP servers' threads.

The service thread `publish`es an immutable `Snapshot` (and its JSON bytes, encoded once); readers take
the reference under a lock and never see a half-built one. Nothing here touches the aggregator.
"""

from __future__ import annotations

import threading

from broker_server.watch.snapshot import Snapshot


class SnapshotBoard:
    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._snapshot: Snapshot | None = None
        self._body = b""
        self.version = 0

    def publish(self, snapshot: Snapshot, body: bytes | None = None) -> None:
        """Hand on `snapshot`; `body` is its encoding where the caller has it already."""
        body = snapshot.encode() if body is None else body
        with self._changed:
            self._snapshot, self._body = snapshot, body
            self.version += 1
            self._changed.notify_all()

    def latest(self) -> Snapshot | None:
        with self._changed:
            return self._snapshot

    def latest_body(self) -> tuple[int, bytes]:
        """(version, the snapshot's JSON); version 0 and b"" before the first."""
        with self._changed:
            return self.version, self._body

    def wait_newer(self, version: int, timeout: float) -> tuple[int, bytes]:
        """The first snapshot after `version`, or the latest once `timeout` seconds passed."""
        with self._changed:
            self._changed.wait_for(lambda: self.version > version, timeout)
            return self.version, self._body

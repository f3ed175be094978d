"""An aggregator shard's journal: the uploads it took for the open phase and for any later one, as they
arrived (broker_server/scaleout/shard.py). Appended before the broker gets the acknowledgement (fsynced, or with
group commit before the batch's acknowledgements); compacted when a phase opens, so it never holds more
than the open phase and what arrived early for the next. Without a path it is kept in memory (the
in-process federations of tests and simulations)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from broker_server.core.journal import Journal, Record, encode_record, scan


class ShardLog:
    def __init__(self, path: Path | None, *, fsync: bool = True, group_commit: bool = False) -> None:
        self.path, self.fsync, self.group_commit = path, fsync, group_commit
        self._memory: list[Record] = []
        self._journal = self._open() if path is not None else None

    def _open(self) -> Journal:
        assert self.path is not None
        journal = Journal(self.path, fsync=self.fsync)
        journal.records = []  # read from the file when needed (records()), not held
        return journal

    def append(self, topic: str, payload: bytes, client: str, kind: str, round_: int, phase: str) -> None:
        if self._journal is None:
            self._memory.append(Record(0, 0, topic, payload, client, kind, round_, phase))
        else:
            self._journal.append(topic, payload, client, kind, round_, phase, sync=not self.group_commit)

    def sync(self) -> None:
        """What was appended is on disk (group commit: called before the batch's acknowledgements)."""
        if self._journal is not None:
            self._journal.sync()

    def records(self) -> list[Record]:
        if self._journal is None:
            return list(self._memory)
        assert self.path is not None
        return scan(self.path.read_bytes(), self.path)[0]

    def keep(self, wanted: Callable[[Record], bool]) -> None:
        """Only the records `wanted` stays (a phase opened: the closed one's go), atomically."""
        records = [r for r in self.records() if wanted(r)]
        if self._journal is None:
            self._memory = records
            return
        assert self.path is not None
        self._journal.close()
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(
                b"".join(encode_record(r.topic, r.payload, r.client, r.kind, r.round, r.phase) for r in records)
            )
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dfd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)  # the rename survives a crash
        finally:
            os.close(dfd)
        self._journal = self._open()

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()

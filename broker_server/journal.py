"""The aggregator's upload journal: append-only, checksummed, fsynced before an upload is acknowledged.

One record per accepted message (a join or an upload), in the order the round machine applied them:

    b"PFJ1" | body length (u32, big-endian) | CRC32 of the body (u32) | body (msgpack)

The body is `{"t": topic, "p": payload, "c": client, "k": kind, "r": round, "ph": phase}`: the raw
payload, so that replay goes through the same decoder and the same machine as live traffic. Timers
(a grace that ran out, a deadline) are records too, with an empty topic and payload: their kind says
which (broker_server/shell.py).

A crash in the middle of an append leaves a prefix of the last record: a short header or a short body
at the very end of the file. Opening the journal finds it, copies it aside (`<segment>.torn-<offset>`,
the evidence) and truncates the file there; the message it held was never acknowledged, so the broker
delivers it again. A record that is complete but fails its CRC was written whole and then changed on
disk (bit rot, a bad copy): that is damage, not a torn write, wherever it is, and the journal is refused
with a `JournalError` naming the file and offset - never skipped, never truncated.
No pickle: msgpack with binary payloads.
"""

from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgpack

from protofl.errors import ProtoFLError

log = logging.getLogger("protofl.durability")
MAGIC = b"PFJ1"
HEADER = struct.Struct(">4sII")
MAX_RECORD = 1 << 30  # a larger length field is damage, not a message


class JournalError(ProtoFLError, RuntimeError):
    """The journal is damaged somewhere other than a torn last record."""


@dataclass(frozen=True)
class Record:
    offset: int  # where the record starts in the file
    end: int  # where the next one starts
    topic: str
    payload: bytes
    client: str
    kind: str
    round: int
    phase: str


def encode_record(topic: str, payload: bytes, client: str, kind: str, round_: int, phase: str) -> bytes:
    body = msgpack.packb({"t": topic, "p": bytes(payload), "c": client, "k": kind, "r": int(round_), "ph": phase},
                         use_bin_type=True)
    return HEADER.pack(MAGIC, len(body), zlib.crc32(body)) + body


def _decode_body(body: bytes, offset: int, end: int) -> Record:
    d = msgpack.unpackb(body, raw=False, max_bin_len=MAX_RECORD, max_str_len=1 << 16, max_map_len=16)
    return Record(offset, end, d["t"], d["p"], d["c"], d["k"], int(d["r"]), d["ph"])


def scan(data: bytes, path: Path | str = "journal") -> tuple[list[Record], int]:
    """The good records of a journal's bytes and the length of its good prefix (where a torn tail starts)."""
    records: list[Record] = []
    pos, size = 0, len(data)
    while pos < size:
        if size - pos < HEADER.size:
            break  # torn inside the header
        magic, length, crc = HEADER.unpack_from(data, pos)
        end = pos + HEADER.size + length
        if magic != MAGIC or length > MAX_RECORD:
            raise JournalError(f"{path}: record at byte {pos} has a bad header ({magic!r}, length {length}); the "
                               f"journal is damaged, not torn. Restore the state dir from a backup, or move it aside "
                               f"to start a new federation")
        if end > size:
            break  # torn inside the body
        body = data[pos + HEADER.size:end]
        if zlib.crc32(body) != crc:
            raise JournalError(f"{path}: the complete record at byte {pos} ({length} bytes) fails its CRC32 check: "
                               f"it was written whole and changed on disk since (damage, not a crash mid-write). "
                               f"Nothing was changed; restore the state dir from a backup, or move it aside to "
                               f"start a new federation")
        try:
            records.append(_decode_body(body, pos, end))
        except (ValueError, KeyError, TypeError, msgpack.ExtraData) as exc:
            raise JournalError(f"{path}: record at byte {pos} passes its CRC but does not decode ({exc})") from None
        pos = end
    return records, pos


class Journal:
    """An open journal file: `append` returns only once the record is on disk (unless fsync=False, the
    benchmark's comparison)."""

    def __init__(self, path: Path | str, *, fsync: bool = True) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self.on_fsync: Callable[[float], None] | None = None  # told each fsync's seconds (the metrics endpoint)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = self.path.read_bytes() if self.path.exists() else b""
        self.records, good = scan(data, self.path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        if good < len(data):
            aside = self.path.with_name(f"{self.path.name}.torn-{good}")
            aside.write_bytes(data[good:])
            log.warning("%s: a torn last record (%d bytes at offset %d: a crash mid-write, shorter than its header "
                        "says) was moved to %s; its message was never acknowledged and will be delivered again",
                        self.path, len(data) - good, good, aside)
            os.ftruncate(self._fd, good)
            os.fsync(self._fd)
        self.size = good
        self._dirty = False
        os.lseek(self._fd, good, os.SEEK_SET)
        if not data:
            _fsync_dir(self.path.parent)  # the new file's name must survive a crash too

    def records_from(self, offset: int) -> Iterator[Record]:
        """Records at or after `offset` (a checkpoint's journal position), as found when opened."""
        if offset > self.size:
            raise JournalError(f"{self.path}: the checkpoint says the journal holds {offset} bytes, but it holds "
                               f"{self.size}: the journal was truncated or replaced. Restore the state dir from a "
                               f"backup, or move it aside to start a new federation")
        return (r for r in self.records if r.offset >= offset)

    def append(self, topic: str, payload: bytes, client: str, kind: str, round_: int, phase: str, *,
               sync: bool = True) -> int:
        """Write one record and (with `sync`) fsync it; returns the journal's new size. Without `sync`
        the caller must call `sync()` before acknowledging it (group commit)."""
        rec = encode_record(topic, payload, client, kind, round_, phase)
        _crash_point(self._fd, rec)
        written = os.write(self._fd, rec)
        if written != len(rec):
            raise OSError(f"{self.path}: short write ({written} of {len(rec)} bytes)")
        self.size += len(rec)
        self._dirty = True
        if sync:
            self.sync()
        crash_point("AFTER_APPEND")
        return self.size

    def sync(self) -> None:
        """Everything appended so far is on disk when this returns."""
        if self._dirty and self.fsync:
            started = time.perf_counter()
            os.fsync(self._fd)
            if self.on_fsync is not None:
                self.on_fsync(time.perf_counter() - started)
        self._dirty = False

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Fault injection for the crash tests, at moments no timer in a test can hit reliably. With
# PROTOFL_CRASH_MID_APPEND=N set, the N-th append of this process writes half its record, fsyncs it and
# SIGKILLs the process (a real torn write); with PROTOFL_CRASH_<POINT>=N, the N-th time this process
# passes `crash_point("<point>")` it SIGKILLs itself there (AFTER_APPEND: a record written, not yet
# applied; AFTER_CHECKPOINT: a checkpoint written, its round message not yet sent). Unset (always,
# outside tests) each costs one dict lookup.
_passes: dict[str, int] = {}


def crash_point(point: str) -> None:
    at = os.environ.get(f"PROTOFL_CRASH_{point}")
    if not at:
        return
    _passes[point] = _passes.get(point, 0) + 1
    if _passes[point] == int(at):
        _kill_self()


def _crash_point(fd: int, rec: bytes) -> None:
    at = os.environ.get("PROTOFL_CRASH_MID_APPEND")
    if not at:
        return
    _passes["MID_APPEND"] = _passes.get("MID_APPEND", 0) + 1
    if _passes["MID_APPEND"] == int(at):
        os.write(fd, rec[:len(rec) // 2])
        os.fsync(fd)
        _kill_self()


def _kill_self() -> None:
    import signal

    os.kill(os.getpid(), signal.SIGKILL)

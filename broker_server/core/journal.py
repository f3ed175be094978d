"""The aggregator's upload journal: append-only, checksummed, fsynced before an upload is acknowledged.

One record per accepted message (a join or an upload), in the order the round machine applied them:

    b"PFJ3" | meta length (u32, big-endian) | payload length (u32) | CRC32 of meta + payload (u32)
            | CRC32 of the 16 header bytes before it (u32) | meta (msgpack) | payload (the bytes as they arrived)

The meta is `{"t": topic, "c": client, "k": kind, "r": round, "ph": phase}`; the payload follows it as it
came off the wire, written with the header and meta in one `writev`: never decoded and encoded again, nor
copied into a msgpack body (issue 27), and replay goes through the same decoder and the same machine as
live traffic. Timers (a grace that ran out, a deadline) are records too, with an empty topic and payload:
their kind says which (broker_server/core/shell.py). Journals written before are still read, record by record
(`PFJ1`: one msgpack body holding the payload as well, its CRC over that body; `PFJ2`: today's layout
without the header's own CRC); new records are PFJ3, so a state dir may hold all three.

A crash in the middle of an append leaves a prefix of the last record: a short header or a short body
at the very end of the file. Opening the journal finds it, copies it aside (`<segment>.torn-<offset>`,
the evidence) and truncates the file there; the message it held was never acknowledged, so the broker
delivers it again. Anything else is damage (bit rot, a bad copy), wherever it is, and the journal is
refused with a `JournalError` naming the file and offset - never skipped, never truncated:
- a record that is complete but fails its CRC was written whole and changed on disk since;
- a PFJ3 header that fails its own CRC (issue 43): its lengths are never trusted, so a flipped length
  bit cannot make a complete, acknowledged record look like a record cut short by the end of the file;
- a record that claims to run past the end of the file while a whole, CRC-correct record starts after
  it (a torn write is the last thing in the file: the check that keeps PFJ1/PFJ2 journals, whose
  headers carry no CRC, from truncating good records after a flipped length);
- a good prefix shorter than the checkpoint's journal offset (`Journal(keep=...)`): the checkpoint
  reflects records that are no longer there.
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
MAGIC = b"PFJ3"
HEADER = struct.Struct(">4sIIII")  # magic, meta length, payload length, CRC of meta + payload, CRC of the 16 before
V2_MAGIC = b"PFJ2"  # issue 27 to issue 43: the same without the header's CRC
V2_HEADER = struct.Struct(">4sIII")
OLD_MAGIC = b"PFJ1"  # before issue 27: the payload inside the msgpack body
OLD_HEADER = struct.Struct(">4sII")
_HEAD = struct.Struct(">4sIII")  # what the header's own CRC covers
_CRC = struct.Struct(">I")
MAX_RECORD = 1 << 30  # a larger length field is damage, not a message
MAX_META = 1 << 16
# A group commit's pending records are written at `sync`, or sooner past these (writev takes at most IOV_MAX,
# 1,024 on Linux, pieces a call; a record is 3).
_MAX_PENDING_PARTS = 3 * 256
_MAX_PENDING_BYTES = 8 << 20


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


def record_parts(
    topic: str, payload: bytes, client: str, kind: str, round_: int, phase: str, packer: msgpack.Packer | None = None
) -> list[bytes]:
    """One record as the pieces `writev` writes: header, meta, and the payload itself (not copied). A caller
    that writes many passes its own `packer` (packb makes one per call: ~1 us of a record's ~10)."""
    meta = (packer or msgpack.Packer(use_bin_type=True)).pack(
        {"t": topic, "c": client, "k": kind, "r": int(round_), "ph": phase}
    )
    crc = zlib.crc32(payload, zlib.crc32(meta))
    head = _HEAD.pack(MAGIC, len(meta), len(payload), crc)
    return [head + _CRC.pack(zlib.crc32(head)), meta, payload]


def encode_record(topic: str, payload: bytes, client: str, kind: str, round_: int, phase: str) -> bytes:
    """One record's bytes, as `Journal.append` writes them."""
    return b"".join(record_parts(topic, payload, client, kind, round_, phase))


def _unpack_meta(body: bytes | memoryview) -> dict:
    return msgpack.unpackb(body, raw=False, max_bin_len=MAX_RECORD, max_str_len=1 << 16, max_map_len=16)


def _damaged(path: Path | str, pos: int, magic: bytes, length: int) -> JournalError:
    return JournalError(
        f"{path}: record at byte {pos} has a bad header ({magic!r}, length {length}); the journal is "
        f"damaged, not torn. Restore the state dir from a backup, or move it aside to start a new "
        f"federation"
    )


def _bad_crc(path: Path | str, pos: int, length: int) -> JournalError:
    return JournalError(
        f"{path}: the complete record at byte {pos} ({length} bytes) fails its CRC32 check: it was "
        f"written whole and changed on disk since (damage, not a crash mid-write). Nothing was "
        f"changed; restore the state dir from a backup, or move it aside to start a new federation"
    )


def _read_record(data: bytes, pos: int, path: Path | str) -> Record | None:
    """The record at `pos`, or None if the data ends inside it (a torn write: nothing whole may follow)."""
    size = len(data)
    magic = data[pos : pos + 4]
    if magic == OLD_MAGIC:
        if size - pos < OLD_HEADER.size:
            return None
        _, length, crc = OLD_HEADER.unpack_from(data, pos)
        if length > MAX_RECORD:
            raise _damaged(path, pos, magic, length)
        end = pos + OLD_HEADER.size + length
        if end > size:
            _check_torn(data, pos, path, length)
            return None
        body = data[pos + OLD_HEADER.size : end]
        if zlib.crc32(body) != crc:
            raise _bad_crc(path, pos, length)
        d = _unpack_meta(body)
        return Record(pos, end, d["t"], d["p"], d["c"], d["k"], int(d["r"]), d["ph"])
    if magic == MAGIC:
        header = HEADER
    elif magic == V2_MAGIC:
        header = V2_HEADER
    elif size - pos < HEADER.size:
        return None  # torn inside the magic bytes
    else:
        raise _damaged(path, pos, magic, 0)
    if size - pos < header.size:
        return None  # torn inside the header
    if magic == MAGIC:
        _, meta_len, length, crc, head_crc = HEADER.unpack_from(data, pos)
        if zlib.crc32(data[pos : pos + _HEAD.size]) != head_crc:
            raise JournalError(
                f"{path}: the header of the record at byte {pos} fails its own CRC32 check: its lengths "
                f"cannot be trusted (damage, not a crash mid-write). Nothing was changed; restore the state "
                f"dir from a backup, or move it aside to start a new federation"
            )
    else:
        _, meta_len, length, crc = V2_HEADER.unpack_from(data, pos)
    if length > MAX_RECORD or meta_len > MAX_META:
        raise _damaged(path, pos, magic, length)
    start = pos + header.size
    end = start + meta_len + length
    if end > size:
        if magic == V2_MAGIC:
            _check_torn(data, pos, path, meta_len + length)
        return None  # a PFJ3 header passed its CRC: its lengths are what was written, cut short by the end
    view = memoryview(data)
    if zlib.crc32(view[start + meta_len : end], zlib.crc32(view[start : start + meta_len])) != crc:
        raise _bad_crc(path, pos, meta_len + length)
    d = _unpack_meta(view[start : start + meta_len])
    return Record(pos, end, d["t"], data[start + meta_len : end], d["c"], d["k"], int(d["r"]), d["ph"])


def _check_torn(data: bytes, pos: int, path: Path | str, length: int) -> None:
    """A record without a header CRC (PFJ1, PFJ2) that claims to run past the end of the file is a torn write
    only if no whole record follows it; otherwise a flipped length bit made it claim more than it holds."""
    at = pos + 1
    while (at := _next_magic(data, at)) >= 0:
        try:
            if _read_record(data, at, path) is not None:
                break
        except (JournalError, ValueError, KeyError, TypeError, msgpack.ExtraData):
            pass  # not a record: magic bytes inside some payload
        at += 1
    else:
        return None
    raise JournalError(
        f"{path}: the record at byte {pos} claims {length} bytes, past the end of the file, but a whole "
        f"record starts at byte {at} after it: its length was changed on disk (damage, not a crash "
        f"mid-write). Nothing was changed; restore the state dir from a backup, or move it aside to start "
        f"a new federation"
    )


def _next_magic(data: bytes, at: int) -> int:
    found = [i for i in (data.find(m, at) for m in (MAGIC, V2_MAGIC, OLD_MAGIC)) if i >= 0]
    return min(found) if found else -1


def scan(data: bytes, path: Path | str = "journal") -> tuple[list[Record], int]:
    """The good records of a journal's bytes and the length of its good prefix (where a torn tail starts)."""
    records: list[Record] = []
    pos = 0
    while pos < len(data):
        try:
            rec = _read_record(data, pos, path)
        except (ValueError, KeyError, TypeError, msgpack.ExtraData) as exc:
            raise JournalError(f"{path}: record at byte {pos} passes its CRC but does not decode ({exc})") from None
        if rec is None:
            break  # torn inside the header or the body
        records.append(rec)
        pos = rec.end
    return records, pos


class Journal:
    """An open journal file: `append` returns only once the record is on disk (unless fsync=False, the
    benchmark's comparison)."""

    def __init__(self, path: Path | str, *, fsync: bool = True, keep: int = 0) -> None:
        """`keep`: the bytes a checkpoint says the file holds (its journal offset): a good prefix shorter than
        that is refused before anything is truncated."""
        self.path = Path(path)
        self.fsync = fsync
        self.on_fsync: Callable[[float], None] | None = None  # told each fsync's seconds (the metrics endpoint)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = self.path.read_bytes() if self.path.exists() else b""
        self.records, good = scan(data, self.path)
        if good < keep:
            raise JournalError(
                f"{self.path}: the checkpoint says the journal holds {keep} bytes, but its good records end at "
                f"byte {good} (of {len(data)}): the journal was cut or replaced below what the checkpoint "
                f"reflects. Nothing was changed; restore the state dir from a backup, or move it aside to start "
                f"a new federation"
            )
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        if good < len(data):
            aside = self.path.with_name(f"{self.path.name}.torn-{good}")
            aside.write_bytes(data[good:])
            log.warning(
                "%s: a torn last record (%d bytes at offset %d: a crash mid-write, shorter than its header "
                "says) was moved to %s; its message was never acknowledged and will be delivered again",
                self.path,
                len(data) - good,
                good,
                aside,
            )
            os.ftruncate(self._fd, good)
            os.fsync(self._fd)
        self.size = good  # what is appended, written or still pending
        self._dirty = False
        # Group commit: records appended without `sync` wait here and go out in one writev at `sync` (one
        # system call per pumped batch, not one per upload: ~5 us of a 2 KB upload's, ~12 us of a 20 KB one's).
        # Nothing pending is acknowledged, so a crash that loses it loses what the broker delivers again.
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._packer = msgpack.Packer(use_bin_type=True)  # one thread appends (the service's, or a shard's)
        os.lseek(self._fd, good, os.SEEK_SET)
        if not data:
            _fsync_dir(self.path.parent)  # the new file's name must survive a crash too

    def records_from(self, offset: int) -> Iterator[Record]:
        """Records at or after `offset` (a checkpoint's journal position), as found when opened."""
        if offset > self.size:
            raise JournalError(
                f"{self.path}: the checkpoint says the journal holds {offset} bytes, but it holds "
                f"{self.size}: the journal was truncated or replaced. Restore the state dir from a "
                f"backup, or move it aside to start a new federation"
            )
        return (r for r in self.records if r.offset >= offset)

    def append(
        self, topic: str, payload: bytes, client: str, kind: str, round_: int, phase: str, *, sync: bool = True
    ) -> int:
        """Write one record and (with `sync`) fsync it; returns the journal's new size. Without `sync`
        the caller must call `sync()` before acknowledging it (group commit)."""
        parts = record_parts(topic, payload, client, kind, round_, phase, self._packer)
        if _CRASH:  # a test's torn record must come after what is pending, as it would on disk
            self._write_pending()
            _crash_point(self._fd, parts)
        total = len(parts[0]) + len(parts[1]) + len(parts[2])
        self._pending += parts
        self._pending_bytes += total
        self.size += total
        if sync:
            self.sync()
        elif len(self._pending) >= _MAX_PENDING_PARTS or self._pending_bytes >= _MAX_PENDING_BYTES:
            self._write_pending()
        crash_point("AFTER_APPEND")
        return self.size

    def _write_pending(self) -> None:
        """Hand what is pending to the OS (not yet fsync'd)."""
        # `append` writes before pending passes _MAX_PENDING_PARTS, so one writev takes all of it.
        pending, total, self._pending, self._pending_bytes = self._pending, self._pending_bytes, [], 0
        written = os.writev(self._fd, pending)
        if written != total:
            raise OSError(f"{self.path}: short write ({written} of {total} bytes)")
        self._dirty = True

    def sync(self) -> None:
        """Everything appended so far is on disk when this returns."""
        if self._pending:
            self._write_pending()
        if self._dirty and self.fsync:
            started = time.perf_counter()
            os.fsync(self._fd)
            if self.on_fsync is not None:
                self.on_fsync(time.perf_counter() - started)
        self._dirty = False

    def close(self) -> None:
        if self._fd >= 0:
            if self._pending:
                self._write_pending()
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
# outside tests) each costs one test of an empty dict.
_passes: dict[str, int] = {}
# Read once: a test sets them in the environment of the process it starts, and os.environ.get costs ~1 us a
# call, twice per upload.
_CRASH = {k: v for k, v in os.environ.items() if k.startswith("PROTOFL_CRASH_")}


def crash_point(point: str) -> None:
    at = _CRASH.get(f"PROTOFL_CRASH_{point}") if _CRASH else None
    if not at:
        return
    _passes[point] = _passes.get(point, 0) + 1
    if _passes[point] == int(at):
        _kill_self()


def _crash_point(fd: int, parts: list[bytes]) -> None:
    at = _CRASH.get("PROTOFL_CRASH_MID_APPEND") if _CRASH else None
    if not at:
        return
    _passes["MID_APPEND"] = _passes.get("MID_APPEND", 0) + 1
    if _passes["MID_APPEND"] == int(at):
        rec = b"".join(parts)
        os.write(fd, rec[: len(rec) // 2])
        os.fsync(fd)
        _kill_self()


def _kill_self() -> None:
    import signal

    os.kill(os.getpid(), signal.SIGKILL)

"""Device logs at the server (issue 45): each device's log lines (edge_agent/ops/log_ship.py sends them on its own
`log/<id>` topic, which only that device may write) kept per device in DIR/<id>.log for `protofl-server logs`.

Bounded twice here, whatever a device sends: at most `member_log.LINES_PER_MINUTE` lines per device per minute
(broker_server/core/member_log.py: the rest counted, one line says how many), each line made printable and cut
(`protofl.names.printable`), and at most `FILE_CAP` bytes per file: a full file becomes `<id>.log.1` (the one
before it is dropped), so a device's logs never take more than 2 x FILE_CAP on disk.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from broker_server.core.member_log import MemberLog
from protofl import topics
from protofl.errors import WireError
from protofl.names import check_name, is_valid_name, printable
from protofl.wire import Status, decode_message

FILE_CAP = 256 * 1024  # bytes of one device's log file before it is rotated (2 files at most)
LOG_DIR = "device-logs"


class _DeviceFile(logging.Logger):
    """One device's log file as a logger (MemberLog writes through it); not registered with `logging`."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"protofl.device-log.{path.stem}", logging.DEBUG)
        self.propagate = False
        self.path = path

    def handle(self, record: logging.LogRecord) -> None:
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(record.created))} {record.getMessage()}\n"
        try:
            if self.path.exists() and self.path.stat().st_size + len(line) > FILE_CAP:
                os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
        except OSError:
            pass  # a full disk loses device lines, never a round


class DeviceLogs:
    """The handler of `log/+` on the server's connection (its service thread)."""

    def __init__(self, directory: Path, fed: str) -> None:
        self.directory, self.fed = directory, fed
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._limits: dict[str, MemberLog] = {}
        self.received = 0

    def on_message(self, topic: str, payload: bytes) -> None:
        self.received += 1
        client = topic.rsplit("/", 1)[-1]
        if not is_valid_name(client) or len(payload) > 4096:
            return
        try:
            env, msg = decode_message(payload)
        except WireError:
            return
        if not isinstance(msg, Status) or env.sender != client or env.fed != self.fed:
            return
        limit = self._limits.get(client)
        if limit is None:
            limit = self._limits[client] = MemberLog(_DeviceFile(self.directory / f"{client}.log"))
        limit(logging.INFO, client, "%s %s", printable(msg.state, 16), printable(msg.detail))

    def subscribe(self, transport: object) -> None:
        transport.subscribe(topics.device_log(self.fed, "+"), self.on_message)  # type: ignore[attr-defined]


def log_files(directory: Path, device: str) -> list[Path]:
    """A device's log files, oldest first."""
    check_name(device, "device id")
    return [p for p in (directory / f"{device}.log.1", directory / f"{device}.log") if p.exists()]


def tail(directory: Path, device: str, limit: int) -> str:
    """The newest `limit` bytes (at most) of a device's log lines, whole lines only; ConfigError for an id that is
    not a name (no path is built from one)."""
    chunks: list[bytes] = []
    left = limit
    for path in reversed(log_files(directory, device)):
        try:
            with open(path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - left))
                chunk = f.read(left)
        except OSError:
            continue
        if len(chunk) == left and size > left:
            chunk = chunk[chunk.find(b"\n") + 1 :]  # cut into a line: from the next one
        chunks.insert(0, chunk)
        left -= len(chunk)
        if left <= 0 or size > len(chunk):
            break
    return b"".join(chunks).decode("utf-8", errors="replace")

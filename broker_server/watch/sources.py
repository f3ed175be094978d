"""Where `protofl-server status` reads a federation: the server's state dir, or its broker.

- `read_state_dir(DIR)`: `DIR/status.json`, which the running server rewrites every couple of seconds
  (live.py); on the server box, with read access to the state dir, no credentials needed.
- `read_broker(options, fed)`: the retained `server/summary` and `server/status` topics, read with the
  generated read-only monitor credential (`DIR/security/monitor.json`): from any machine that reaches
  the broker. The monitor's user name is its client id, no device's, so reading never takes a device's
  session; each read is one short connection, so several watchers do not keep replacing each other.

Both return a `Reading`: the snapshot and what is known about the server process besides it.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from broker_server.watch.live import HEARTBEAT_S, STATUS_FILE
from broker_server.watch.snapshot import Snapshot, SummaryError
from protofl import topics
from protofl.errors import ConfigError, WireError
from protofl.transport.broker_url import BrokerOptions
from protofl.wire import Status, decode_message

STALE_AFTER_S = 10 * HEARTBEAT_S  # a live server rewrites its status at least every HEARTBEAT_S


@dataclass(frozen=True)
class Reading:
    snapshot: Snapshot
    server: str  # "" when the snapshot's state is the whole story; else what is wrong with the server
    source: str  # where it was read, for the header


def read_state_dir(state_dir: Path, now: float | None = None) -> Reading:
    path = Path(state_dir) / STATUS_FILE
    if not Path(state_dir).is_dir():
        raise ConfigError(f"--state-dir {state_dir}: no such directory (the --state-dir of protofl-server start)")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            f"no {path}: no server has run with --state-dir {state_dir} yet (or one older than the "
            f"status command); start it, or read its broker: --broker URL --credentials "
            f"{Path(state_dir) / 'security' / 'monitor.json'}"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    snap = Snapshot.decode(data, str(path))
    return Reading(snap, _process_note(snap, time.time() if now is None else now), str(path))


def starting_note(state_dir: Path) -> str | None:
    """What `status --state-dir` says of a server that has started its broker but written no status yet (it trains
    the shared backbone first: minutes): None where it wrote one, or no broker of a live server is there."""
    if (Path(state_dir) / STATUS_FILE).exists() or (Path(state_dir) / "fleet.json").is_file():
        return None  # (a fleet's state dir: its runs' servers write the status, `fleet_note`)
    try:
        pid = int((Path(state_dir) / "broker" / "mosquitto.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    if not _alive(pid):
        return None
    return (
        f"server starting in {state_dir}: its broker and the devices' credentials are up (devices may join now); it "
        "trains the shared backbone before its first status (its log says each epoch)"
    )


def _process_note(snap: Snapshot, now: float) -> str:
    """What the state dir says about the server process, where its snapshot alone would mislead."""
    if snap.state in ("finished", "stopped"):
        return ""
    age = now - snap.updated
    if snap.server_pid and not _alive(snap.server_pid):
        return f"not running (process {snap.server_pid} is gone; last update {age:.0f} s ago)"
    if age > STALE_AFTER_S:
        return f"not responding (last update {age:.0f} s ago)"
    return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: it exists
    return True


def read_broker(options: BrokerOptions, fed: str, timeout: float = 10.0) -> Reading:
    """The retained summary and status of federation `fed`, read once as the monitor user."""
    from protofl.transport.mqtt import Backoff, MqttTransport, TransportError

    if not options.username:
        raise ConfigError(
            "reading the broker needs the monitor credential: --credentials "
            "STATE_DIR/security/monitor.json (or --username/--password)"
        )
    got: dict[str, bytes] = {}
    summary_in, both_in = threading.Event(), threading.Event()
    lock = threading.Lock()

    def on_message(topic: str, payload: bytes) -> None:
        with lock:
            got[topic] = payload
            if topics.server_summary(fed) in got:
                summary_in.set()
                if topics.server_status(fed) in got:
                    both_in.set()

    end = time.monotonic() + timeout
    transport = MqttTransport(options, options.username, backoff=Backoff(0.2, 1.0))
    try:
        transport.connect(timeout)
        transport.subscribe(topics.server_status(fed), on_message)
        transport.subscribe(topics.server_summary(fed), on_message)
        # Both are retained, so both come at once; a summary without a status gets half a second more.
        if summary_in.wait(max(0.0, end - time.monotonic())):
            both_in.wait(0.5)
    except TransportError as exc:
        raise ConfigError(f"cannot read the broker at {options.url} as '{options.username}': {exc}") from None
    finally:
        transport.close(timeout=1.0)
    with lock:
        summary, status = got.get(topics.server_summary(fed)), got.get(topics.server_status(fed))
    where = f"{options.url} ({topics.server_summary(fed)})"
    if summary is None:
        raise ConfigError(
            f"no summary on {topics.server_summary(fed)} at {options.url} within {timeout:.0f} s: is "
            f"--fed right ('{fed}'), and is the server running (a version with the status command)?"
        )
    try:
        snap = Snapshot.decode(summary, where)
    except SummaryError as exc:
        raise ConfigError(str(exc)) from None
    return Reading(snap, _status_note(status), where)


def _status_note(payload: bytes | None) -> str:
    """The retained server/status says the server is gone (its last will) or stopped."""
    if not payload:
        return ""
    try:
        _, msg = decode_message(payload)
    except WireError:
        return ""
    if isinstance(msg, Status) and msg.state == "offline":
        return f"offline ({msg.detail or 'its connection to the broker was lost'})"
    return ""

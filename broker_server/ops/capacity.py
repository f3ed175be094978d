"""What a local broker needs to hold a fleet: its queue for the aggregator, and open files.

Queue. Mosquitto holds QoS 1 messages for a subscriber beyond those in flight up to
`max_queued_messages`, and drops the rest after it has acknowledged them to their senders (no sender
re-sends: docs/design.md "Scale"). Every device of a federation sends at the same moments (joins at
the start, a phase's uploads and metrics when the round message arrives), so the aggregator's queue
must hold the whole fleet's burst while the aggregator catches up: `queue_for_fleet` is the fleet times
what one device sends at once, with headroom, and never below the old fixed 10,000. The limit is
per client but memory is only taken by messages actually queued, so a generous limit costs nothing
until a burst needs it (`max_queued_bytes` stays unlimited: the packet limit already bounds each one).

Open files. Every device connection is one descriptor of the broker process, which inherits the
server's limits. `raise_open_files` lifts the soft limit as far as the hard limit allows (a stock
shell's 1,024 refuses the 1,017th device as "denied access by tcpd"), and refuses a fleet the hard
limit cannot hold, before anything is written.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from protofl.config import FederationConfig
from protofl.errors import ConfigError
from protofl.plan import RoundPlan

log = logging.getLogger("protofl.broker")

try:  # POSIX only
    import resource
except ImportError:  # pragma: no cover - Windows
    resource = None  # type: ignore[assignment]

DEFAULT_QUEUE = 10_000  # what the generated config always had: the floor
MOSQUITTO_INFLIGHT = 20  # max_inflight_messages, Mosquitto's default: delivered but not yet acknowledged
# The server's (and each shard's) in-flight window, asked of the broker in its MQTT 5 CONNECT (Receive Maximum): the
# uploads delivered to it unacknowledged, so the most one journal group commit (one fsync) covers. None: the
# broker's max_inflight_messages (MOSQUITTO_INFLIGHT). Measured in bench/results/AGGREGATOR.md (issue 48).
SERVER_RECEIVE_MAXIMUM: int | None = None
# Where the window is measured (bench/device_shards.sh): the server and the shards it spawns ask this one instead.
RECEIVE_MAXIMUM_ENV = "PROTOFL_RECEIVE_MAXIMUM"
QUEUE_HEADROOM = 2  # a restart's re-sends on top of a round's burst
# Messages a device sends at once besides a phase's uploads: presence "online", join, metrics.
BURST_EXTRA = 3
# Descriptors the broker holds besides device connections: listeners, the server's socket, the log,
# persistence, the password and ACL files while reloading, the supervisor's probes, and some slack.
BROKER_OWN_FILES = 64
# Where the hard limit is unlimited the soft limit is raised this far (Linux's fs.nr_open default).
UNLIMITED_CAP = 1 << 20


def uploads_per_phase(cfg: FederationConfig) -> int:
    """The most uploads one device sends in one phase of this federation's rounds."""
    plan = RoundPlan.from_config(cfg)
    return max(len(plan.sends(p)) for p in plan.phases)


def queue_for_fleet(devices: int, uploads_per_phase: int) -> int:
    """`max_queued_messages` for a fleet of `devices` that send `uploads_per_phase` uploads in their busiest
    phase (each also sends presence, a join and metrics around it)."""
    return max(DEFAULT_QUEUE, devices * (uploads_per_phase + BURST_EXTRA) * QUEUE_HEADROOM)


def server_receive_maximum() -> int | None:
    """The Receive Maximum the server and its shards ask: $PROTOFL_RECEIVE_MAXIMUM where set (1 to 65535), else
    SERVER_RECEIVE_MAXIMUM (None: the broker's own window)."""
    raw = os.environ.get(RECEIVE_MAXIMUM_ENV, "").strip()
    if not raw:
        return SERVER_RECEIVE_MAXIMUM
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= 65535:
        raise ConfigError(f"{RECEIVE_MAXIMUM_ENV}={raw!r}: the in-flight window is 1 to 65535 messages")
    return value


def inflight_window(receive_maximum: int | None = None) -> int:
    """Messages the broker may have delivered to one reader unacknowledged: `receive_maximum` (default: what the
    server asks, `server_receive_maximum`), else the broker's own window."""
    window = server_receive_maximum() if receive_maximum is None else receive_maximum
    return window if window is not None else MOSQUITTO_INFLIGHT


def resend_window(queue: int, uploads_per_phase: int, window: int | None = None) -> int:
    """Re-send requests outstanding at once (broker_server/ops/resend.py): their answers (a join or a phase's
    uploads each) fill at most half of what the broker holds for the aggregator, queue plus in flight."""
    inflight = inflight_window() if window is None else window
    return max(1, (queue + inflight) // (2 * (uploads_per_phase + 1)))


def held_bytes(queue: int, message_bytes: int, readers: int = 1, window: int | None = None) -> int:
    """Bytes the broker may hold for the aggregator at once, in messages of `message_bytes`: its queue, and the
    in-flight window of each of its `readers` (the server, or each shard of a shared subscription)."""
    inflight = inflight_window() if window is None else window
    return (queue + readers * inflight) * message_bytes


def files_for_fleet(devices: int) -> int:
    """Open files the broker needs to serve `devices` connections at once."""
    return devices + BROKER_OWN_FILES


@dataclass(frozen=True)
class OpenFiles:
    """The process's open-file limits after `raise_open_files` (None where the platform has none)."""

    soft: int | None
    hard: int | None
    raised_from: int | None = None  # the soft limit before, when it was raised


def open_file_limits() -> tuple[int, int] | None:
    if resource is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return int(soft), int(hard)


def _finite(limit: int) -> int:
    return UNLIMITED_CAP if resource is not None and limit == resource.RLIM_INFINITY else limit


def raise_open_files(devices: int, where: str = "the local broker") -> OpenFiles:
    """Raise this process's soft open-file limit to its hard limit (a broker it spawns inherits it); raise
    ConfigError naming both limits and what to do when even the hard limit cannot hold `devices`
    connections. Nothing is changed when the fleet cannot be held."""
    limits = open_file_limits()
    if limits is None:
        return OpenFiles(None, None)
    soft, hard = limits
    need = files_for_fleet(devices)
    top = _finite(hard)
    if top < need:
        raise ConfigError(
            f"open-file limit too low for the fleet: {where} needs {need} open files for {devices} device "
            f"connection(s) (+{BROKER_OWN_FILES} of its own), but this process's hard limit (RLIMIT_NOFILE) is "
            f"{hard} (soft {soft}). Raise the hard limit (as root: `ulimit -Hn {need}` in the shell that starts "
            f"the server, LimitNOFILE={need} in its systemd unit, or nofile in /etc/security/limits.conf), or "
            f"spread the fleet over bridged site brokers (protofl-server broker-config --bridge), each holding "
            f"fewer devices"
        )
    if _finite(soft) >= top:
        return OpenFiles(soft, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))
    log.info(
        "open-file limit raised from %d to %d (hard limit %s): room for %d device connection(s)",
        soft,
        top,
        hard,
        top - BROKER_OWN_FILES,
    )
    return OpenFiles(top, hard, raised_from=soft)

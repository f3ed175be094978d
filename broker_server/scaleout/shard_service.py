"""Aggregator shards as processes: one shard over MQTT (`protofl-server shard`), and the child processes
`protofl-server start --shards N` runs and restarts (docs/design.md, "Scale-out"). numpy only.

A shard's MQTT session is persistent and taken up again by its restarted process (MQTT 5, clean start off,
its client id = its user name): the uploads the broker handed it that it never acknowledged wait there,
and an upload is acknowledged only once its journal record is on disk (group commit: one fsync per batch
the transport pumps). So a shard killed at any point loses nothing: what it journaled it folds again from
its journal, what it did not was never acknowledged and comes again.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from broker_server.ops.broker import _die_with_parent
from broker_server.ops.capacity import server_receive_maximum
from broker_server.scaleout import shard_wire
from broker_server.scaleout.shard import Shard
from broker_server.settings import CONNECT_TIMEOUT_S, DEFAULT_SHARD_TIMEOUT_S, Broker, ShardSettings
from protofl import topics
from protofl.transport import Connection
from protofl.transport.mqtt import MqttTransport, Will

log = logging.getLogger("protofl.shard")


def shard_transport(settings: ShardSettings, broker: Broker) -> MqttTransport:
    """A shard's MQTT connection: its client id is its user name and its session persistent and taken up again by
    a restarted process (MQTT 5, clean start off), so the uploads the broker handed it that it never acknowledged
    wait there; an upload is acknowledged only once journaled (manual_ack, one fsync per pumped batch).

    The session outlives the process by the shard's --shard-timeout (the coordinator's): the broker hands each
    member of a shared subscription its share of the uploads whether it is connected or not, so the session of a
    shard that never returns would keep taking its share, lost to every phase after the coordinator gave up on it.
    Expired, the session leaves the group and the live shards get every upload, and the broker publishes the
    shard's will (`gone`, delayed as long): the coordinator asks the devices that owe the open phase to send again,
    so what the session held reaches a live shard. A site's pre-aggregator is its site broker's only reader of the
    uploads: its session waits as long as a device's, and it has no will."""
    expiry, gone = settings.session_expiry, gone_topic(settings)
    will = Will(gone, shard_wire.encode("gone", shard=settings.name), delay=expiry) if gone is not None else None
    return MqttTransport(
        broker.options,
        broker.client_id or settings.user,
        persistent_session=True,
        session_expiry=expiry,
        will=will,
        resume_session=True,
        deliver="pump",
        protocol=broker.protocol,
        manual_ack=True,
        receive_maximum=server_receive_maximum(),
    )


def gone_topic(settings: ShardSettings) -> str | None:
    """Where a core shard's will says it is gone for good (None: a site's pre-aggregator has no will)."""
    return topics.shards(settings.fed, "gone", settings.name) if settings.index is not None else None


class ShardService:
    """Shard `index` of federation `fed` against a broker, until the federation finishes or `stop()`."""

    def __init__(self, settings: ShardSettings, transport: Connection) -> None:
        """Shard `settings.index` on the core broker, or the pre-aggregator of `settings.site` on that site's
        broker, over `transport` (shard_transport builds the MQTT one: persistent, acknowledging after the journal)."""
        if not transport.manual_ack:
            raise ValueError(
                "a shard acknowledges an upload only once it is journaled: its transport must "
                "acknowledge after the handlers (shard_transport)"
            )
        self.transport = transport
        self._gone = gone_topic(settings)
        self.shard = Shard(
            settings.fed,
            self.transport,
            shard=settings.name,
            state_dir=settings.state_dir,
            fsync=settings.fsync,
            group_commit=True,
            batch=True,
        )
        self.transport.before_ack = self.shard.sync  # journaled before any of a batch is acknowledged
        self._stop = threading.Event()

    def start(self, connect_timeout: float = CONNECT_TIMEOUT_S) -> None:
        self.transport.connect(connect_timeout)
        self.shard.start()  # its handlers are in place before the first pump delivers anything
        if self._gone is not None:  # back: a will an earlier run of this shard left is no longer true
            self.transport.publish(self._gone, b"", retain=True)
        # After the subscriptions: the broker handles a client's packets in order, so a coordinator that
        # reads this knows the shared subscription is in place (and, the session being persistent, stays).
        self.transport.publish(
            topics.shards(self.shard.fed, "hello", self.shard.shard),
            shard_wire.encode("hello", shard=self.shard.shard),
            retain=True,
        )
        log.info("%s of federation '%s' on %s", self.shard.shard, self.shard.fed, self.transport.url)

    def run(self, until_finished: bool = True) -> None:
        while not self._stop.is_set():
            self.transport.pump(0.2)
            self.shard.flush()  # one progress message for what the pump took in
            if until_finished and self.shard.finished:
                return

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        # Stopped before the federation finished (Ctrl-C, SIGTERM): its session keeps taking its share of the
        # uploads until it expires, so the will must tell the coordinator then, as after a crash.
        self.transport.close(send_will=not self.shard.finished)
        self.shard.close()


class ShardProcesses:
    """`start --shards N`: N `protofl-server shard` children, restarted when one dies (SIGKILL, OOM, a crash);
    one that exits 0 saw the federation finish. They die with the server (PR_SET_PDEATHSIG)."""

    def __init__(
        self, commands: Sequence[list[str]], log_dir: Path, *, env: dict[str, str] | None = None, interval: float = 0.2
    ) -> None:
        self.commands = list(commands)
        self.log_dir = log_dir
        self.env = env
        self.interval = interval
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * len(self.commands)
        self.restarts = 0
        self._logs: list[IO[bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="shard-supervisor", daemon=True)

    def start(self) -> ShardProcesses:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for i in range(len(self.commands)):
            self._spawn(i)
        self._thread.start()
        return self

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None]

    def _spawn(self, i: int) -> None:
        out = (self.log_dir / f"shard-{i}.log").open("ab")
        self._logs.append(out)
        self.procs[i] = subprocess.Popen(
            self.commands[i], stdout=out, stderr=subprocess.STDOUT, env=self.env, preexec_fn=_die_with_parent
        )

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            for i, proc in enumerate(self.procs):
                if proc is None or proc.poll() is None or proc.returncode == 0 or self._stop.is_set():
                    continue
                rc = proc.returncode
                log.warning(
                    "aggregator shard %d (pid %d) died (%s); restarting it: it resumes from its journal (log: %s)",
                    i,
                    proc.pid,
                    f"signal {-rc}" if rc < 0 else f"exit status {rc}",
                    self.log_dir / f"shard-{i}.log",
                )
                self.restarts += 1
                self._spawn(i)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            if proc is not None:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for out in self._logs:
            out.close()


def shard_command(
    fed: str,
    broker_url: str,
    index: int,
    state_dir: Path,
    credentials: Path | None,
    connect_timeout: float = CONNECT_TIMEOUT_S,
    shard_timeout: float = DEFAULT_SHARD_TIMEOUT_S,
) -> list[str]:
    """The `protofl-server shard` command line of one child (this interpreter, this package)."""
    cmd = [
        sys.executable,
        "-m",
        "broker_server.cli",
        "shard",
        "--fed",
        fed,
        "--broker",
        broker_url,
        "--index",
        str(index),
        "--state-dir",
        str(state_dir),
        "--connect-timeout",
        str(connect_timeout),
        "--shard-timeout",
        f"{shard_timeout:g}",
    ]
    return cmd + (["--credentials", str(credentials)] if credentials is not None else [])


def child_env() -> dict[str, str]:
    """The children import the package as this process does (an editable install, or PYTHONPATH)."""
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[__name__.count(".")])  # the folder above the package, at any depth
    env["PYTHONPATH"] = os.pathsep.join([here, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    return env

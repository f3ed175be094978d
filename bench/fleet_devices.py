"""Lightweight devices for bench_fleet: thousands of MQTT 3.1.1 clients on one asyncio loop, no torch.

Each device does what `protofl-edge join` does on the wire (edge_agent/ops/runner.py), with its own generated
credentials: connect with a last will (presence "offline", retained), announce presence "online", read the
retained `config` and `server/status`; once the server is up, send its join and subscribe `public` and
`round`; on each round message, send its upload (real bytes from the wire codec: a tinyproto-sized
ProtoUpload, encoded once per device, enveloped per round), again if the same round is announced again
(at-least-once, like the runner); on the final round message, say "done" on its presence topic and
disconnect. A second "waiting" from the server (a restart) makes it join again.

The MQTT client is written here on asyncio streams (CONNECT with will and credentials, QoS 1 PUBLISH and
PUBACK both ways, SUBSCRIBE, PINGREQ), so that one process holds ~10,000 devices: one socket each, no
thread each. Run as a process by bench_fleet:

    python -m bench.fleet_devices SPEC.json     # prints JSON lines: "connected", then "done" with its counts

SPEC: {"fed", "preset", "seed", "keepalive", "devices": [[id, password, host, port], ...]}.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import struct
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_agent.ops.resend import ResendRequests
from protofl import topics
from protofl.config import FederationConfig
from protofl.plan import RoundPlan
from protofl.presets import make_config
from protofl.wire import Join, ProtoSet, ProtoUpload, Resend, RoundStart, Status, decode_message, encode_message
from protofl.wire.codec import WIRE_VERSION, Envelope, pack_envelope

CONNECT_CONCURRENCY = 200  # connections being set up at once per process (the broker's accept backlog is finite)


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("!H", len(b)) + b


def _remaining(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n % 128, n // 128
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def connect_packet(client_id: str, username: str, password: str, will_topic: str, will: bytes, keepalive: int) -> bytes:
    # clean session, will QoS 1 retained, user name and password (MQTT 3.1.1, section 3.1)
    flags = 0x02 | 0x04 | 0x08 | 0x20 | 0x80 | 0x40
    body = (
        _str("MQTT")
        + bytes([4, flags])
        + struct.pack("!H", keepalive)
        + _str(client_id)
        + _str(will_topic)
        + struct.pack("!H", len(will))
        + will
        + _str(username)
        + _str(password)
    )
    return b"\x10" + _remaining(len(body)) + body


def publish_packet(topic: str, payload: bytes, pid: int, retain: bool = False) -> bytes:
    body = _str(topic) + struct.pack("!H", pid) + payload
    return bytes([0x32 | (1 if retain else 0)]) + _remaining(len(body)) + body


def subscribe_packet(pid: int, filters: list[str]) -> bytes:
    body = struct.pack("!H", pid) + b"".join(_str(f) + b"\x01" for f in filters)
    return b"\x82" + _remaining(len(body)) + body


def upload_body(cfg: FederationConfig, rng: np.random.Generator) -> dict[str, Any]:
    """A tinyproto-shaped training upload's body: every class, its values on the class's CPS mask (the
    plan's width), counts hidden by scaling, as the device half sends it."""
    plan = RoundPlan.from_config(cfg)
    values = (rng.standard_normal((cfg.num_classes, plan.proto_width)) * 10).astype(np.float32)
    local = ProtoSet(
        classes=np.arange(cfg.num_classes),
        values=values,
        counts=None if cfg.scaling else np.full(cfg.num_classes, 20),
        dt=plan.proto_dtype,
    )
    return ProtoUpload(local=local, public=None, n_samples=20 * cfg.num_classes).to_body()


class Decoded:
    """Round and status messages, decoded once per process (every device receives the same bytes)."""

    def __init__(self) -> None:
        self._cache: dict[bytes, Any] = {}

    def __call__(self, payload: bytes) -> Any:
        got = self._cache.get(payload)
        if got is None:
            try:
                got = decode_message(payload)
            except Exception:  # noqa: BLE001 - an empty retained message (cleared) or a foreign one
                got = (None, None)
            if len(self._cache) > 64:
                self._cache.clear()
            self._cache[payload] = got
        return got


@dataclass
class Stats:
    connected: int = 0
    connect_failed: int = 0
    connect_s: float = 0.0
    joins: int = 0
    uploads: Counter[int] = field(default_factory=Counter)  # round -> uploads sent
    resent: int = 0
    asked_join: int = 0  # the server's re-send requests honoured (the broker had dropped a join / an upload)
    asked_uploads: int = 0
    acked: int = 0
    disconnected: int = 0
    finished: int = 0
    errors: Counter[str] = field(default_factory=Counter)


class Device:
    def __init__(self, fleet: Fleet, client_id: str, password: str, host: str, port: int) -> None:
        self.fleet, self.id, self.password, self.host, self.port = fleet, client_id, password, host, port
        self.writer: asyncio.StreamWriter | None = None
        self.pid = 0
        self.joined = False
        self.subscribed = False
        self.handled: set[tuple[int, str]] = set()
        self.body = fleet.bodies[hash(client_id) % len(fleet.bodies)]
        self.last_sent = 0.0
        self.done = False
        self.last_upload: tuple[tuple[int, str], bytes] | None = None
        self.requests = ResendRequests(fleet.fed, client_id)

    def _next_pid(self) -> int:
        self.pid = self.pid % 65535 + 1
        return self.pid

    def send(self, data: bytes) -> None:
        assert self.writer is not None
        self.writer.write(data)
        self.last_sent = time.monotonic()

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.send(publish_packet(topic, payload, self._next_pid(), retain))

    async def connect(self) -> asyncio.StreamReader:
        f = self.fleet
        reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=2**20)
        offline = encode_message(Status(state="offline", detail="connection lost"), fed=f.fed, sender=self.id)
        self.send(
            connect_packet(self.id, self.id, self.password, topics.presence(f.fed, self.id), offline, f.keepalive)
        )
        head = await reader.readexactly(4)
        if head[0] != 0x20 or head[3] != 0:
            raise ConnectionError(f"CONNACK refused (code {head[3]})")
        return reader

    async def run(self, reader: asyncio.StreamReader) -> None:
        f = self.fleet
        self.publish(topics.presence(f.fed, self.id), f.status("online", self.id), retain=True)
        self.send(subscribe_packet(self._next_pid(), [topics.config(f.fed), topics.server_status(f.fed)]))
        try:
            while True:
                first = await reader.readexactly(1)
                n, mult = 0, 1
                while True:
                    b = (await reader.readexactly(1))[0]
                    n += (b & 0x7F) * mult
                    mult *= 128
                    if not b & 0x80:
                        break
                data = await reader.readexactly(n) if n else b""
                kind = first[0] & 0xF0
                if kind == 0x30:
                    self._on_publish(first[0], data)
                elif kind == 0x40:
                    f.stats.acked += 1
                if self.done:
                    return
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            if not self.done:
                f.stats.disconnected += 1
                f.stats.errors[type(exc).__name__] += 1

    def _on_publish(self, flags: int, data: bytes) -> None:
        (tlen,) = struct.unpack_from("!H", data)
        topic = data[2 : 2 + tlen].decode()
        pos = 2 + tlen
        if flags & 0x06:
            (pid,) = struct.unpack_from("!H", data, pos)
            pos += 2
            self.send(b"\x40\x02" + struct.pack("!H", pid))
        payload = data[pos:]
        f = self.fleet
        env, msg = f.decoded(payload)
        if isinstance(msg, Status) and topic == topics.server_status(f.fed):
            if msg.state == "waiting" or msg.state not in ("waiting", "running"):
                self.joined = False
            if msg.state in ("waiting", "running") and not self.joined:
                self.joined = True
                f.stats.joins += 1
                self.publish(topics.up(f.fed, self.id), f.join_payload(self.id))
                if not self.subscribed:
                    self.subscribed = True
                    self.send(
                        subscribe_packet(
                            self._next_pid(), [topics.public(f.fed), topics.round_(f.fed), topics.down(f.fed, self.id)]
                        )
                    )
        elif isinstance(msg, Resend) and topic == topics.down(f.fed, self.id):
            self._on_request(payload)
        elif isinstance(msg, RoundStart):
            if msg.final:
                self.publish(topics.presence(f.fed, self.id), f.status("done", self.id), retain=True)
                self.send(b"\xe0\x00")  # DISCONNECT: no will
                self.done = True
                f.stats.finished += 1
                return
            key = (env.round, env.phase)
            if env.phase != "train" or (msg.participants is not None and self.id not in msg.participants):
                return
            if key in self.handled:
                f.stats.resent += 1
            self.handled.add(key)
            self.last_upload = (key, f.upload(self, env.round, env.phase))
            self.publish(topics.up(f.fed, self.id), self.last_upload[1])
            f.stats.uploads[env.round] += 1

    def _on_request(self, payload: bytes) -> None:
        """The server asks again for what the broker dropped (edge_agent/ops/resend.py checks and rate-limits)."""
        f = self.fleet
        got = self.requests.read(payload, time.monotonic())
        if got is None:
            return
        env, msg = got
        if msg.ask == "join":
            f.stats.asked_join += 1
            self.publish(topics.up(f.fed, self.id), f.join_payload(self.id))
        elif self.last_upload is not None and self.last_upload[0] == (env.round, env.phase):
            f.stats.asked_uploads += 1
            self.publish(topics.up(f.fed, self.id), self.last_upload[1])


class Fleet:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.fed: str = spec["fed"]
        self.keepalive: int = int(spec.get("keepalive", 300))
        cfg = make_config(spec.get("preset", "tinyproto"))
        rng = np.random.default_rng(int(spec.get("seed", 0)))
        self.bodies = [upload_body(cfg, rng) for _ in range(16)]
        self.devices = [Device(self, cid, pw, host, int(port)) for cid, pw, host, port in spec["devices"]]
        self.stats = Stats()
        self.decoded = Decoded()
        self._status: dict[tuple[str, str], bytes] = {}

    def status(self, state: str, client_id: str) -> bytes:
        return encode_message(Status(state=state, detail="bench"), fed=self.fed, sender=client_id)

    def join_payload(self, client_id: str) -> bytes:
        return encode_message(
            Join(arch="", n_samples=200, profile="", agent_version="bench-fleet"), fed=self.fed, sender=client_id
        )

    def upload(self, device: Device, round_: int, phase: str) -> bytes:
        return pack_envelope(
            Envelope(WIRE_VERSION, "protos", self.fed, round_, phase, device.id, uuid.uuid4().hex[:16], device.body)
        )

    async def _connect_all(self) -> list[tuple[Device, asyncio.StreamReader]]:
        gate = asyncio.Semaphore(CONNECT_CONCURRENCY)
        out: list[tuple[Device, asyncio.StreamReader]] = []

        async def one(d: Device) -> None:
            async with gate:
                for attempt in range(8):
                    try:
                        out.append((d, await d.connect()))
                        self.stats.connected += 1
                        return
                    except (OSError, ConnectionError, asyncio.IncompleteReadError) as exc:
                        self.stats.errors[f"connect {type(exc).__name__}"] += 1
                        await asyncio.sleep(0.2 * 2**attempt)
                self.stats.connect_failed += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(one(d) for d in self.devices))
        self.stats.connect_s = time.perf_counter() - t0
        return out

    async def _pinger(self) -> None:
        """One task keeps every idle connection alive (PINGREQ at half the keepalive)."""
        while True:
            await asyncio.sleep(self.keepalive / 4)
            now = time.monotonic()
            for d in self.devices:
                if d.writer is not None and not d.done and now - d.last_sent > self.keepalive / 2:
                    d.send(b"\xc0\x00")

    async def federate(self) -> None:
        conns = await self._connect_all()
        report("connected", self)
        pinger = asyncio.ensure_future(self._pinger())
        await asyncio.gather(*(d.run(r) for d, r in conns))
        pinger.cancel()
        for d, _ in conns:
            if d.writer is not None:
                d.writer.close()


def report(event: str, fleet: Fleet) -> None:
    s = fleet.stats
    print(
        json.dumps(
            {
                "event": event,
                "pid": os.getpid(),
                "devices": len(fleet.devices),
                "connected": s.connected,
                "connect_failed": s.connect_failed,
                "connect_s": round(s.connect_s, 3),
                "joins": s.joins,
                "uploads": {str(k): v for k, v in sorted(s.uploads.items())},
                "resent": s.resent,
                "asked_join": s.asked_join,
                "asked_uploads": s.asked_uploads,
                "acked": s.acked,
                "disconnected": s.disconnected,
                "finished": s.finished,
                "errors": dict(s.errors),
                "rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            }
        ),
        flush=True,
    )


def main(path: str) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with open(path) as f:
        spec = json.load(f)
    fleet = Fleet(spec)

    def stopped(signum: int, frame: Any) -> None:  # a stalled run is stopped: its counts still count
        report("done", fleet)
        os._exit(0)

    signal.signal(signal.SIGTERM, stopped)
    asyncio.run(fleet.federate())
    report("done", fleet)


if __name__ == "__main__":
    main(sys.argv[1])

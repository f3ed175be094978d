"""A shaping TCP proxy: one emulated constrained link between a device and the broker.

netem is not available on the kernels we run on, so links are emulated in userspace: the device
connects to the proxy, the proxy connects to the broker and copies bytes both ways through

- a token bucket per direction (rate in bytes per simulated second; no burst by default),
- a one-way delay of rtt/2 plus uniform jitter of +-jitter/2 per chunk (order is kept: a TCP stream
  cannot reorder, so a chunk is never delivered before the one read before it),
- outages: while the link is down every connection through it is cut (both sockets closed, as a lost
  radio link looks to the MQTT client after its keepalive) and new connections are refused, so the
  client's reconnect logic runs for real.

A bounded queue per direction pushes back on the sender, as a real link's buffer does.

Time scale: with `time_scale = s`, rates are multiplied and delays, jitter and the outage schedule
divided by s, so a link that takes 15 simulated minutes takes 15/s real minutes. `sim_now()` is the
simulated time since the proxy started (real elapsed x s). It knows bytes only, nothing of MQTT or
of what the bytes mean.
"""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from queue import Queue

log = logging.getLogger("protofl.link")
_CHUNK_MAX = 262144  # fast links at a high time scale: few, large chunks keep up
_QUEUE_CHUNKS = 64


@dataclass(frozen=True)
class LinkShape:
    """One link, in simulated units. `down_at(t)` says whether it is in an outage at simulated time t."""

    up_bytes_per_s: float  # device -> broker
    down_bytes_per_s: float  # broker -> device
    rtt_s: float = 0.0
    jitter_s: float = 0.0
    down_at: Callable[[float], bool] | None = None
    # A radio link serialises: no credit for idle time by default, so a 2 kB upload over NB-IoT takes
    # its 0.26 s like the bound says. A burst > 0 models a link with a buffer that drains at line rate.
    burst_bytes: int = 0

    def __post_init__(self) -> None:
        if not (self.up_bytes_per_s > 0 and self.down_bytes_per_s > 0):
            raise ValueError(f"link rates must be > 0, got up {self.up_bytes_per_s}, down {self.down_bytes_per_s}")
        if self.rtt_s < 0 or self.jitter_s < 0:
            raise ValueError(f"rtt and jitter must be >= 0, got {self.rtt_s}, {self.jitter_s}")


class TokenBucket:
    """Rate `rate` bytes per (real) second with `burst` bytes of credit.

    Kept as the time `t` at which everything reserved so far has left; the credit is the idle time
    since then, capped at burst / rate."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = float(rate)
        self.burst = float(burst)
        self.t = 0.0

    def reserve(self, n: int, now: float) -> float:
        """Reserve n bytes at `now`; returns when their last byte has left (never before `now`)."""
        self.t = max(self.t, now - self.burst / self.rate) + n / self.rate
        return max(now, self.t)


@dataclass
class DirectionStats:
    bytes: int = 0
    chunks: int = 0


@dataclass
class ProxyStats:
    up: DirectionStats = field(default_factory=DirectionStats)
    down: DirectionStats = field(default_factory=DirectionStats)
    connections: int = 0
    refused: int = 0  # connections refused during an outage
    cuts: int = 0  # connections cut by an outage


class _Pipe:
    """One direction of one connection: a reader that schedules, a writer that delivers on time."""

    def __init__(
        self,
        proxy: LinkProxy,
        src: socket.socket,
        dst: socket.socket,
        bucket: TokenBucket,
        stats: DirectionStats,
        on_close: Callable[[], None],
    ) -> None:
        self.proxy, self.src, self.dst, self.bucket, self.stats = proxy, src, dst, bucket, stats
        self.on_close = on_close
        self.queue: Queue[tuple[float, bytes] | None] = Queue(_QUEUE_CHUNKS)
        self.last = 0.0
        # Small chunks on a slow link: the token bucket releases ~20 ms of data at a time.
        self.chunk = int(max(512, min(_CHUNK_MAX, bucket.rate * 0.02)))

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True, name="link-read").start()
        threading.Thread(target=self._write, daemon=True, name="link-write").start()

    def _read(self) -> None:
        try:
            while True:
                data = self.src.recv(self.chunk)
                if not data:
                    break
                now = time.monotonic()
                due = self.bucket.reserve(len(data), now) + self.proxy.one_way_delay()
                self.last = due = max(due, self.last)
                self.queue.put((due, data))
        except OSError:
            pass
        self.queue.put(None)

    def _write(self) -> None:
        try:
            while True:
                item = self.queue.get()
                if item is None:
                    break
                due, data = item
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                self.dst.sendall(data)
                self.stats.bytes += len(data)
                self.stats.chunks += 1
            self.dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self.on_close()


class _Connection:
    def __init__(self, proxy: LinkProxy, device: socket.socket, broker: socket.socket) -> None:
        self.device, self.broker = device, broker
        self._closed = 0
        self._lock = threading.Lock()
        shape, s = proxy.shape, proxy.time_scale
        up = TokenBucket(shape.up_bytes_per_s * s, shape.burst_bytes)
        down = TokenBucket(shape.down_bytes_per_s * s, shape.burst_bytes)
        self.pipes = (
            _Pipe(proxy, device, broker, up, proxy.stats.up, self._half_closed),
            _Pipe(proxy, broker, device, down, proxy.stats.down, self._half_closed),
        )

    def start(self) -> None:
        for p in self.pipes:
            p.start()

    def _half_closed(self) -> None:
        with self._lock:
            self._closed += 1
            both = self._closed == 2
        if both:
            self.close()

    def close(self) -> None:
        for sock in (self.device, self.broker):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


class LinkProxy:
    """Listens on 127.0.0.1 (port 0 = any free one) and forwards every connection to `upstream`."""

    def __init__(
        self,
        upstream: tuple[str, int],
        shape: LinkShape,
        *,
        time_scale: float = 1.0,
        host: str = "127.0.0.1",
        port: int = 0,
        seed: int = 0,
        name: str = "link",
    ) -> None:
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.upstream = upstream
        self.shape = shape
        self.time_scale = float(time_scale)
        self.name = name
        self.stats = ProxyStats()
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self._conns: list[_Connection] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._forced_until = -1.0  # simulated time until which a manual cut holds the link down
        self._down = False
        self._listener = socket.create_server((host, port))
        self._listener.settimeout(0.1)  # accept() wakes up to notice close()
        self.host, self.port = self._listener.getsockname()[:2]
        self._t0 = time.monotonic()
        self._threads = [
            threading.Thread(target=self._accept, daemon=True, name=f"{name}-accept"),
            threading.Thread(target=self._watch, daemon=True, name=f"{name}-outages"),
        ]

    # -- clock ------------------------------------------------------------------------------------
    def sim_now(self) -> float:
        """Simulated seconds since the proxy started."""
        return (time.monotonic() - self._t0) * self.time_scale

    def one_way_delay(self) -> float:
        """Real seconds a chunk spends in flight: (rtt/2 + U(-jitter/2, jitter/2)) / time_scale."""
        with self._rng_lock:
            j = self._rng.uniform(-0.5, 0.5) * self.shape.jitter_s
        return max(0.0, self.shape.rtt_s / 2 + j) / self.time_scale

    @property
    def down(self) -> bool:
        return self._down

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> LinkProxy:
        for t in self._threads:
            t.start()
        return self

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def cut(self, duration_s: float) -> None:
        """An outage now, for `duration_s` simulated seconds (tests, fault drills)."""
        self._forced_until = self.sim_now() + duration_s
        self._set_down(True)

    def close(self) -> None:
        self._stop.set()
        try:
            self._listener.close()
        except OSError:
            pass
        self._cut_all()
        for t in self._threads:
            if t.ident is not None:  # started
                t.join(2)

    def __enter__(self) -> LinkProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------------
    def _scheduled_down(self, t: float) -> bool:
        return t < self._forced_until or (self.shape.down_at is not None and self.shape.down_at(t))

    def _set_down(self, down: bool) -> None:
        if down == self._down:
            return
        self._down = down
        log.info("%s: link %s at %.1f s (simulated)", self.name, "down" if down else "up", self.sim_now())
        if down:
            self._cut_all()

    def _cut_all(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            c.close()
        if conns and not self._stop.is_set():
            self.stats.cuts += len(conns)

    def _watch(self) -> None:
        while not self._stop.wait(0.005):
            self._set_down(self._scheduled_down(self.sim_now()))

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                device, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            device.settimeout(None)
            if self._down:
                self.stats.refused += 1
                device.close()
                continue
            try:
                broker = socket.create_connection(self.upstream, timeout=10)
                broker.settimeout(None)
            except OSError as exc:
                log.warning("%s: cannot reach the broker at %s:%d: %s", self.name, *self.upstream, exc)
                device.close()
                continue
            for sock in (device, broker):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(self, device, broker)
            with self._lock:
                self._conns.append(conn)
            self.stats.connections += 1
            conn.start()

"""The shaping proxy: rate, delay and outages, measured on loopback with the time scale (fast)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import pytest

from protofl.profiles import Outage
from protofl.transport.link_proxy import LinkProxy, LinkShape, TokenBucket
from tests.conftest import EVENT_WAIT_S


class Sink:
    """A TCP server that counts what it receives and records when each connection's last byte came."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.received = 0
        self.done = threading.Event()
        self.expected = 0
        self.t_done = 0.0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                self.received += len(data)
                if self.expected and self.received >= self.expected:
                    self.t_done = time.monotonic()
                    self.done.set()


def test_token_bucket_spends_its_burst_then_holds_the_rate() -> None:
    b = TokenBucket(rate=1000.0, burst=500.0)
    # Idle for long: 500 bytes of credit, so 500 bytes leave at once (t = 10 - 0.5 + 0.5 = 10) ...
    assert b.reserve(500, now=10.0) == pytest.approx(10.0)
    # ... and the next 1000 take a second at 1000 B/s.
    assert b.reserve(1000, now=10.0) == pytest.approx(11.0)
    # Credit never sends a chunk into the past (it would eat the link's delay): idle again, 100 B leave now.
    assert b.reserve(100, now=20.0) == pytest.approx(20.0)


def test_small_messages_still_take_the_one_way_delay() -> None:
    sink = Sink()
    sink.expected = 100
    shape = LinkShape(up_bytes_per_s=7812.5, down_bytes_per_s=3400, rtt_s=1.6, jitter_s=0.0)  # nb-iot
    scale = 2.0  # 0.4 s of real time: a loaded machine's late wake-ups (tens of ms) stay well inside the bounds
    with LinkProxy(("127.0.0.1", sink.port), shape, time_scale=scale) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port)) as c:
            t0 = time.monotonic()
            c.sendall(b"x" * 100)
            assert sink.done.wait(EVENT_WAIT_S)
    # 0.8 s one way + 100 B / 7812.5 B/s (13 ms; within the burst, so no wait at all): 0.8 simulated s, never less,
    # and well under the round trip (1.6 s) that a message waiting for an answer would take
    simulated = (sink.t_done - t0) * scale
    assert 0.75 <= simulated <= 1.2, f"100 B took {simulated:.3f} simulated s over a link of 0.8 s one way"


def test_one_megabit_link_moves_one_megabyte_in_eight_simulated_seconds() -> None:
    # 1 Mbit/s = 125,000 B/s: 1,000,000 B take 8.0 s. At time scale 10 that is 0.8 s of real time.
    scale, n = 10.0, 1_000_000
    sink = Sink()
    sink.expected = n
    shape = LinkShape(up_bytes_per_s=125_000, down_bytes_per_s=125_000, rtt_s=0.05, jitter_s=0.0)
    with LinkProxy(("127.0.0.1", sink.port), shape, time_scale=scale) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port)) as c:
            t0 = time.monotonic()
            c.sendall(b"x" * n)
            assert sink.done.wait(EVENT_WAIT_S), f"only {sink.received} of {n} bytes arrived"
        simulated = (sink.t_done - t0) * scale
        print(
            f"1 MB over 1 Mbit/s: {simulated:.2f} simulated s (real {sink.t_done - t0:.3f} s at time scale {scale:g})"
        )
    # 8 s of serialisation + 25 ms one-way delay; within 10 % of 8 s.
    assert 7.2 <= simulated <= 8.8, f"1 MB took {simulated:.2f} simulated s over a 1 Mbit/s link"


def wait_until(cond: Callable[[], bool], what: str, timeout: float = EVENT_WAIT_S) -> None:
    """Wait for `cond` (the proxy's watcher thread acts within a few ms); fail after `timeout` s."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"no {what} within {timeout} s"
        time.sleep(0.002)


def test_an_outage_cuts_connections_and_refuses_new_ones_until_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    sink = Sink()
    # Down from simulated 1.0 s to 3.0 s (every 1000 s), on the proxy's simulated clock.
    shape = LinkShape(1e6, 1e6, down_at=Outage(every_s=1000, duration_s=2.0, first_s=1.0).down_at)
    proxy = LinkProxy(("127.0.0.1", sink.port), shape, time_scale=10)
    before = time.monotonic()
    simulated = proxy.sim_now()
    after = time.monotonic()
    assert (before - proxy._t0) * 10 <= simulated <= (after - proxy._t0) * 10  # real time x the time scale
    # From here the test moves the simulated clock: each check below runs at a simulated time that cannot
    # pass while it runs, however slowly a loaded machine runs it.
    now = [0.0]
    monkeypatch.setattr(proxy, "sim_now", lambda: now[0])
    with proxy:
        c = socket.create_connection(("127.0.0.1", proxy.port))
        sink.expected = 5
        c.sendall(b"hello")
        assert sink.done.wait(EVENT_WAIT_S), "hello did not get through the link while it was up"
        now[0] = 1.5  # down
        wait_until(lambda: proxy.down, "outage at simulated 1.5 s")
        # The watcher sets `down` and then cuts (the count follows the closing): wait for the count.
        wait_until(lambda: proxy.stats.cuts >= 1, "the outage's cut")
        assert proxy.stats.cuts == 1
        c.settimeout(10)
        assert c.recv(10) == b""  # the proxy closed our connection
        c.close()
        refused = socket.create_connection(("127.0.0.1", proxy.port))
        refused.settimeout(10)
        assert refused.recv(10) == b""
        refused.close()
        assert proxy.stats.refused == 1
        now[0] = 3.5  # up again
        wait_until(lambda: not proxy.down, "end of the outage at simulated 3.5 s")
        sink.done.clear()
        sink.expected = 10
        with socket.create_connection(("127.0.0.1", proxy.port)) as again:
            again.sendall(b"world")
            assert sink.done.wait(EVENT_WAIT_S), "world did not get through after the outage"
    assert sink.received == 10 and proxy.stats.refused == 1 and proxy.stats.cuts == 1

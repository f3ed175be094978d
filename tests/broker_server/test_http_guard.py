"""The live page and `/metrics` against DNS rebinding and slowloris (issue 43; httpd.py)."""

from __future__ import annotations

import http.client
import logging
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from broker_server.watch.board import SnapshotBoard
from broker_server.watch.httpd import MAX_CONNECTIONS, allowed_hosts, host_allowed
from broker_server.watch.metrics import FederationMetrics, HttpEndpoint, serve_metrics
from broker_server.watch.ui import serve_ui

HALF_OPEN = 300


@pytest.fixture(params=["ui", "metrics"])
def endpoint(request: pytest.FixtureRequest) -> Iterator[HttpEndpoint]:
    board = SnapshotBoard()
    served = (
        serve_ui(board, "127.0.0.1", 0, None)
        if request.param == "ui"
        else serve_metrics(FederationMetrics(board), "127.0.0.1", 0)
    )
    try:
        yield served
    finally:
        served.close()


def get(url: str, host: str | None = None, timeout: float = 5.0) -> int:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    try:
        conn.putrequest("GET", parts.path or "/", skip_host=host is not None)
        if host is not None:
            conn.putheader("Host", host)
        conn.endheaders()
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_a_foreign_host_header_is_refused(endpoint: HttpEndpoint, caplog: pytest.LogCaptureFixture) -> None:
    port = urlsplit(endpoint.url).port
    ok = {200, 503}  # the page, or its data before the first snapshot
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}", f"192.0.2.7:{port}"):
        assert get(endpoint.url, host) in ok, host
    with caplog.at_level(logging.WARNING, logger="protofl.service"):
        for host in (f"evil.example:{port}", "evil.example", "127.0.0.1.evil.example", "localhost.evil.example"):
            assert get(endpoint.url, host) == 421, host
    assert sum("DNS rebinding" in r.getMessage() for r in caplog.records) == 1  # logged once


def test_the_allowed_names_follow_the_bound_host() -> None:
    assert host_allowed("my-box:9100", allowed_hosts("my-box"))
    assert not host_allowed("my-box:9100", allowed_hosts("127.0.0.1"))
    assert host_allowed(f"{socket.gethostname()}:80", allowed_hosts("0.0.0.0"))
    assert not host_allowed(None, allowed_hosts("127.0.0.1"))


def test_half_open_connections_leave_threads_bounded_and_the_server_answering(
    endpoint: HttpEndpoint, caplog: pytest.LogCaptureFixture
) -> None:
    """300 half-open connections, not the 1,500 of the report: each holds a descriptor in this process as
    well as in the server's, and 1,500 of both would pass the usual limit of 1,024 open files (ulimit -n)
    of a test process; 300 is already ten times the connections served at once."""
    parts = urlsplit(endpoint.url)
    before = threading.active_count()
    held: list[socket.socket] = []
    with caplog.at_level(logging.DEBUG, logger="protofl.service"):
        try:
            for _ in range(HALF_OPEN):
                s = socket.create_connection((parts.hostname, parts.port or 80), timeout=5)
                s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never ends its headers
                held.append(s)
            time.sleep(0.5)
            assert threading.active_count() - before <= MAX_CONNECTIONS + 2
            started = time.monotonic()
            assert get(endpoint.url) in {200, 503}  # answered while the flood holds on
            assert time.monotonic() - started < 3.0
            assert threading.active_count() - before <= MAX_CONNECTIONS + 2
        finally:
            for s in held:
                s.close()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "connections taken" in warnings[0].getMessage()
    assert not any(r.exc_info for r in caplog.records if r.levelno > logging.DEBUG)


def test_a_request_trickled_a_byte_at_a_time_is_cut_at_its_deadline(endpoint: HttpEndpoint) -> None:
    """Slowloris by trickle: one byte every 0.3 s never trips the 5 s read timeout; the request deadline cuts it."""
    endpoint.server.request_deadline = 1.5
    parts = urlsplit(endpoint.url)
    trickling = [socket.create_connection((parts.hostname, parts.port or 80), timeout=5) for _ in range(8)]
    request = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 1000
    cut: list[int] = []
    try:
        started = time.monotonic()
        for i in range(len(request)):
            for n, s in enumerate(trickling):
                if n in cut:
                    continue
                try:
                    s.sendall(request[i : i + 1])
                except OSError:
                    cut.append(n)  # the server shut the connection: the event this test waits for
            if len(cut) == len(trickling) or time.monotonic() - started > 15:
                break
            time.sleep(0.3)
        elapsed = time.monotonic() - started
        assert sorted(cut) == list(range(len(trickling))), f"still open after {elapsed:.1f} s: trickle not cut"
        assert elapsed >= 1.5  # not before its deadline
        assert endpoint.server.overdue >= len(trickling)
        assert get(endpoint.url) in {200, 503}  # and the server answers
    finally:
        for s in trickling:
            s.close()

"""The HTTP server under the live page and `/metrics`: bounded, timed out, and deaf to foreign `Host`s.

- DNS rebinding: a web page the operator opens can point a name it owns at 127.0.0.1 and read a loopback
  endpoint through the browser, which then sends `Host: that.name`. A request is answered only when its
  `Host` is a loopback name, an IP literal (no rebinding goes through a literal), the configured host, or,
  bound to every address, this machine's own names; any other gets 421 and nothing else.
- Slowloris: at most `MAX_CONNECTIONS` connections are served at once, each by a thread of its own that
  gives up on a client silent for `READ_TIMEOUT` seconds. When all are taken, a new connection takes the
  slot of the oldest one that is not being answered (still sending its request, or idle between two), so
  that a flood of half-open connections cannot keep the operator out; when none can be taken, the new one
  is closed at once. The first connection closed in a burst is logged (a WARNING), the rest counted, never
  a traceback per socket.
- Byte trickle: a client that sends one byte every few seconds never trips the read timeout, so a request
  must also be complete within `REQUEST_DEADLINE` seconds of its first byte being awaited; a connection
  past it is cut when the next one arrives or by the server's sweep about every second, whichever
  comes first (the thread that served it ends, its slot frees).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("protofl.service")
MAX_CONNECTIONS = 32
READ_TIMEOUT = 5.0
REQUEST_DEADLINE = 10.0
BACKLOG = 64
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def host_name(header: str) -> str:
    """The name in a `Host` header, without its port or brackets, lowercased."""
    value = header.strip().lower().rstrip(".")
    if value.startswith("["):
        return value[1:].partition("]")[0]
    if value.count(":") == 1:
        return value.partition(":")[0].rstrip(".")
    return value


def allowed_hosts(bound: str) -> frozenset[str]:
    """The names (besides IP literals) a request may give in `Host` for a server bound to `bound`."""
    names = set(LOOPBACK_NAMES)
    names.add(host_name(bound) if bound not in WILDCARDS else "localhost")
    if bound in WILDCARDS:
        for name in (socket.gethostname(), socket.getfqdn()):
            names.add(name.lower().rstrip("."))
    return frozenset(names)


def host_allowed(header: str | None, allowed: frozenset[str]) -> bool:
    if not header:
        return False
    name = host_name(header)
    if name in allowed:
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class GuardedHandler(BaseHTTPRequestHandler):
    """A handler whose socket times out, and which refuses a foreign `Host` before `do_GET` runs."""

    server: BoundedHTTPServer
    timeout = READ_TIMEOUT

    def setup(self) -> None:
        super().setup()
        self.server.track(self.connection, busy=False)

    def handle_one_request(self) -> None:
        self.server.track(self.connection, busy=False)
        super().handle_one_request()

    def finish(self) -> None:
        self.server.untrack(self.connection)
        super().finish()

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        self.server.track(self.connection, busy=True)
        if host_allowed(self.headers.get("Host"), self.server.allowed_hosts):
            return True
        body = b"misdirected request: this server answers its own address and loopback names only\n"
        self.close_connection = True
        self.send_response(421)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.server.note_foreign_host(self.headers.get("Host", ""))
        return False

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's signature
        log.debug("%s: " + format, self.server.label, *args)


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, `max_connections` at most; the others are closed as they come."""

    daemon_threads = True
    request_queue_size = BACKLOG

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[GuardedHandler],
        label: str,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.label = label
        self.allowed_hosts = allowed_hosts(address[0])
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self._refusing = False
        self._open: dict[Any, tuple[bool, float]] = {}  # connection -> (being answered, since), oldest first
        self.request_deadline = REQUEST_DEADLINE
        self.overdue = 0
        self._last_sweep = time.monotonic()
        self.refused = 0
        self.evicted = 0
        self.foreign_hosts = 0
        super().__init__(address, handler)

    def track(self, connection: Any, busy: bool) -> None:
        with self._lock:
            self._open[connection] = (busy, time.monotonic())

    def untrack(self, connection: Any) -> None:
        with self._lock:
            self._open.pop(connection, None)

    def _evict_one(self) -> bool:
        """Cut the oldest connection not being answered (its thread then ends and frees its slot)."""
        with self._lock:
            idle = next((c for c, (busy, _) in self._open.items() if not busy), None)
            if idle is None:
                return False
            del self._open[idle]
            self.evicted += 1
        try:
            idle.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        return True

    def _cut_overdue(self) -> None:
        """Cut the connections whose request is not complete `request_deadline` seconds after it was awaited."""
        limit = time.monotonic() - self.request_deadline
        with self._lock:
            late = [c for c, (busy, since) in self._open.items() if not busy and since < limit]
            for c in late:
                del self._open[c]
            self.overdue += len(late)
        for c in late:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if late:
            log.debug(
                "%s: cut %d connection(s) still sending a request after %.0f s",
                self.label,
                len(late),
                self.request_deadline,
            )

    def service_actions(self) -> None:
        # serve_forever's loop calls this about every half second; the sweep runs at most once a second.
        now = time.monotonic()
        if now - self._last_sweep >= min(self.request_deadline, 1.0):
            self._last_sweep = now
            self._cut_overdue()

    def process_request(self, request: Any, client_address: Any) -> None:
        self._cut_overdue()
        if not self._slots.acquire(blocking=False):
            self._note_full()
            if not (self._evict_one() and self._slots.acquire(timeout=1.0)):
                self.refused += 1
                self.shutdown_request(request)
                return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def _note_full(self) -> None:
        if not self._refusing:
            self._refusing = True
            log.warning(
                "%s: all %d connections taken; cutting the oldest idle ones, refusing the rest (logged once per burst)",
                self.label,
                self.max_connections,
            )

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()
            with self._lock:
                calm = self._refusing and len(self._open) <= self.max_connections // 4
                if calm:
                    self._refusing = False
            if calm:
                log.info(
                    "%s: the burst is over (%d connections cut, %d refused so far)",
                    self.label,
                    self.evicted,
                    self.refused,
                )

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that resets, or goes silent past the timeout: one line at DEBUG, not a traceback on stderr.
        log.debug("%s: a connection from %s ended in an error", self.label, client_address, exc_info=True)

    def note_foreign_host(self, host: str) -> None:
        with self._lock:
            self.foreign_hosts += 1
            first = self.foreign_hosts == 1
        if first:
            log.warning(
                "%s: refused a request for Host %r (DNS rebinding?); answered only for loopback names, IP "
                "addresses and its own host (logged once)",
                self.label,
                host[:100],
            )

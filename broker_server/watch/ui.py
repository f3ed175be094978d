"""The live page (`start --ui-port`): devices, a round timeline, accuracy and bytes curves.

A small HTTP server in threads of its own: `/` is the page (page.html, drawn in the browser),
`/api/summary` the latest snapshot as JSON (the same document as `server/summary` and status.json).
It reads the `SnapshotBoard` only. On loopback it is open, as the machine's own users are; bound to any
other address it asks for a password (HTTP Basic, user `protofl`): `--ui-password`, or one generated
once into `state_dir/security/ui-password`. Basic auth over plain HTTP sends that password in clear:
beyond a trusted network put the page behind a TLS proxy or an SSH tunnel (SECURITY.md). The server
(httpd.py) answers only loopback names, IP addresses and its own host in `Host` (DNS rebinding), and
serves a bounded number of connections, each with a read timeout.
"""

from __future__ import annotations

import base64
import hmac
import importlib.resources
import logging
import threading
from pathlib import Path

from broker_server.watch.board import SnapshotBoard
from broker_server.watch.httpd import BoundedHTTPServer, GuardedHandler
from broker_server.watch.metrics import HttpEndpoint
from protofl.errors import ConfigError

log = logging.getLogger("protofl.service")
UI_USER = "protofl"
PASSWORD_FILE = "ui-password"


def page_html() -> bytes:
    return importlib.resources.files("broker_server.watch").joinpath("page.html").read_bytes()


def ui_password(given: str | None, host: str, loopback: bool, security_dir: Path | None) -> str | None:
    """The page's password: the one given; else, beyond loopback, the generated one (kept across restarts
    in `security_dir/ui-password`, or for this run only); None on loopback without one."""
    from broker_server.security import new_password, write_secret

    if given:
        return given
    if loopback:
        return None
    if security_dir is None:
        password = new_password()
        log.warning(
            "the live page on %s asks for a password (user %s): %s (no --state-dir: this run only; "
            "--ui-password sets one)",
            host,
            UI_USER,
            password,
        )
        return password
    path = security_dir / PASSWORD_FILE
    if path.exists():
        return path.read_text().strip()
    security_dir.mkdir(parents=True, exist_ok=True)
    write_secret(path, new_password() + "\n")
    log.info("the live page asks for a password (user %s): it is in %s", UI_USER, path)
    return path.read_text().strip()


class _Handler(GuardedHandler):
    server: _UiServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if not self._authorized():
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="protofl", charset="UTF-8"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        path = self.path.split("?", 1)[0]
        if path in ("/", "/index.html"):
            self._send(200, "text/html; charset=utf-8", self.server.page)
        elif path == "/api/summary":
            version, body = self.server.board.latest_body()
            if version == 0:
                self._send(503, "application/json", b'{"error": "the federation is starting"}')
            else:
                self._send(200, "application/json", body)
        else:
            self._send(404, "text/plain; charset=utf-8", b"not found: the page is at /, its data at /api/summary\n")

    def _authorized(self) -> bool:
        password = self.server.password
        if password is None:
            return True
        header = self.headers.get("Authorization", "")
        if not header.startswith("Basic "):
            return False
        try:
            user, _, given = base64.b64decode(header[6:], validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        # Both compared in constant time, and both always compared.
        ok_user = hmac.compare_digest(user.encode(), UI_USER.encode())
        ok_password = hmac.compare_digest(given.encode(), password.encode())
        return ok_user and ok_password

    def _send(self, code: int, kind: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header(
            "Content-Security-Policy", "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'"
        )
        self.end_headers()
        self.wfile.write(body)


class _UiServer(BoundedHTTPServer):
    def __init__(self, address: tuple[str, int], board: SnapshotBoard, password: str | None) -> None:
        self.board = board
        self.password = password
        self.page = page_html()
        super().__init__(address, _Handler, "the live page")


def serve_ui(board: SnapshotBoard, host: str, port: int, password: str | None) -> HttpEndpoint:
    """Serve the live page on host:port (0: any free port) in a thread of its own."""
    try:
        server = _UiServer((host, port), board, password)
    except OSError as exc:
        raise ConfigError(
            f"--ui-port {port} on {host}: {exc.strerror or exc} (another port, or 0 for any free one)"
        ) from None
    thread = threading.Thread(target=server.serve_forever, name="protofl-ui", daemon=True)
    thread.start()
    shown = f"[{host}]" if ":" in host else host
    return HttpEndpoint(server, thread, f"http://{shown}:{server.server_port}/")

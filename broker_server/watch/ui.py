"""The live page (`start --ui-port`): devices, a round timeline, accuracy and bytes curves.

A small HTTP server in threads of its own: `/` is the page (page.html, drawn in the browser),
`/api/summary` the latest snapshot as JSON (the same document as `server/summary` and status.json),
`/logs/ID` device ID's newest log lines as the server keeps them (broker_server/ops/device_logs.py: `join
--ship-logs`), linked from the page's device rows: read only, the last `LOG_VIEW_BYTES`, HTML-escaped, and only
for an ID that is a valid device name (nothing else ever names a file). It reads the `SnapshotBoard` and the
device logs' directory only. On loopback it is open, as the machine's own users are; bound to any
other address it asks for a password (HTTP Basic, user `protofl`): `--ui-password`, or one generated
once into `state_dir/security/ui-password`. Basic auth over plain HTTP sends that password in clear:
beyond a trusted network put the page behind a TLS proxy or an SSH tunnel (SECURITY.md). The server
(httpd.py) answers only loopback names, IP addresses and its own host in `Host` (DNS rebinding), and
serves a bounded number of connections, each with a read timeout.
"""

from __future__ import annotations

import base64
import hmac
import html
import importlib.resources
import logging
import threading
from pathlib import Path

from broker_server.watch.board import SnapshotBoard
from broker_server.watch.httpd import BoundedHTTPServer, GuardedHandler
from broker_server.watch.metrics import HttpEndpoint
from protofl.errors import ConfigError
from protofl.names import is_valid_name

log = logging.getLogger("protofl.service")
UI_USER = "protofl"
PASSWORD_FILE = "ui-password"
LOG_VIEW_BYTES = 64 * 1024  # the newest part of a device's log a page shows (`protofl-server logs` shows it all)


def page_html() -> bytes:
    return importlib.resources.files("broker_server.watch").joinpath("page.html").read_bytes()


def ui_password(given: str | None, host: str, loopback: bool, security_dir: Path | None) -> str | None:
    """The page's password: the one given; else, beyond loopback, the generated one (kept across restarts
    in `security_dir/ui-password`, or for this run only); None on loopback without one."""
    from broker_server.ops.security import new_password, write_secret

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
        elif path.startswith("/logs/"):
            self._device_log(path[len("/logs/") :])
        else:
            self._send(404, "text/plain; charset=utf-8", b"not found: the page is at /, its data at /api/summary\n")

    def _device_log(self, device: str) -> None:
        from broker_server.ops.device_logs import tail

        directory = self.server.logs_dir
        if directory is None or not is_valid_name(device):
            self._send(404, "text/plain; charset=utf-8", b"not found: no device logs here, or not a device id\n")
            return
        text = tail(directory, device, LOG_VIEW_BYTES) or f"no log lines from {device} yet (join --ship-logs)"
        page = (
            '<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f"<title>{html.escape(device)}: log</title></head><body>"
            f'<p><a href="../">back to the live page</a> | {html.escape(device)}\'s newest log lines (at most '
            f"{LOG_VIEW_BYTES // 1024} KB; protofl-server logs {html.escape(device)} shows them all)</p>"
            f"<pre>{html.escape(text)}</pre></body></html>"
        )
        self._send(200, "text/html; charset=utf-8", page.encode())

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
    def __init__(
        self, address: tuple[str, int], board: SnapshotBoard, password: str | None, logs_dir: Path | None
    ) -> None:
        self.board = board
        self.password = password
        self.logs_dir = logs_dir
        self.page = page_html()
        super().__init__(address, _Handler, "the live page")


def serve_ui(
    board: SnapshotBoard, host: str, port: int, password: str | None, logs_dir: Path | None = None
) -> HttpEndpoint:
    """Serve the live page on host:port (0: any free port) in a thread of its own; `logs_dir`: where the devices'
    log lines are kept (None: /logs/ID finds none)."""
    try:
        server = _UiServer((host, port), board, password, logs_dir)
    except OSError as exc:
        raise ConfigError(
            f"--ui-port {port} on {host}: {exc.strerror or exc} (another port, or 0 for any free one)"
        ) from None
    thread = threading.Thread(target=server.serve_forever, name="protofl-ui", daemon=True)
    thread.start()
    shown = f"[{host}]" if ":" in host else host
    return HttpEndpoint(server, thread, f"http://{shown}:{server.server_port}/")

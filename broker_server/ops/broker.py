"""A local broker for development, simulation and tests.

`mosquitto` (from PATH, or the usual sbin directories that a non-root PATH lacks) runs with a config
generated in a working directory: one listener (127.0.0.1 unless told otherwise), an explicit
`max_packet_size` and `max_queued_messages` (sized from the fleet: broker_server/ops/capacity.py), `$SYS`
every `sys_interval` seconds (the server reads the dropped-messages counter there), persistence so that
a restart keeps retained messages and sessions, and, from `protofl-server start`, a password file and
ACL (broker_server/ops/security.py).
Without mosquitto an embedded amqtt broker (MQTT 3.1.1, dev only) runs in a thread of this process;
it enforces no password or ACL, so `start` refuses it without `--insecure`.

Readiness means our own broker answered: a port that is already taken is an error naming it, and the
broker is ready only when its process is alive, owns the listening socket (Linux: /proc) and answers
an MQTT CONNECT, not merely when something accepts TCP on the port.

`local_socket` adds a unix socket listener for the server's own connection (`unix_url`), in the work
directory (made 0700) or, when that path is too long for a socket address, in a private temporary
directory. Nobody else can bind a socket there, so a process that takes the TCP port while the broker
is down never gets the server's connection, its password or its messages.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal

from broker_server.ops.capacity import DEFAULT_QUEUE
from protofl.errors import ProtoFLError
from protofl.transport.broker_url import DEFAULT_MAX_PACKET

log = logging.getLogger("protofl.broker")
SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/opt/homebrew/sbin", "/sbin")
PACKET_HEADROOM = 64 * 1024  # an MQTT PUBLISH's fixed header, topic and properties around the payload
INSTALL_HINT = "install it with: sudo apt-get install mosquitto (macOS: brew install mosquitto)"
SOCKET_NAME = "mosquitto.sock"
MAX_SOCKET_PATH = 100  # bytes; sockaddr_un holds 108 with its NUL (104 on macOS): keep a margin
# How often mosquitto publishes $SYS, including `$SYS/broker/publish/messages/dropped` (default 10 s): the
# server learns of drops from it, so this bounds how long a round waits before devices are asked to re-send.
SYS_INTERVAL_S = 1
# Mosquitto's count of messages it dropped for any client whose queue was full (verified on 2.0.11; its log
# says "Outgoing messages are being dropped for client X" once only, not per message).
DROPPED_TOPIC = "$SYS/broker/publish/messages/dropped"


class BrokerStartError(ProtoFLError, RuntimeError):
    """The local broker could not be started."""


def find_mosquitto() -> str | None:
    """Path of the mosquitto binary: PATH first, then sbin directories (Debian installs it in /usr/sbin)."""
    found = shutil.which("mosquitto")
    if found:
        return found
    for d in SBIN_DIRS:
        p = Path(d) / "mosquitto"
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class ListenerTls:
    """TLS on the broker's listener: its certificate and key, and the CA that signs client certificates
    (required of every client when `require_client_cert`)."""

    certfile: str
    keyfile: str
    cafile: str
    require_client_cert: bool = False

    def lines(self) -> list[str]:
        return [
            f"cafile {self.cafile}",
            f"certfile {self.certfile}",
            f"keyfile {self.keyfile}",
            "tls_version tlsv1.2",  # the oldest version allowed; 1.3 is negotiated where both have it
            f"require_certificate {'true' if self.require_client_cert else 'false'}",
        ]


class PortInUse(BrokerStartError):
    """Something else already listens on the broker's port."""


def check_port_free(host: str, port: int) -> None:
    """Raise PortInUse naming the port if another process listens there (we bind it and let go)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the broker does: TIME_WAIT is no clash
        try:
            s.bind((host, port))
        except OSError as exc:
            raise PortInUse(
                f"port {port} on {host} is already in use ({exc.strerror}): another broker or program "
                f"listens there; stop it, join it with --broker mqtt://{host}:{port}, or choose "
                f"another port"
            ) from None


# MQTT 3.1.1 CONNECT, clean session, keepalive 5 s, client id "protofl-ready"; any CONNACK (accepted or
# "not authorized") proves an MQTT broker answered.
_PROBE = bytes([0x10, 25, 0, 4]) + b"MQTT" + bytes([4, 2, 0, 5, 0, 13]) + b"protofl-ready"


def _mqtt_answers(host: str, port: int, tls: bool = False) -> bool:
    if tls:
        return _tls_answers(host, port)
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            return _connack(s)
    except OSError:
        return False


def _unix_answers(path: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(0.5)
            s.connect(str(path))
            return _connack(s)
    except OSError:
        return False


def _connack(s: socket.socket) -> bool:
    s.settimeout(0.5)
    s.sendall(_PROBE)
    head = s.recv(4)
    return len(head) >= 2 and head[0] == 0x20


def _tls_answers(host: str, port: int) -> bool:
    """Something completed or refused a TLS handshake (a listener that demands a client certificate
    refuses ours, which still proves a TLS server answered; /proc says whose it is)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # a probe of our own listener, no data sent
    try:
        with socket.create_connection((host, port), timeout=0.5) as raw:
            with ctx.wrap_socket(raw) as s:
                s.settimeout(0.5)
                return True
    except ssl.SSLError:
        return True
    except OSError:
        return False


def _listening_inodes(port: int) -> set[str] | None:
    """Inodes of the sockets listening on `port` (Linux /proc/net/tcp*); None where /proc is missing."""
    found: set[str] = set()
    seen_any = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        seen_any = True
        local = f":{port:04X} "  # the local address column ends with the port in hex: skip other rows unsplit
        for row in rows:
            if local not in row:
                continue
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                found.add(cols[9])
    return found if seen_any else None


def _owns_listener(pid: int, port: int) -> bool:
    """Whether process `pid` holds a socket listening on `port` (True where /proc cannot tell)."""
    inodes = _listening_inodes(port)
    if inodes is None:
        return True
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        links = {os.readlink(fd_dir / fd) for fd in os.listdir(fd_dir)}
    except OSError:
        return True  # not ours to inspect (another user's /proc); the MQTT answer must do
    return any(f"socket:[{i}]" in links for i in inodes)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


_PR_SET_PDEATHSIG = 1
_LIBC = None
try:  # loaded before any fork: the child only calls it
    import ctypes

    _LIBC = ctypes.CDLL(None, use_errno=True) if os.uname().sysname == "Linux" else None
except (OSError, ImportError):  # pragma: no cover - not Linux
    _LIBC = None


def _die_with_parent() -> None:
    """In the forked child, before exec: SIGTERM when the parent thread dies (Linux prctl)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class LocalBroker:
    """Common surface of the two local brokers: `url`, `start()`, `stop()`, context manager."""

    kind: str = ""
    protocol: Literal["auto", "3.1.1"] = "auto"  # what a client should ask for first

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"mqtt://{host}:{self.port}"

    def start(self) -> LocalBroker:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def restart(self) -> None:
        """Stop and start again on the same port (clients must reconnect by themselves)."""
        self.stop()
        self.start()

    def __enter__(self) -> LocalBroker:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


MOSQUITTO_USER = "mosquitto"  # the user mosquitto drops to when started as root


class MosquittoBroker(LocalBroker):
    kind = "mosquitto"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        workdir: str | Path | None = None,
        *,
        binary: str | None = None,
        max_packet_size: int = DEFAULT_MAX_PACKET,
        max_queued_messages: int = DEFAULT_QUEUE,
        persistence: bool = True,
        allow_anonymous: bool = True,
        extra_config: Sequence[str] = (),
        tls: ListenerTls | None = None,
        die_with_parent: bool = False,
        local_socket: bool = False,
        drop_root: bool = False,
    ) -> None:
        super().__init__(host, port)
        # drop_root: a config run by an operator (a site broker's): as root, mosquitto drops to its own user
        # (its files are handed to that user: bridge.py). Else, as root, ours keeps root to write our work dir.
        self.drop_root = drop_root
        # die_with_parent (Linux): the kernel sends mosquitto SIGTERM when the thread that started it dies,
        # even by SIGKILL, so a crashed server leaves no orphan broker; SIGTERM makes it save its
        # persistence file first, which the restarted server's broker loads.
        self.die_with_parent = die_with_parent
        found = binary or find_mosquitto()
        if found is None:
            raise BrokerStartError(f"mosquitto not found on PATH or in {', '.join(SBIN_DIRS)}; {INSTALL_HINT}")
        self.binary: str = found
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if not workdir:
            self._tmp = tempfile.TemporaryDirectory(prefix="protofl-mosquitto-")
            workdir = self._tmp.name
        self.workdir = Path(workdir)
        self._socket_tmp: str | None = None
        self.socket_path = self._socket_path() if local_socket else None
        self.max_packet_size = max_packet_size
        self.max_queued_messages = max_queued_messages
        self.persistence = persistence
        self.allow_anonymous = allow_anonymous
        self.extra_config = list(extra_config)  # e.g. password_file, acl_file
        self.tls = tls
        self.proc: subprocess.Popen[bytes] | None = None
        self._auto_port = port == 0  # a restart keeps the port; only a clash at first start picks another

    @property
    def url(self) -> str:
        return super().url.replace("mqtt://", "mqtts://") if self.tls else super().url

    @property
    def unix_url(self) -> str:
        """The server's own way in (`unix:///...`); needs `local_socket`."""
        if self.socket_path is None:
            raise BrokerStartError("this broker has no unix socket listener (local_socket=False)")
        return f"unix://{self.socket_path}"

    def _socket_path(self) -> Path:
        """The socket in the work directory, or in a private (0700) temporary directory when that path is
        too long for a socket address."""
        path = self.workdir.resolve() / SOCKET_NAME
        if len(str(path).encode()) <= MAX_SOCKET_PATH:
            return path
        self._socket_tmp = tempfile.mkdtemp(prefix="protofl-mqtt-")  # mode 0700
        return Path(self._socket_tmp) / SOCKET_NAME

    @property
    def config_path(self) -> Path:
        return self.workdir / "mosquitto.conf"

    @property
    def log_path(self) -> Path:
        return self.workdir / "mosquitto.log"

    @property
    def pid_path(self) -> Path:
        return self.workdir / "mosquitto.pid"

    @property
    def db_path(self) -> Path:
        return self.workdir / "mosquitto.db"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def reap_stale(self, timeout: float = 10.0) -> None:
        """A mosquitto still running on this work directory's config (left by a server that died where
        the kernel could not stop it) is stopped, never silently reused: it would hold the port and an
        older config. It may also be one still saving its persistence after our parent died: wait for it."""
        try:
            pid = int(self.pid_path.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return
        if str(self.config_path).encode() not in cmdline:
            return  # the pid was reused by something else
        log.warning("mosquitto (pid %d) from an earlier run still serves %s: stopping it", pid, self.config_path)
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return
            end = time.monotonic() + wait
            while time.monotonic() < end:
                if not Path(f"/proc/{pid}").exists() or _is_zombie(pid):
                    return
                time.sleep(0.05)

    def write_config(self) -> Path:
        lines = [
            "# generated by protofl-edge: a local development broker",
            f"listener {self.port} {self.host}",
            *(self.tls.lines() if self.tls else []),
            # Port 0 and a path: a unix socket (no TLS: its directory keeps others out). The password file
            # and ACL apply to every listener (per_listener_settings is off).
            *([f"listener 0 {self.socket_path}"] if self.socket_path else []),
            f"allow_anonymous {'true' if self.allow_anonymous else 'false'}",
            f"max_packet_size {self.max_packet_size}",
            # QoS 1 messages the broker holds for one slow client beyond those in flight; beyond it they are
            # dropped (counted in $SYS, after they were acknowledged to their senders). All devices upload at
            # the same moment, so the aggregator's queue must hold a round's burst: capacity.queue_for_fleet.
            f"max_queued_messages {self.max_queued_messages}",
            f"sys_interval {SYS_INTERVAL_S}",
            "log_dest stderr",
            "log_type error",
            "log_type warning",
            "log_type notice",
        ]
        if self.persistence:
            lines += ["persistence true", f"persistence_location {self.workdir}/"]
        if self.die_with_parent:
            lines.append(f"pid_file {self.pid_path}")
        lines += self.extra_config
        if os.geteuid() == 0:
            # As root mosquitto drops privileges to user "mosquitto", who cannot write our work directory.
            lines.append(f"user {MOSQUITTO_USER if self.drop_root else 'root'}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.socket_path is not None:
            os.chmod(self.workdir, 0o700)  # where the server's socket lives: nobody else may bind one there
        self.config_path.write_text("\n".join(lines) + "\n")
        return self.config_path

    def start(self, timeout: float = 10.0) -> MosquittoBroker:
        for attempt in range(3):
            if self.port == 0 or (attempt > 0 and self._auto_port):
                self.port = free_port(self.host)
            elif not self._auto_port:
                check_port_free(self.host, self.port)
            if self.die_with_parent:
                self.reap_stale()
            self.write_config()
            self._remove_stale_socket()
            with self.log_path.open("ab") as out:
                self.proc = subprocess.Popen(
                    [self.binary, "-c", str(self.config_path)],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    preexec_fn=_die_with_parent if self.die_with_parent else None,
                )
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                if self.proc.poll() is not None:
                    break
                if self._answers() and self.proc.poll() is None:
                    log.info(
                        "mosquitto listening on %s%s (config %s)",
                        self.url,
                        f" and {self.unix_url}" if self.socket_path else "",
                        self.config_path,
                    )
                    self._auto_port = False  # from now on a restart keeps the port devices know
                    return self
                time.sleep(0.05)
            self._kill()
            tail = self._log_tail()
            if "Address already in use" in tail:
                if self._auto_port:
                    continue  # another process took the port we picked; pick again
                raise PortInUse(
                    f"port {self.port} on {self.host} is already in use: another program took it "
                    f"as mosquitto started; stop it or choose another port"
                )
            raise BrokerStartError(f"mosquitto did not start on {self.url} (config {self.config_path}): {tail}")
        raise BrokerStartError(f"mosquitto could not find a free port on {self.host}: {self._log_tail()}")

    def _answers(self) -> bool:
        assert self.proc is not None
        # The MQTT probe first: it fails fast while mosquitto is starting, and /proc/net/tcp, which the ownership
        # check reads, holds a row per socket on the machine (tens of thousands beside a large fleet: seconds).
        if not (_mqtt_answers(self.host, self.port, self.tls is not None) and _owns_listener(self.proc.pid, self.port)):
            return False
        return self.socket_path is None or _unix_answers(self.socket_path)

    def _remove_stale_socket(self) -> None:
        """A broker killed by a signal leaves its socket file, and mosquitto cannot bind over it."""
        if self.socket_path is not None and self.socket_path.is_socket():
            self.socket_path.unlink()

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, so mosquitto saves its persistence file; SIGKILL if it does not exit."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def cleanup(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
        if self._socket_tmp is not None:
            shutil.rmtree(self._socket_tmp, ignore_errors=True)

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.cleanup()

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def _log_tail(self, n: int = 600) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:].strip() or "(empty log)"
        except OSError:
            return "(no log)"


class AmqttBroker(LocalBroker):
    """amqtt in a background thread with its own event loop (MQTT 3.1.1 only; for development)."""

    kind = "amqtt"
    protocol = "3.1.1"

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(host, port)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._broker = None

    def start(self, timeout: float = 10.0) -> AmqttBroker:
        try:
            from amqtt.broker import Broker
        except ImportError:
            raise BrokerStartError(
                "no local broker available: mosquitto is not installed and amqtt is not "
                f"importable; {INSTALL_HINT}, or pip install 'protofl-edge[amqtt]'"
            ) from None
        for name in ("amqtt", "transitions"):  # they log every connection and state change
            logging.getLogger(name).setLevel(logging.WARNING)
        if self.port:
            check_port_free(self.host, self.port)
        self.port = self.port or free_port(self.host)
        config = {
            "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}},
            "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
        }
        ready: dict[str, object] = {}
        started = threading.Event()
        loop = asyncio.new_event_loop()

        async def boot() -> None:
            broker = Broker(config, loop=loop)
            await broker.start()
            self._broker = broker

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(boot())
            except Exception as exc:  # noqa: BLE001 - reported to start() below
                ready["error"] = exc
                started.set()
                return
            started.set()
            loop.run_forever()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="amqtt-broker", daemon=True)
        self._thread.start()
        if not started.wait(timeout) or "error" in ready:
            raise BrokerStartError(
                f"embedded amqtt broker did not start on {self.url}: {ready.get('error', 'timeout')}"
            )
        log.info("embedded amqtt broker (MQTT 3.1.1, dev only) listening on %s", self.url)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        loop, broker, self._broker = self._loop, self._broker, None
        if loop is None:
            return
        if broker is not None:
            try:
                asyncio.run_coroutine_threadsafe(broker.shutdown(), loop).result(timeout)
            except Exception as exc:  # noqa: BLE001 - stopping is best effort
                log.debug("amqtt shutdown: %s", exc)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout)
        loop.close()
        self._loop = self._thread = None


def start_local_broker(
    kind: Literal["auto", "mosquitto", "amqtt"] = "auto",
    *,
    port: int = 0,
    workdir: str | Path | None = None,
    host: str = "127.0.0.1",
    max_packet_size: int = DEFAULT_MAX_PACKET,
    auth_lines: Sequence[str] = (),
    allow_amqtt: bool = True,
    tls: ListenerTls | None = None,
    die_with_parent: bool = False,
    local_socket: bool = False,
    max_queued_messages: int = DEFAULT_QUEUE,
) -> LocalBroker:
    """Start mosquitto if installed (or asked for), else the embedded amqtt broker; returns it running.

    `auth_lines` (password file, ACL) switch anonymous access off; amqtt cannot apply them, so with
    them it is used only if `allow_amqtt` (the caller accepted an unauthenticated broker). `local_socket`
    (mosquitto only) adds the unix socket listener for the server's own connection; `max_queued_messages`
    (mosquitto only) is how many messages it holds for one subscriber (the aggregator) beyond those in flight."""
    if kind == "mosquitto" or (kind == "auto" and find_mosquitto()):
        extra = [line for line in auth_lines if not line.startswith("allow_anonymous")]  # written once, below
        return MosquittoBroker(
            host,
            port=port,
            workdir=workdir,
            max_packet_size=max_packet_size,
            allow_anonymous=not auth_lines,
            extra_config=extra,
            tls=tls,
            die_with_parent=die_with_parent,
            local_socket=local_socket,
            max_queued_messages=max_queued_messages,
        ).start()
    if kind not in ("auto", "amqtt"):
        raise BrokerStartError(f"unknown broker kind '{kind}'; use auto, mosquitto or amqtt")
    if tls is not None:
        raise BrokerStartError(f"TLS needs mosquitto (the embedded amqtt broker is plain TCP only); {INSTALL_HINT}")
    if auth_lines and not allow_amqtt:
        raise BrokerStartError(
            "the embedded amqtt broker enforces no passwords or ACL, so any process that "
            f"reaches it can read uploads and publish rounds; {INSTALL_HINT}, or pass "
            "--insecure to accept an unauthenticated development broker"
        )
    if kind == "auto":
        log.warning(
            "mosquitto not found; using the embedded amqtt broker (MQTT 3.1.1, development only). "
            "For real deployments %s",
            INSTALL_HINT,
        )
    return AmqttBroker(host, port=port).start()

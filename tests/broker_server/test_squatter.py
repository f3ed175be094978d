"""Another process takes the broker's port while the broker is down (issue 24, "Passwords to a squatter").

The server's own connection goes through the broker's unix socket, so it never reaches the squatter;
devices with the federation CA (TLS by default beyond loopback) refuse a squatter whose certificate that
CA did not sign; the supervisor says what happened and restarts the broker once the port is free. The
squatter speaks TLS (with a certificate from another CA, naming the address devices use) or plain MQTT,
whichever a client starts with, and records the user names and passwords of every CONNECT it reads.
Every wait is on an event: a log line, a CONNECT recorded, a port bound.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from broker_server.ops.broker import MosquittoBroker, _unix_answers, free_port
from broker_server.ops.pki import ensure_federation_tls
from broker_server.ops.security import load_or_create
from broker_server.ops.supervisor import BrokerSupervisor
from tests.conftest import EVENT_WAIT_S

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
pytestmark = pytest.mark.mosquitto


# -- a squatter that records CONNECT packets ---------------------------------------------------------


@dataclass(frozen=True)
class Connect:
    client_id: str
    username: str | None
    password: bytes | None


def _varint(read: Callable[[int], bytes]) -> int:
    value, shift = 0, 0
    while True:
        byte = read(1)[0]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value
        shift += 7


def parse_connect(body: bytes) -> Connect:
    """The payload fields of an MQTT 3.1.1 or 5 CONNECT (the bytes after the fixed header)."""
    pos = 0

    def take(n: int) -> bytes:
        nonlocal pos
        pos += n
        return body[pos - n : pos]

    def field() -> bytes:
        return take(int.from_bytes(take(2), "big"))

    field()  # protocol name
    level, flags = take(1)[0], take(1)[0]
    take(2)  # keepalive
    if level == 5:
        take(_varint(take))  # CONNECT properties
    client_id = field().decode()
    if flags & 0x04:  # a will: its properties (MQTT 5), topic and payload
        if level == 5:
            take(_varint(take))
        field(), field()
    username = field().decode() if flags & 0x80 else None
    password = field() if flags & 0x40 else None
    return Connect(client_id, username, password)


class Squatter:
    """Listens on (host, port); per connection, TLS if the client starts a handshake, else plain MQTT."""

    def __init__(self, host: str, port: int, certfile: Path, keyfile: Path) -> None:
        self.connects: list[Connect] = []
        self.tls_refused = 0  # handshakes the client broke off (it did not trust our certificate)
        self.got_connect = threading.Event()
        self._ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._ctx.load_cert_chain(certfile, keyfile)
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._bind(host, port)
        self._sock.listen()
        threading.Thread(target=self._accept, daemon=True).start()

    def _bind(self, host: str, port: int, timeout: float = 10.0) -> None:
        """Bind as soon as the killed broker's socket is gone (the kernel closes it when the process exits)."""
        end = time.monotonic() + timeout
        while True:
            try:
                self._sock.bind((host, port))
                return
            except OSError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.01)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        try:
            if conn.recv(1, socket.MSG_PEEK) == b"\x16":  # a TLS ClientHello
                try:
                    conn = self._ctx.wrap_socket(conn, server_side=True)
                except (ssl.SSLError, OSError):
                    self.tls_refused += 1
                    return
            self._read_connect(conn)
        except OSError:
            pass
        finally:
            conn.close()

    def _read_connect(self, conn: socket.socket) -> None:
        def read(n: int) -> bytes:
            data = b""
            while len(data) < n:
                chunk = conn.recv(n - len(data))
                if not chunk:
                    raise ConnectionError("closed")
                data += chunk
            return data

        if read(1)[0] >> 4 == 1:  # CONNECT
            self.connects.append(parse_connect(read(_varint(read))))
            self.got_connect.set()

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept(), which holds the socket
        except OSError:
            pass
        self._sock.close()


def test_the_squatter_parses_a_real_connect(tmp_path: Path) -> None:
    # The recorder itself: a paho CONNECT with a will (MQTT 5, as the devices send) is read field by field.
    from protofl.transport.mqtt import Backoff, MqttTransport, Will

    tls = ensure_federation_tls(tmp_path / "squat", "squatter", ["127.0.0.1"])
    port = free_port()
    squatter = Squatter("127.0.0.1", port, tls.broker_cert, tls.broker_key)
    t = MqttTransport(f"mqtt://u:p%40ss@127.0.0.1:{port}", "cid", will=Will("a/b", b"offline"), backoff=Backoff(5, 5))
    t._net.start()
    try:
        assert squatter.got_connect.wait(EVENT_WAIT_S)
        assert squatter.connects[0] == Connect("cid", "u", b"p@ss")
    finally:
        t.close(timeout=0)
        squatter.close()


# -- the supervisor, in this process --------------------------------------------------------------------


class Lines:
    """Lines as they come (log records, a process's output), with a wait for one that matches."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._cond = threading.Condition()

    def add(self, line: str) -> None:
        with self._cond:
            self._lines.append(line)
            self._cond.notify_all()

    def _match(self, pattern: str) -> str | None:
        return next((x for x in self._lines if re.search(pattern, x)), None)

    def wait(self, pattern: str, timeout: float = 60) -> str:
        with self._cond:
            found = self._cond.wait_for(lambda: self._match(pattern), timeout)
        assert found, f"no line matching {pattern!r} within {timeout} s:\n{self.text}"
        return found

    def has(self, pattern: str) -> bool:
        with self._cond:
            return self._match(pattern) is not None

    @property
    def text(self) -> str:
        with self._cond:
            return "\n".join(self._lines)


class LogEvents(logging.Handler, Lines):
    def __init__(self) -> None:
        logging.Handler.__init__(self)
        Lines.__init__(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.add(record.getMessage())


@pytest.fixture
def broker_log() -> Iterator[LogEvents]:
    handler = LogEvents()
    logger = logging.getLogger("protofl.broker")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def test_the_supervisor_says_a_squatter_took_the_port_and_restarts_once_it_is_gone(
    tmp_path: Path, broker_log: LogEvents
) -> None:
    auth = load_or_create(tmp_path / "sec", "sup", ["dev-a"])
    # A work directory too long for a socket address: the socket goes to a private temporary directory.
    workdir = tmp_path / ("w" * 120)
    broker = MosquittoBroker(
        workdir=workdir,
        allow_anonymous=False,
        extra_config=auth.mosquitto_lines()[1:],
        local_socket=True,
        persistence=False,
    ).start()
    squatter = None
    try:
        assert broker.socket_path is not None and not str(broker.socket_path).startswith(str(workdir))
        assert broker.socket_path.parent.stat().st_mode & 0o777 == 0o700
        assert f"listener 0 {broker.socket_path}" in broker.config_path.read_text()
        assert broker.proc is not None
        broker.proc.kill()  # dies by a signal: its socket file stays behind
        broker.proc.wait()
        tls = ensure_federation_tls(tmp_path / "squat", "squatter", ["127.0.0.1"])
        squatter = Squatter("127.0.0.1", broker.port, tls.broker_cert, tls.broker_key)
        supervisor = BrokerSupervisor(broker, interval=0.05, max_delay=0.5).start()
        try:
            said = broker_log.wait("another process took its port")
            assert f"its port {broker.port} on 127.0.0.1" in said and str(broker.socket_path) in said, said
            assert not broker.running and not _unix_answers(broker.socket_path)  # never taken for our broker
            squatter.close()
            broker_log.wait(r"broker restarted \(1 restart")
            assert broker.running and _unix_answers(broker.socket_path)  # the stale socket file was replaced
        finally:
            supervisor.stop()
    finally:
        if squatter is not None:
            squatter.close()
        broker.cleanup()
    assert not broker.socket_path.parent.exists()  # the private directory goes with the broker


# -- the real thing: `protofl-server start` and `protofl-edge join` ----------------------------------------


class Output(Lines):
    """A process's output, line by line."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        super().__init__()
        self.proc = proc
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.add(line.rstrip("\n"))


def _popen(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV, text=True
    )


def _stop(*procs: subprocess.Popen[str] | None) -> None:
    for p in procs:
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.terminate()
    for p in procs:
        if p is not None:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _squat_while_the_broker_is_down(
    server: subprocess.Popen[str], state: Path, host: str, port: int, squat_tls: Path
) -> Squatter:
    """Freeze the server (so its supervisor cannot restart the broker first), SIGKILL the broker, take
    its port, and let the server go on."""
    mosquitto_pid = int((state / "broker" / "mosquitto.pid").read_text())
    tls = ensure_federation_tls(squat_tls, "squatter", ["127.0.0.1", "localhost"])
    server.send_signal(signal.SIGSTOP)
    try:
        os.kill(mosquitto_pid, signal.SIGKILL)
        return Squatter(host, port, tls.broker_cert, tls.broker_key)
    finally:
        server.send_signal(signal.SIGCONT)


def _until(what: Callable[[], bool], squatter: Squatter, timeout: float = 60) -> None:
    """Wait for `what`, or for the squatter to read a CONNECT, whichever comes first."""
    end = time.monotonic() + timeout
    while not (what() or squatter.got_connect.is_set()) and time.monotonic() < end:
        squatter.got_connect.wait(0.05)


def _the_server_comes_back_through_its_socket(out: Output, squatter: Squatter) -> None:
    squatter.close()
    out.wait(r"broker restarted \(1 restart")
    out.wait("reconnected to unix://")


@pytest.mark.slow
def test_the_server_never_sends_its_password_to_a_squatter_on_loopback(tmp_path: Path) -> None:
    # The default start (loopback, no TLS): the server's reconnects go to the broker's unix socket, and the
    # supervisor says who holds the port.
    port, state, fed = free_port(), tmp_path / "state", "squat"
    server = _popen(
        "broker_server.cli",
        "start",
        "--preset",
        "fedproto",
        "--port",
        str(port),
        "--fed",
        fed,
        "--min-clients",
        "2",
        "--state-dir",
        str(state),
    )
    out = Output(server)
    squatter = None
    try:
        out.wait(f"protofl-server-{fed}: connected to ")
        squatter = _squat_while_the_broker_is_down(server, state, "127.0.0.1", port, tmp_path / "squat")
        _until(lambda: out.has("another process took its port"), squatter)
        assert squatter.connects == [], f"the squatter got credentials: {squatter.connects}"
        out.wait("another process took its port", timeout=1)
        _the_server_comes_back_through_its_socket(out, squatter)
        # said by the service's pump after the messages that came before the loss (protofl/transport/mqtt.py)
        out.wait("lost connection to unix://")
        assert squatter.connects == [], squatter.connects
    finally:
        if squatter is not None:
            squatter.close()
        _stop(server)


@pytest.mark.slow
def test_neither_server_nor_device_talks_to_a_squatter_with_default_tls(tmp_path: Path) -> None:
    # --listen beyond loopback: TLS with the generated federation CA by default. A device joins with its
    # credentials file (and a plain mqtt:// URL: the file's CA switches TLS on); the broker is killed and
    # a squatter with a certificate for 127.0.0.1 from another CA takes the port.
    port, state, fed = free_port(), tmp_path / "state", "squat"
    server = _popen(
        "broker_server.cli",
        "start",
        "--preset",
        "fedproto",
        "--listen",
        f"0.0.0.0:{port}",
        "--fed",
        fed,
        "--min-clients",
        "2",
        "--devices",
        "2",
        "--state-dir",
        str(state),
    )
    out = Output(server)
    device = dev_out = squatter = None
    try:
        out.wait(f"protofl-server-{fed}: connected to ")
        cred = state / "security" / "devices" / "device-1.json"
        device = _popen(
            "edge_agent.cli",
            "join",
            "--broker",
            f"mqtt://127.0.0.1:{port}",
            "--credentials",
            str(cred),
            "--data",
            "synthetic:n=100,n_test=20",
            "--threads",
            "1",
            "--connect-timeout",
            "60",
        )
        dev_out = Output(device)
        dev_out.wait(f"device-1: connected to mqtts?://127.0.0.1:{port}")
        squatter = _squat_while_the_broker_is_down(server, state, "0.0.0.0", port, tmp_path / "squat")
        refused = f"refusing the connection: .*presented a certificate that the federation CA in --credentials {cred}"
        _until(lambda: dev_out.has(refused) and out.has("another process took its port"), squatter)
        assert squatter.connects == [], f"the squatter got credentials: {squatter.connects}"
        dev_out.wait(refused, timeout=1)
        said = out.wait("another process took its port", timeout=1)
        assert "devices that reconnect refuse it" in said, said
        assert squatter.tls_refused >= 1
        _the_server_comes_back_through_its_socket(out, squatter)
        assert squatter.connects == [], squatter.connects
    finally:
        if squatter is not None:
            squatter.close()
        _stop(device, server)

"""Where the broker is and how to authenticate: `mqtt://` / `mqtts://` URLs, credentials, TLS files.

Both CLIs build one `BrokerOptions` from `--broker`, `--username/--password` and `--tls-*`; the MQTT
transport takes it as is. Nothing here imports paho, so the options can be validated (and errors shown)
before any connection is attempted.

`unix:///path/to/socket` is the server's own connection to the Mosquitto that `protofl-server start`
spawned: a socket in a directory only the server's user can write, so no other process can stand in for
that broker (a process that takes the broker's TCP port while it is down gets no connection from the
server). The federation CA of a device's credentials file (`with_federation_ca`) pins the broker a
device talks to the same way over TCP.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import unquote, urlsplit

from protofl.errors import ConfigError

PASSWORD_ENV = "PROTOFL_MQTT_PASSWORD"  # where the CLIs read a password, keeping it off command lines

DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}
UNIX_SCHEME = "unix"
# Mosquitto's own ceiling is 256 MiB; 64 MiB leaves room for a FedAvg model of ~16M float32 parameters
# while keeping one message's worst case bounded on a constrained device.
DEFAULT_MAX_PACKET = 64 * 2**20
CONNECT_TIMEOUT_S = 30.0  # how long a client waits for the broker at start (--connect-timeout)


@dataclass(frozen=True)
class BrokerOptions:
    host: str = "127.0.0.1"
    port: int = 1883
    tls: bool = False
    username: str | None = None
    password: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    keepalive: int = 30
    # Match the broker certificate's names against `host`. Off only for a connection to our own local
    # broker over loopback, whose certificate names the host devices use; the chain is still verified.
    tls_check_hostname: bool = True
    # Client-side cap on a PUBLISH packet; the broker's advertised Maximum Packet Size (MQTT 5) wins
    # when it is smaller. paho itself never checks it: an oversize packet just gets us disconnected.
    max_packet_size: int = DEFAULT_MAX_PACKET
    # A unix socket instead of host:port (the server's own connection to the broker it spawned).
    unix_path: str | None = None
    # The CA certificate itself (PEM text), from a device's credentials file, and where it came from
    # (named in errors: "the federation CA in --credentials dev.json"). --tls-ca, a file, wins over it.
    tls_ca_pem: str | None = None
    tls_ca_from: str | None = None

    @property
    def url(self) -> str:
        """The URL without credentials (safe to print in logs and errors)."""
        if self.unix_path is not None:
            return f"{UNIX_SCHEME}://{self.unix_path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'mqtts' if self.tls else 'mqtt'}://{host}:{self.port}"

    @property
    def ca_description(self) -> str:
        """Which CA verifies the broker, for error messages."""
        if self.tls_ca:
            return f"the CA of --tls-ca {self.tls_ca}"
        if self.tls_ca_pem:
            return f"the federation CA in {self.tls_ca_from or 'the credentials file'}"
        return "the system's trusted CAs (no --tls-ca given)"

    def with_auth(
        self,
        username: str | None = None,
        password: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> BrokerOptions:
        """Overlay CLI flags on what the URL said; any TLS file switches TLS on."""
        opts = replace(
            self,
            username=username if username is not None else self.username,
            password=password if password is not None else self.password,
            tls_ca=tls_ca or self.tls_ca,
            tls_cert=tls_cert or self.tls_cert,
            tls_key=tls_key or self.tls_key,
        )
        if opts.tls_ca or opts.tls_cert or opts.tls_key:
            opts = replace(opts, tls=True)
        opts.check()
        return opts

    def with_federation_ca(self, pem: str, origin: str) -> BrokerOptions:
        """Verify the broker against the federation's own CA (a device's credentials file carries it),
        unless --tls-ca named a CA file, which wins. The CA is generated for one federation and signs only
        its brokers' certificates (the core's, its site brokers'), so any certificate it signed is one of
        them: host names are not matched
        (devices often reach the server by an address it cannot know: NAT, a new IP, a DNS alias)."""
        if self.tls_ca or self.unix_path is not None:
            return self
        return replace(self, tls=True, tls_ca_pem=pem, tls_ca_from=origin, tls_check_hostname=False)

    def check(self) -> None:
        if self.password is not None and self.username is None:
            raise ConfigError("--password given without --username; MQTT sends a password only with a user name")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("a client certificate needs both --tls-cert and --tls-key")
        for flag, path in (("--tls-ca", self.tls_ca), ("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key)):
            if path and not Path(path).is_file():
                raise ConfigError(f"{flag} {path}: no such file")
        if self.unix_path is not None and self.tls:
            # The socket's directory is what keeps others out; the broker's unix listener speaks no TLS.
            raise ConfigError(f"{self.url}: a unix socket connection takes no TLS (--tls-ca/--tls-cert/--tls-key)")
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"broker port must be in 1..65535, got {self.port}")
        if self.max_packet_size < 1024:
            raise ConfigError(f"max_packet_size must be at least 1024 bytes, got {self.max_packet_size}")


def parse_broker_url(url: str) -> BrokerOptions:
    """`mqtt://[user[:password]@]host[:port]` or `mqtts://...` (also a bare `host[:port]`), or
    `unix:///absolute/path` (a broker's unix socket listener)."""
    text = url.strip()
    if "://" not in text:
        text = "mqtt://" + text
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme == UNIX_SCHEME:
        return _parse_unix_url(url, parts.netloc, parts.path)
    if scheme not in DEFAULT_PORTS:
        raise ConfigError(f"broker URL '{url}': scheme must be mqtt://, mqtts:// or unix://, got '{parts.scheme}://'")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"broker URL '{url}': expected mqtt[s]://host[:port] with no path or query")
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(f"broker URL '{url}': the port must be a number in 1..65535") from None
    if not parts.hostname:
        raise ConfigError(f"broker URL '{url}': no host name")
    opts = BrokerOptions(
        host=parts.hostname,
        port=port or DEFAULT_PORTS[scheme],
        tls=scheme == "mqtts",
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
    )
    opts.check()
    return opts


def _parse_unix_url(url: str, netloc: str, path: str) -> BrokerOptions:
    if netloc or not path.startswith("/"):
        raise ConfigError(f"broker URL '{url}': expected unix:///absolute/path/to/socket")
    return BrokerOptions(host="localhost", unix_path=unquote(path))

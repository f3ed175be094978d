"""A device's MQTT credentials and the provisioning file that carries them (`devices/<id>.json`).

The server side (broker_server/ops/security.py) writes the file; `protofl-edge join --credentials` reads it.
Plain JSON: {"fed": ..., "username": ..., "password": ...}; the user name is the device id. When the
server's broker serves TLS with the federation's generated CA, the file also carries that CA's
certificate ("ca", PEM): the device then speaks TLS and accepts only a broker whose certificate that
CA signed (BrokerOptions.with_federation_ca).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from protofl.errors import ConfigError
from protofl.names import NAME_RULE, is_valid_name, printable

MAX_FILE = 1 << 20  # a devices/<id>.json is a few KB (a CA certificate at most)
MAX_USER = 256  # a device id is at most 64 characters; the monitor's, a bridge's and a shard's name their fed


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str


@dataclass(frozen=True)
class DeviceFile:
    """What a `devices/<id>.json` file holds: credentials, the federation (if said), its CA (if TLS)."""

    credentials: Credentials
    fed: str | None = None
    ca_pem: str | None = None
    broker: str | None = None  # where to connect (the monitor's file says: `protofl-server status --credentials`)


def device_file_text(cred: Credentials, fed: str, ca_pem: str | None = None, broker: str | None = None) -> str:
    raw = {"fed": fed, "username": cred.username, "password": cred.password}
    if broker is not None:
        raw["broker"] = broker
    if ca_pem is not None:
        raw["ca"] = ca_pem
    return json.dumps(raw) + "\n"


def read_device_file(path: Path) -> DeviceFile:
    """A `devices/<id>.json` file, its shape checked: a JSON object whose username is a valid device id, whose
    password, fed, broker and ca are strings (a ConfigError that says which field is wrong, never a traceback:
    a binary file, a JSON nested a million deep, a user name that is a list)."""
    what = (
        f"--credentials {path}: expected the devices/<id>.json file written by protofl-server start (a JSON object "
        "with username and password)"
    )
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"--credentials {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE:
        raise ConfigError(f"{what}; this file is {len(data)} bytes (at most {MAX_FILE})")
    try:
        raw = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{what}; this file is not UTF-8 text") from None
    except RecursionError:
        raise ConfigError(f"{what}; this file's JSON is nested too deep") from None
    except ValueError as exc:
        raise ConfigError(f"{what}; it is not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{what}; it holds a JSON {type(raw).__name__}")
    for key in ("username", "password"):
        if key not in raw:
            raise ConfigError(f"{what}; it has no {key!r}")
    for key in ("username", "password", "fed", "broker", "ca"):
        value = raw.get(key)
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{what}; its {key!r} is a {type(value).__name__}, not a string")
    user = raw["username"]
    if not user or len(user) > MAX_USER or printable(user, MAX_USER) != user:
        raise ConfigError(
            f"{what}; its username {printable(user, 80)!r} is not a user name (1-{MAX_USER} printable characters)"
        )
    fed, broker, ca = raw.get("fed"), raw.get("broker"), raw.get("ca")
    if fed is not None and not is_valid_name(fed):
        raise ConfigError(f"{what}; its fed {printable(fed, 80)!r} is not a federation name ({NAME_RULE})")
    if ca is not None and "BEGIN CERTIFICATE" not in ca:
        raise ConfigError(f"{what}; its 'ca' is not a PEM certificate")
    return DeviceFile(Credentials(raw["username"], raw["password"]), fed, ca, broker)


def read_device_credentials(path: Path) -> tuple[Credentials, str | None]:
    """A `devices/<id>.json` file: the device's credentials and its federation (if the file says)."""
    found = read_device_file(path)
    return found.credentials, found.fed

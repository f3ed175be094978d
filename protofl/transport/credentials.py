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
    try:
        raw = json.loads(Path(path).read_text())
        cred = Credentials(str(raw["username"]), str(raw["password"]))
        ca = raw.get("ca")
        if ca is not None and "BEGIN CERTIFICATE" not in str(ca):
            raise ValueError("'ca' is not a PEM certificate")
    except OSError as exc:
        raise ConfigError(f"--credentials {path}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(
            f"--credentials {path}: expected a JSON object with username and password (the "
            f"devices/<id>.json file written by protofl-server start), got an error: {exc}"
        ) from None
    fed, broker = raw.get("fed"), raw.get("broker")
    return DeviceFile(
        cred,
        str(fed) if fed is not None else None,
        str(ca) if ca is not None else None,
        str(broker) if broker is not None else None,
    )


def read_device_credentials(path: Path) -> tuple[Credentials, str | None]:
    """A `devices/<id>.json` file: the device's credentials and its federation (if the file says)."""
    found = read_device_file(path)
    return found.credentials, found.fed

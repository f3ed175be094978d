"""A device's MQTT credentials and the provisioning file that carries them (`devices/<id>.json`).

The server side (broker_server/security.py) writes the file; `protofl-edge join --credentials` reads it.
Plain JSON: {"fed": ..., "username": ..., "password": ...}; the user name is the device id.
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


def device_file_text(cred: Credentials, fed: str) -> str:
    return json.dumps({"fed": fed, "username": cred.username, "password": cred.password}) + "\n"


def read_device_credentials(path: Path) -> tuple[Credentials, str | None]:
    """A `devices/<id>.json` file: the device's credentials and its federation (if the file says)."""
    try:
        raw = json.loads(Path(path).read_text())
        cred = Credentials(str(raw["username"]), str(raw["password"]))
    except OSError as exc:
        raise ConfigError(f"--credentials {path}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"--credentials {path}: expected a JSON object with username and password (the "
                          f"devices/<id>.json file written by protofl-server start), got an error: {exc}") from None
    fed = raw.get("fed")
    return cred, str(fed) if fed is not None else None

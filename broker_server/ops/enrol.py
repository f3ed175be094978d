"""Enrol and revoke devices on a running fleet (or `start`) without a restart: `protofl-server devices add|revoke|list`.

The credentials (STATE/security/credentials.json), the broker's password file and ACL are rewritten
(broker_server/ops/security.py) and the broker is sent SIGHUP: Mosquitto (2.0.11 checked) reloads its password file
and ACL and disconnects every connected client whose user is no longer in the password file ("Client X
disconnected"); its reconnect is refused (not authorised). The run's server says the device's presence
"revoked" (`Revocations`), journaled like any presence: the device leaves the open round at once, which then
closes at quorum without it, and what it sent after is dropped (broker_server/core/rounds.py: `Presence.revoked`).
A device added gets its devices/<id>.json (with the fleet's CA and broker address, copied from monitor.json)
and can join the next round. Revoked ids are listed in STATE/security/revoked.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import typer

from broker_server.ops.security import FederationSecrets, prepare, write_secret
from protofl.errors import ConfigError, ProtoFLError
from protofl.names import check_name
from protofl.transport.credentials import device_file_text

REVOKED = "revoked"


def _secrets(state_dir: Path) -> FederationSecrets:
    store = state_dir / "security" / "credentials.json"
    if not store.is_file():
        raise ConfigError(f"{state_dir} holds no credentials (security/credentials.json): not a fleet's state dir")
    return FederationSecrets.from_json(store.read_text(), str(store))


def enrolled(state_dir: Path) -> list[str]:
    """The devices enrolled now (none where no credentials were written yet)."""
    if not (state_dir / "security" / "credentials.json").is_file():
        return []
    return sorted(_secrets(state_dir).devices)


def revoked(state_dir: Path) -> list[str]:
    try:
        return [x for x in (state_dir / "security" / REVOKED).read_text().split() if x]
    except OSError:
        return []


def broker_pid(state_dir: Path) -> int | None:
    """The fleet's running Mosquitto (its pid file, checked against /proc), or None."""
    try:
        pid = int((state_dir / "broker" / "mosquitto.pid").read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    conf = str((state_dir / "broker" / "mosquitto.conf").resolve())
    ok = (
        cmdline
        and cmdline[0].endswith(b"mosquitto")
        and any(str(Path(a.decode()).resolve()) == conf for a in cmdline[1:] if a)
    )
    return pid if ok else None


def reload_broker(state_dir: Path) -> bool:
    """SIGHUP to the fleet's broker (it rereads password file and ACL); False when none runs (the next start reads
    the files)."""
    pid = broker_pid(state_dir)
    if pid is None:
        return False
    os.kill(pid, signal.SIGHUP)
    return True


def add(state_dir: Path, ids: list[str]) -> list[str]:
    """Enrol `ids` (existing ones keep their password); returns the new ones. Writes their devices/<id>.json."""
    fed = _secrets(state_dir).fed
    ids = [check_name(i, "device id") for i in ids]
    sec = state_dir / "security"
    auth = prepare(sec, fed, ids)
    write_secret(sec / "credentials.json", auth.secrets.to_json() + "\n")
    try:
        monitor = json.loads((sec / "monitor.json").read_text())
    except (OSError, ValueError):
        monitor = {}
    (sec / "devices").mkdir(exist_ok=True)
    for client_id in auth.new_devices:
        text = device_file_text(auth.secrets.device(client_id), fed, monitor.get("ca"), monitor.get("broker"))
        write_secret(auth.device_file(client_id), text)
    gone = [i for i in revoked(state_dir) if i not in ids]
    write_secret(sec / REVOKED, "".join(f"{i}\n" for i in gone))
    reload_broker(state_dir)
    return list(auth.new_devices)


def revoke(state_dir: Path, ids: list[str]) -> None:
    """Take `ids` out of the password file and ACL and disconnect them (SIGHUP); their files are deleted."""
    found = _secrets(state_dir)
    missing = [i for i in ids if i not in found.devices]
    if missing:
        raise ConfigError(
            f"not enrolled: {', '.join(missing)} (enrolled: {', '.join(sorted(found.devices)) or 'none'})"
        )
    sec = state_dir / "security"
    for client_id in ids:
        del found.devices[client_id]
    write_secret(sec / "credentials.json", found.to_json() + "\n")
    prepare(sec, found.fed)  # the password file (other users' hashes kept) and ACL from the credentials
    for client_id in ids:
        (sec / "devices" / f"{client_id}.json").unlink(missing_ok=True)
    write_secret(sec / REVOKED, "".join(f"{i}\n" for i in sorted({*revoked(state_dir), *ids})))
    reload_broker(state_dir)


class Revocations:
    """What a run's server watches (start --revoked-file, which the fleet passes): each device revoked since it
    last looked is said to the aggregator as that device's "revoked" presence (journaled like any presence; it
    leaves the open round at once, which closes at quorum without it). The broker
    keeps the device's own last will from going out once its user is gone from the ACL, so the server says it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: set[str] = set()
        self._stamp: float | None = None

    def poll(self) -> list[str]:
        """The devices revoked since the last call (cheap: one stat when nothing changed)."""
        try:
            stamp = self.path.stat().st_mtime
        except OSError:
            return []
        if stamp == self._stamp:
            return []
        self._stamp = stamp
        new = [i for i in revoked(self.path.parent.parent) if i not in self.seen]
        self.seen.update(new)
        return new


def revoked_presence(fed: str, client_id: str) -> bytes:
    """A revoked device's presence, as the server says it for the device (the envelope's sender is the device)."""
    from broker_server.core.shell import REVOKED as STATE
    from protofl.wire import Status, encode_message

    return encode_message(Status(state=STATE, detail="revoked by the fleet"), fed=fed, sender=client_id)


devices_app = typer.Typer(help="A fleet's devices: enrol, revoke and list them while the fleet runs.")
STATE_OPTION = typer.Option(..., "--fleet", help="The fleet's state dir (protofl-server fleet --state-dir).")


def _fail(exc: ProtoFLError) -> None:
    typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(2) from None


@devices_app.command("add")
def devices_add(ids: list[str] = typer.Argument(..., help="Device ids to enrol."), fleet: Path = STATE_OPTION) -> None:
    """Enrol devices: each gets FLEET/security/devices/<id>.json; the running broker takes them at once (SIGHUP)."""
    try:
        new = add(fleet, ids)
    except ProtoFLError as exc:
        _fail(exc)
    for client_id in ids:
        where = fleet / "security" / "devices" / f"{client_id}.json"
        typer.echo(f"{client_id}: {'enrolled' if client_id in new else 'enrolled already'}; its credentials: {where}")


@devices_app.command("revoke")
def devices_revoke(
    ids: list[str] = typer.Argument(..., help="Device ids to revoke."),
    fleet: Path = STATE_OPTION,
    forget: bool = typer.Option(
        False,
        "--forget",
        help="Also unlearn them from the ended runs' global ridge heads: their statistics subtracted, each head "
        "solved again (broker_server/ops/forget.py says what this does not undo). A device revoked before may be "
        "named again with --forget.",
    ),
) -> None:
    """Revoke devices: their credentials stop working and the broker disconnects them now (SIGHUP)."""
    from broker_server.ops.forget import forget_device

    try:
        gone = set(revoked(fleet)) if forget else set()
        for client_id in ids:
            check_name(client_id, "device id")
        fresh = [i for i in ids if i not in gone]
        if fresh:
            revoke(fleet, fresh)
        forgot = [forget_device(fleet, i) for i in ids] if forget else []
    except ProtoFLError as exc:
        _fail(exc)
    running = broker_pid(fleet) is not None
    if fresh:
        said = "; the broker disconnected them" if running else " (no broker runs)"
        typer.echo(f"revoked {', '.join(fresh)}{said}")
    for client_id, (done, left) in zip(ids if forget else [], forgot, strict=True):
        for f in done:
            typer.echo(f.text())
        if not done:
            typer.echo(f"{client_id}: no ended run's global ridge head holds its statistics: nothing to forget")
        for name in left:
            typer.echo(f"{client_id}: run '{name}' has not ended: run devices revoke --forget {client_id} again then")


@devices_app.command("list")
def devices_list(fleet: Path = STATE_OPTION) -> None:
    """The enrolled devices and the revoked ones, each with the privacy it has spent over the fleet's runs (its
    epsilon and delta summed over the runs it took part in: broker_server/ops/privacy_ledger.py)."""
    from broker_server.ops.privacy_ledger import Spend, budget, ledger_path, read_ledger

    try:
        found = _secrets(fleet)
        totals = read_ledger(ledger_path(fleet)).totals()
    except ProtoFLError as exc:
        _fail(exc)
    limit = budget(fleet)
    of = f" of budget {limit:g}" if limit is not None else ""
    rows = [(i, "enrolled") for i in sorted(found.devices)] + [(i, "revoked") for i in revoked(fleet)]
    width = max((len(i) for i, _ in rows), default=0)
    for client_id, state in rows:
        spent = totals.get(client_id, Spend())
        typer.echo(f"{client_id} {state}{' ' * (width - len(client_id) + 9 - len(state))}  {spent.text()}{of}")

"""systemd units for the long-running commands: `protofl-server service install` (the fleet) and `protofl-edge
service install` (a device's `join`). One writer for both: restarted on failure, started at boot
(WantedBy=multi-user.target), after the network is up, with the open-file limit and memory cap each side needs.

Hardened (`systemd-analyze security` exposure <= 4.0 for both units, tests/test_service_units.py): a dedicated user
(`--user`, default `protofl`: create it with `useradd --system`), no new privileges and no capabilities, the whole
file system read-only (ProtectSystem=strict) but for the paths the command writes (ReadWritePaths: the state), home
folders hidden (read-only where a path the command reads lies under one), a private /tmp, the kernel, clock, cgroups
and namespaces out of reach, the system calls a service needs (@system-service), the address families it speaks."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from protofl.errors import ConfigError, ProtoFLError
from protofl.names import check_name

SYSTEM_UNITS = Path("/etc/systemd/system")
RESTART_S = 5  # seconds between a failure and the restart
DEFAULT_USER = "protofl"  # the dedicated system user both units run as (`--user` names another)
USER_HELP = f"Run as this dedicated system user (default: {DEFAULT_USER}; create it with useradd --system)."


def memory_cap_mb(board_mb: int) -> int:
    """MemoryMax for a board with `board_mb` of RAM: 7/8 of it, the rest left to the OS (kernel, sshd, journald),
    so that the kernel stops the device, not the board."""
    return board_mb * 7 // 8


@dataclass(frozen=True)
class Unit:
    name: str  # the unit's name, without .service
    description: str
    argv: list[str]  # the command, argv[0] absolute
    working_dir: Path
    nofile: int | None = None  # LimitNOFILE
    memory_mb: int | None = None  # MemoryMax
    env: dict[str, str] = field(default_factory=dict)
    user: str | None = None  # None: DEFAULT_USER
    writes: tuple[Path, ...] = ()  # ReadWritePaths: what the command writes (its state); absolute
    reads: tuple[Path, ...] = ()  # paths it reads (data, credentials): home folders stay readable if one is there
    no_restart: tuple[str, ...] = ()  # RestartPreventExitStatus: exits a restart cannot cure
    gpu: bool = False  # the command trains on a GPU: /dev stays (no PrivateDevices)

    @property
    def account(self) -> str:
        return self.user or DEFAULT_USER

    def hardening(self) -> list[str]:
        """The sandbox (module docstring)."""
        for path in (*self.writes, *self.reads):
            if not path.is_absolute():
                raise ConfigError(f"a unit's paths must be absolute, got {path}")
        homes = ("/home", "/root", "/run/user")
        in_home = any(str(p) == h or str(p).startswith(h + "/") for p in (*self.writes, *self.reads) for h in homes)
        return [
            f"User={self.account}",
            f"Group={self.account}",
            "NoNewPrivileges=yes",
            "CapabilityBoundingSet=",
            "AmbientCapabilities=",
            "ProtectSystem=strict",
            f"ProtectHome={'read-only' if in_home else 'yes'}",
            *(f"ReadWritePaths={shlex.quote(str(p))}" for p in self.writes),
            "PrivateTmp=yes",
            *([] if self.gpu else ["PrivateDevices=yes"]),
            "ProtectKernelTunables=yes",
            "ProtectKernelModules=yes",
            "ProtectKernelLogs=yes",
            "ProtectControlGroups=yes",
            "ProtectClock=yes",
            "ProtectHostname=yes",
            "ProtectProc=invisible",
            "RestrictSUIDSGID=yes",
            "RestrictRealtime=yes",
            "RestrictNamespaces=yes",
            "LockPersonality=yes",
            "RemoveIPC=yes",
            "KeyringMode=private",
            "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX AF_NETLINK",
            "SystemCallArchitectures=native",
            "SystemCallFilter=@system-service",
            "SystemCallFilter=~@privileged",
            "UMask=0077",
        ]

    def text(self) -> str:
        if not Path(self.argv[0]).is_absolute():
            raise ConfigError(f"a unit's command needs an absolute path, got {self.argv[0]}")
        if not Path(self.working_dir).is_absolute():
            raise ConfigError(f"a unit's working directory must be absolute, got {self.working_dir}")
        lines = [
            "[Unit]",
            f"Description={self.description}",
            "Wants=network-online.target",
            "After=network-online.target",
            "StartLimitIntervalSec=0",  # a device waiting for its network is restarted for as long as it takes
            "",
            "[Service]",
            "Type=simple",
            f"ExecStart={shlex.join(self.argv)}",
            f"WorkingDirectory={self.working_dir}",
            "Restart=on-failure",
            f"RestartSec={RESTART_S}",
            # SIGTERM is a clean stop for both commands: the fleet stops its run (resumed at the next start), a
            # device says goodbye; a second one is not needed.
            "KillSignal=SIGTERM",
            "TimeoutStopSec=60",
            *([f"RestartPreventExitStatus={' '.join(self.no_restart)}"] if self.no_restart else []),
            *(f"Environment={shlex.quote(f'{k}={v}')}" for k, v in sorted(self.env.items())),
            *([f"LimitNOFILE={self.nofile}"] if self.nofile else []),
            *([f"MemoryMax={self.memory_mb}M", "OOMPolicy=stop"] if self.memory_mb else []),
            *self.hardening(),
            "",
            "[Install]",
            "WantedBy=multi-user.target",
            "",
        ]
        return "\n".join(lines)

    def write(self, directory: Path) -> Path:
        check_name(self.name, "unit name")
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{self.name}.service"
        path.write_text(self.text())
        return path


def python_module(module: str, *args: str) -> list[str]:
    """`python -m module args` with this interpreter (a virtual environment's, where one runs it)."""
    return [sys.executable, "-m", module, *args]


def enable_hint(path: Path, unit: Unit | None = None) -> str:
    where = "" if path.parent == SYSTEM_UNITS else f"copy it to {SYSTEM_UNITS}/, then "
    user = ""
    if unit is not None:
        owned = " ".join(shlex.quote(str(p)) for p in unit.writes)
        user = (
            f"it runs as user {unit.account}: create it once (useradd --system --no-create-home --shell "
            f"/usr/sbin/nologin {unit.account})"
            + (f" and give it its state (chown -R {unit.account}: {owned})" if owned else "")
            + "; "
        )
    return f"{path} written; {user}{where}systemctl daemon-reload && systemctl enable --now {path.stem}"


def carried_env() -> dict[str, str]:
    """The PYTHONPATH this command runs with, for a unit that must import the same package."""
    return {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}


def install(build: Callable[[], Unit], out: Path) -> None:
    """The `service install` commands' end: build the unit (its options checked), write it to `out` and say how to
    enable it; a refusal is one line and exit 2, with nothing written."""
    import typer

    try:
        unit = build()
        check_name(unit.account, "--user")
        path = unit.write(out)
    except (ProtoFLError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(enable_hint(path, unit))

"""systemd units for the long-running commands: `protofl-server service install` (the fleet) and `protofl-edge
service install` (a device's `join`). One writer for both: restarted on failure, started at boot
(WantedBy=multi-user.target), after the network is up, with the open-file limit and memory cap each side needs."""

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


@dataclass(frozen=True)
class Unit:
    name: str  # the unit's name, without .service
    description: str
    argv: list[str]  # the command, argv[0] absolute
    working_dir: Path
    nofile: int | None = None  # LimitNOFILE
    memory_mb: int | None = None  # MemoryMax
    env: dict[str, str] = field(default_factory=dict)
    user: str | None = None

    def text(self) -> str:
        if not Path(self.argv[0]).is_absolute():
            raise ConfigError(f"a unit's command needs an absolute path, got {self.argv[0]}")
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
            *(f"Environment={shlex.quote(f'{k}={v}')}" for k, v in sorted(self.env.items())),
            *([f"User={self.user}"] if self.user else []),
            *([f"LimitNOFILE={self.nofile}"] if self.nofile else []),
            *([f"MemoryMax={self.memory_mb}M"] if self.memory_mb else []),
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


def enable_hint(path: Path) -> str:
    where = "" if path.parent == SYSTEM_UNITS else f"copy it to {SYSTEM_UNITS}/, then "
    return f"{path} written; {where}systemctl daemon-reload && systemctl enable --now {path.stem}"


def carried_env() -> dict[str, str]:
    """The PYTHONPATH this command runs with, for a unit that must import the same package."""
    return {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}


def install(build: Callable[[], Unit], out: Path) -> None:
    """The `service install` commands' end: build the unit (its options checked), write it to `out` and say how to
    enable it; a refusal is one line and exit 2, with nothing written."""
    import typer

    try:
        path = build().write(out)
    except (ProtoFLError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(enable_hint(path))

"""`protofl-edge service install`: a systemd unit for this device's `join` (protofl/systemd.py)."""

from __future__ import annotations

from pathlib import Path

import typer

service_app = typer.Typer(help="Run this device's join as a systemd service.")


@service_app.command("install", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def service_install(
    ctx: typer.Context,
    out: Path = typer.Option(Path("/etc/systemd/system"), "--out", help="Where the unit file goes."),
    name: str = typer.Option("protofl-edge", "--name", help="The unit's name (NAME.service)."),
    user: str | None = typer.Option(None, "--user", help="Run as this user (default: root)."),
) -> None:
    """Write a systemd unit for `protofl-edge join [the options after --]` (checked now): restarted on failure and
    started at boot; with --profile DEVICE, MemoryMax is the profile's memory. Relative paths are the current
    directory's (the unit's WorkingDirectory)."""
    from edge_agent.join_cli import join_command
    from protofl.cli_options import check_options
    from protofl.profiles import parse_pair
    from protofl.systemd import Unit, carried_env, install, python_module

    args = list(ctx.args)

    def build() -> Unit:
        check_options(join_command, "join", args)
        profile = args[args.index("--profile") + 1] if "--profile" in args[:-1] else ""
        device = parse_pair(profile)[0] if profile else None
        return Unit(
            name,
            "protofl-edge device agent (join)",
            python_module("edge_agent.cli", "join", *args),
            Path.cwd(),
            memory_mb=device.memory_mb if device is not None else None,
            env=carried_env(),
            user=user,
        )

    install(build, out)

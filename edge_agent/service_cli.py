"""`protofl-edge service install`: a systemd unit for this device's `join` (protofl/systemd.py)."""

from __future__ import annotations

from pathlib import Path

import typer

from protofl.systemd import USER_HELP

service_app = typer.Typer(help="Run this device's join as a systemd service.")

# join's options that name a file or folder: made absolute in the unit (its WorkingDirectory is no guide to a reader)
PATH_OPTIONS = ("--credentials", "--state-dir", "--artifacts", "--tls-ca", "--tls-cert", "--tls-key", "--data-dir")
WRITTEN = ("--state-dir", "--artifacts")  # what join writes: the unit's ReadWritePaths


def _absolute_data(data: str, cwd: Path) -> str:
    """A `--data` value with its path made absolute (a spec keeps its kind and options; a named dataset or a loader
    function stays as it is)."""
    from edge_agent.ops.local_data import NAMED, PATH_KINDS
    from protofl.data import own

    kind, sep, arg = data.partition(":")
    if kind.strip().lower() in NAMED:
        return data
    if sep and kind.strip().lower() in PATH_KINDS:
        path, comma, rest = arg.partition(",")
        return f"{kind}:{(cwd / path.strip()).resolve()}{comma}{rest}"
    if own.is_loader(data) and not (cwd / data).exists() or sep and kind.isalpha():
        return data  # a loader function, or a kind join does not know (its check names it)
    return str((cwd / data).resolve())


def absolute_args(args: list[str], cwd: Path) -> list[str]:
    """join's options with every path in them absolute (`--opt VALUE` and `--opt=VALUE` alike)."""
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if name in (*PATH_OPTIONS, "--data") and (eq or i + 1 < len(args)):
            if not eq:
                value = args[i + 1]
                i += 1
            value = _absolute_data(value, cwd) if name == "--data" else str((cwd / value).resolve())
            out += [f"{name}={value}"] if eq else [name, value]
        else:
            out.append(arg)
        i += 1
    return out


def _value(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


@service_app.command("install", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def service_install(
    ctx: typer.Context,
    out: Path = typer.Option(Path("/etc/systemd/system"), "--out", help="Where the unit file goes."),
    name: str = typer.Option("protofl-edge", "--name", help="The unit's name (NAME.service)."),
    user: str | None = typer.Option(None, "--user", help=USER_HELP),
) -> None:
    """Write a systemd unit for `protofl-edge join [the options after --]`, checked now (the options, the credentials
    file, the data spec and its path): restarted on failure but not after the memory watchdog's exit (3), started at
    boot, sandboxed (a dedicated user, read-only system, writable --state-dir / --artifacts only, /dev only for a
    GPU: --device cuda, or a GPU profile); with --profile
    DEVICE, MemoryMax is 7/8 of the profile's RAM. Relative paths are made absolute (from the current directory)."""
    from edge_agent.join_cli import join_command
    from edge_agent.ops.local_data import dataset_spec
    from protofl.cli_options import check_options
    from protofl.profiles import parse_pair
    from protofl.systemd import Unit, carried_env, install, memory_cap_mb, python_module
    from protofl.transport.credentials import read_device_file

    cwd = Path.cwd()
    args = absolute_args(list(ctx.args), cwd)

    def build() -> Unit:
        from edge_agent.core.memory import EXIT_OVER_MEMORY
        from edge_agent.join_cli import EXIT_REVOKED

        check_options(join_command, "join", args)
        credentials = _value(args, "--credentials")
        if credentials is not None:
            read_device_file(Path(credentials))
        data = _value(args, "--data")
        if data is not None:
            dataset_spec(data)
        profile = _value(args, "--profile") or ""
        device = parse_pair(profile)[0] if profile else None
        writes = tuple(Path(v) for v in (_value(args, o) for o in WRITTEN) if v is not None) or (cwd,)
        reads = tuple(Path(v) for v in (_value(args, o) for o in PATH_OPTIONS) if v is not None)
        if data is not None and (data.startswith("/") or ":/" in data):
            reads += (Path(data if data.startswith("/") else data.partition(":")[2].split(",")[0]),)
        return Unit(
            name,
            "protofl-edge device agent (join)",
            python_module("edge_agent.cli", "join", *args),
            cwd,
            memory_mb=memory_cap_mb(device.memory_mb) if device is not None and device.memory_mb else None,
            env=carried_env(),
            user=user,
            writes=writes,
            reads=reads,
            no_restart=(str(EXIT_OVER_MEMORY), str(EXIT_REVOKED)),  # outgrown memory; revoked
            gpu=_value(args, "--device") == "cuda"
            or _value(args, "--device") in (None, "auto")
            and device is not None
            and "gpu" in device.description.lower(),
        )

    install(build, out)

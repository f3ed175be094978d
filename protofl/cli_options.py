"""Command-line options shared by `protofl-server start` and `protofl-edge join`: one definition, one help text."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer

from protofl.transport.broker_url import CONNECT_TIMEOUT_S, PASSWORD_ENV

# The `--help` groups (typer's rich_help_panel) that commands share: the broker connection of the options below,
# and what runs (`start`'s and `simulate`'s Federation, broker_server/settings.py).
BROKER_PANEL = "Broker connection"
FEDERATION_PANEL = "Federation"

USERNAME = typer.Option(None, help="MQTT user name.", rich_help_panel=BROKER_PANEL)
PASSWORD = typer.Option(
    None, envvar=PASSWORD_ENV, help=f"MQTT password (or ${PASSWORD_ENV}).", rich_help_panel=BROKER_PANEL
)
TLS_CA = typer.Option(None, "--tls-ca", help="CA certificate (PEM) to verify the broker.", rich_help_panel=BROKER_PANEL)
TLS_CERT = typer.Option(None, "--tls-cert", help="Client certificate (PEM).", rich_help_panel=BROKER_PANEL)
TLS_KEY = typer.Option(None, "--tls-key", help="Client private key (PEM).", rich_help_panel=BROKER_PANEL)
CONNECT_TIMEOUT = typer.Option(
    CONNECT_TIMEOUT_S,
    help="Give up if the broker cannot be reached for this long at start.",
    rich_help_panel=BROKER_PANEL,
)


def check_options(command: Callable[..., Any], name: str, args: list[str]) -> dict[str, Any]:
    """Parse `args` as the typer command function `command` would (unknown options, bad values), without running
    it: what a queued run or a written service unit will run with is refused now, with click's reason. Returns the
    parsed values, by the function's parameter names."""
    from protofl.errors import ConfigError

    if "--help" in args:
        raise ConfigError(f"the options ask for help: protofl {name} --help lists them")
    app = typer.Typer()
    app.command()(command)
    try:
        ctx = typer.main.get_command(app).make_context(name, list(args), resilient_parsing=False)
    except typer.TyperException as exc:  # click's usage errors (typer vendors click in some releases)
        raise ConfigError(f"{name} options: {getattr(exc, 'format_message', exc.__str__)()}") from None
    return dict(ctx.params)

"""Command-line options shared by `protofl-server start` and `protofl-edge join`: one definition, one help text."""

from __future__ import annotations

import typer

from protofl.transport.broker_url import CONNECT_TIMEOUT_S, PASSWORD_ENV

USERNAME = typer.Option(None, help="MQTT user name.")
PASSWORD = typer.Option(None, envvar=PASSWORD_ENV, help=f"MQTT password (or ${PASSWORD_ENV}).")
TLS_CA = typer.Option(None, "--tls-ca", help="CA certificate (PEM) to verify the broker.")
TLS_CERT = typer.Option(None, "--tls-cert", help="Client certificate (PEM).")
TLS_KEY = typer.Option(None, "--tls-key", help="Client private key (PEM).")
CONNECT_TIMEOUT = typer.Option(
    CONNECT_TIMEOUT_S, help="Give up if the broker cannot be reached for this long at start."
)

"""`protofl-server status`: a running federation at a glance, once or `--watch`ed."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import typer
from rich.console import Console, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.text import Text

from broker_server.cli_common import print_whole
from broker_server.watch.render import status_view
from broker_server.watch.sources import Reading, read_broker, read_state_dir
from protofl import cli_options
from protofl.errors import ProtoFLError
from protofl.transport.broker_url import BrokerOptions


def status_command(
    state_dir: Path | None = typer.Option(
        None,
        "--state-dir",
        help="The server's --state-dir, on the server box: read its status.json (no credentials needed); a "
        "fleet's state dir: the run it serves, or served last.",
    ),
    broker: str | None = typer.Option(
        None,
        help="Read the server's retained summary from its broker instead "
        "(mqtt://HOST:PORT or mqtts://...), as the read-only monitor (default with --credentials: "
        "the broker its monitor.json names).",
    ),
    credentials: Path | None = typer.Option(
        None,
        help="The monitor credential for --broker: STATE_DIR/security/"
        "monitor.json, written by protofl-server start (the default "
        "when --state-dir is given too).",
    ),
    fed: str | None = typer.Option(None, help="Federation name (default: the credential's, else 'default')."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh every --interval seconds until Ctrl-C."),
    interval: float = typer.Option(2.0, help="Seconds between refreshes with --watch."),
    as_json: bool = typer.Option(
        False, "--json", help="Print the summary as JSON (the monitor protocol, docs/design.md) instead of tables."
    ),
    timeout: float = typer.Option(10.0, help="Give up reading the broker after this many seconds."),
    username: str | None = cli_options.USERNAME,
    password: str | None = cli_options.PASSWORD,
    tls_ca: str | None = cli_options.TLS_CA,
    updates: int | None = typer.Option(None, hidden=True, help="--watch: stop after this many refreshes (tests)."),
) -> None:
    """Show a running federation: round, phase, deadline, members online or not, bytes, accuracies, drops."""
    console = Console(stderr=True)
    try:
        if state_dir is not None and broker is None and credentials is None:
            from broker_server.ops.fleet_run import fleet_note
            from broker_server.watch.sources import starting_note

            def note_of(where: Path) -> str | None:
                """A fleet with no run's status to show (its own state), or a server still starting."""
                return fleet_note(where) or starting_note(where)

            note = note_of(state_dir)
            if note is not None:
                typer.echo(note)
                if not watch:
                    return
                while note is not None:  # --watch: the server's status once it writes one
                    time.sleep(max(interval, 0.1))
                    note = note_of(state_dir)
        read = _reader(state_dir, broker, credentials, fed, username, password, tls_ca, timeout)
        if not watch:
            _show(read(), as_json)
            return
        if interval <= 0:
            raise ProtoFLError(f"--interval must be > 0 seconds, got {interval}")
        _watch(read, as_json, interval, updates)
    except ProtoFLError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


def _reader(
    state_dir: Path | None,
    broker: str | None,
    credentials: Path | None,
    fed: str | None,
    username: str | None,
    password: str | None,
    tls_ca: str | None,
    timeout: float,
) -> Callable[[], Reading]:
    if broker is None and credentials is not None:
        # The monitor's file says where its broker is (protofl-server start writes it there)
        broker = _monitor_broker(credentials)
    if broker is None:
        if state_dir is None:
            raise ProtoFLError(
                "say where the federation is: --state-dir DIR (on the server box) or --credentials "
                "STATE_DIR/security/monitor.json (from anywhere that reaches the broker; --broker URL where the "
                "file does not say)"
            )
        from broker_server.ops.fleet_run import current_run

        where = current_run(state_dir) or state_dir  # a fleet's: the run it serves (or served last)
        return lambda: read_state_dir(where)
    if credentials is None and state_dir is not None and username is None:
        credentials = state_dir / "security" / "monitor.json"
    options, fed = _monitor_options(broker, credentials, fed, username, password, tls_ca)
    return lambda: read_broker(options, fed, timeout)


def _monitor_broker(credentials: Path) -> str:
    from protofl.transport.credentials import read_device_file

    found = read_device_file(credentials)
    if found.broker is None:
        raise ProtoFLError(
            f"--credentials {credentials} does not say where its broker is (a file from an older server): "
            f"add --broker mqtt://HOST:PORT (or mqtts://...)"
        )
    return found.broker


def _monitor_options(
    broker: str,
    credentials: Path | None,
    fed: str | None,
    username: str | None,
    password: str | None,
    tls_ca: str | None,
) -> tuple[BrokerOptions, str]:
    from protofl.transport.broker_url import parse_broker_url
    from protofl.transport.credentials import read_device_file

    options = parse_broker_url(broker)
    if credentials is None:
        return options.with_auth(username, password, tls_ca), fed or "default"
    found = read_device_file(credentials)
    if found.fed is not None and fed is not None and found.fed != fed:
        raise ProtoFLError(f"--credentials {credentials} is for federation '{found.fed}', not '{fed}'")
    options = options.with_auth(
        username or found.credentials.username, password if password is not None else found.credentials.password, tls_ca
    )
    if found.ca_pem is not None and tls_ca is None:
        options = options.with_federation_ca(found.ca_pem, f"--credentials {credentials}")
    return options, fed or found.fed or "default"


def _document(reading: Reading) -> str:
    return json.dumps({**reading.snapshot.to_json(), "server_note": reading.server, "source": reading.source}, indent=1)


def _show(reading: Reading, as_json: bool) -> None:
    if as_json:
        typer.echo(_document(reading))
    else:
        print_whole(status_view(reading))


def _watch(read: Callable[[], Reading], as_json: bool, interval: float, updates: int | None) -> None:
    """Refresh until Ctrl-C; a read that fails (server or broker away for a moment) is shown and retried."""
    console = Console()
    live = Live(console=console, auto_refresh=False) if console.is_terminal and not as_json else None
    shown = 0
    if live is not None:
        live.start()
    try:
        while updates is None or shown < updates:
            try:
                reading = read()
                out: str | RenderableType = _document(reading) if as_json else status_view(reading)
            except ProtoFLError as exc:
                out = Text(f"{time.strftime('%H:%M:%S')} cannot read the federation: {exc}; retrying")
            if live is not None:
                live.update(out, refresh=True)
            else:  # a pipe or a file: each refresh after the last, a blank line between
                if isinstance(out, str):
                    typer.echo(out)
                else:
                    console.print(out)
                console.print()
                sys.stdout.flush()
            shown += 1
            if updates is None or shown < updates:
                time.sleep(interval)
    finally:
        if live is not None:
            live.stop()

"""`protofl-server shard`: one aggregator shard joining a sharded federation's coordinator through their
broker (docs/design.md, "Scale-out"). `protofl-server start --shards N` runs N of these as its children;
on other machines, run them against the same broker (docs/how-to/sharded-aggregators.md)."""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from types import FrameType

import typer

from broker_server.settings import DEFAULT_SHARD_TIMEOUT_S
from protofl import cli_options
from protofl.errors import ProtoFLError

log = logging.getLogger("protofl.shard")


def shard_cli(
    broker: str = typer.Option(
        ...,
        help="The coordinator's broker: mqtt://host:port, mqtts://... (or the unix "
        "socket of the broker `start` spawned).",
    ),
    fed: str = typer.Option("default", help="Federation name (the coordinator's --fed)."),
    index: int | None = typer.Option(
        None, help="This shard's number, 0..N-1 for a coordinator started with --shards N."
    ),
    site: str | None = typer.Option(
        None,
        help="Instead of --index: pre-aggregate site NAME's uploads on its site "
        "broker (--broker; the coordinator's start --sites NAME).",
    ),
    state_dir: Path = typer.Option(
        ...,
        "--state-dir",
        help="This shard's journal and open phase (run the same command again after a crash: it resumes from them).",
    ),
    credentials: Path | None = typer.Option(
        None,
        help="The shard's credentials file: STATE_DIR/security/shards/"
        "shard-INDEX.json of the coordinator's start (or broker-config "
        "--shards N).",
    ),
    username: str | None = cli_options.USERNAME,
    password: str | None = cli_options.PASSWORD,
    tls_ca: str | None = cli_options.TLS_CA,
    tls_cert: str | None = cli_options.TLS_CERT,
    tls_key: str | None = cli_options.TLS_KEY,
    connect_timeout: float = cli_options.CONNECT_TIMEOUT,
    shard_timeout: float = typer.Option(
        DEFAULT_SHARD_TIMEOUT_S,
        "--shard-timeout",
        help="The coordinator's "
        "--shard-timeout (pass the same): how long the broker keeps this shard's "
        "session, and routes its share of the uploads to it, while it is gone; "
        "after that the other shards get every upload. Not used with --site.",
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log every upload drop and phase."),
) -> None:
    """Fold a share of the federation's uploads for its coordinator (`start --shards N`)."""
    from broker_server.scaleout.shard_service import ShardService, shard_transport
    from broker_server.settings import Broker, ShardSettings
    from protofl.names import check_name
    from protofl.transport.broker_url import parse_broker_url
    from protofl.transport.credentials import read_device_file

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("protofl.shard").setLevel(logging.INFO if verbose else logging.WARNING)
    try:
        check_name(fed, "--fed")
        settings = ShardSettings(fed, state_dir, index=index, site=site, timeout=shard_timeout)
        options = parse_broker_url(broker)
        if credentials is not None:
            found = read_device_file(credentials)
            username, password = found.credentials.username, found.credentials.password
            options = options.with_auth(username, password, tls_ca, tls_cert, tls_key)
            if found.ca_pem is not None:
                options = options.with_federation_ca(found.ca_pem, f"--credentials {credentials}")
        else:
            options = options.with_auth(username, password, tls_ca, tls_cert, tls_key)
        link = Broker(options, connect_timeout=connect_timeout)
        service = ShardService(settings, shard_transport(settings, link))
    except (ProtoFLError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None

    def on_signal(signum: int, frame: FrameType | None) -> None:
        service.stop()

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)
    try:
        service.start(link.connect_timeout)
        service.run()
    except (ProtoFLError, TimeoutError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    finally:
        service.close()

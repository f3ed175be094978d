"""`protofl-server start`: the aggregator as a long-running service (and, by default, its own broker)."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import Any, Optional

import typer

from broker_server.cli_common import parse_sets
from protofl import cli_options
from protofl.errors import ConfigError, ProtoFLError

log = logging.getLogger("protofl.service")


def start_command(
    broker: Optional[str] = typer.Option(None, help="Join this broker (mqtt://host:port or mqtts://...). Default: start a local "
                                                   "one (mosquitto if installed, else embedded amqtt)."),
    fed: str = typer.Option("default", help="Federation name (topics live under protofl/{fed}/)."),
    preset: str = typer.Option("protofl", help="fedavg | fedproto | refprotofl | tinyproto | fedpagr | protofl."),
    config: Optional[Path] = typer.Option(None, help="TOML file of config overrides (a federation table)."),
    min_clients: Optional[int] = typer.Option(None, help="Clients needed to start round 1 and to close a phase at its deadline."),
    round_timeout: Optional[float] = typer.Option(None, help="Seconds a phase waits for uploads before closing with whoever sent."),
    rounds: Optional[int] = typer.Option(None, help="Communication rounds."),
    seed: Optional[int] = typer.Option(None, help="Seed of the initial adapter, CPS masks and public set."),
    public_data: Optional[str] = typer.Option(None, "--public-data", help="Dataset the public set is drawn from "
                                                                          "(ERPA presets: refprotofl, protofl)."),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="Where --public-data's files are (fashion-mnist)."),
    state_dir: Optional[Path] = typer.Option(None, "--state-dir", help="Keep the local broker's files, rounds.jsonl and "
                                                                       "server_model.npz here."),
    set_: list[str] = typer.Option([], "--set", help="Override a config field: --set apud_ratio=0.05 (repeatable)."),
    port: int = typer.Option(1883, help="Port of the local broker (0 = any free port)."),
    local_broker: str = typer.Option("auto", help="Local broker: auto | mosquitto | amqtt."),
    username: Optional[str] = cli_options.USERNAME,
    password: Optional[str] = cli_options.PASSWORD,
    tls_ca: Optional[str] = cli_options.TLS_CA,
    tls_cert: Optional[str] = cli_options.TLS_CERT,
    tls_key: Optional[str] = cli_options.TLS_KEY,
    connect_timeout: float = cli_options.CONNECT_TIMEOUT,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log every join, upload drop and phase."),
) -> None:
    """Run the aggregator until the federation's last round: one log line per round."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("protofl.server").setLevel(logging.INFO if verbose else logging.WARNING)
    try:
        cfg, public = _federation(preset, config, parse_sets(set_), rounds, min_clients, round_timeout, seed,
                                  public_data, data_dir)
        _serve(cfg, public, fed, broker, state_dir, port, local_broker, username, password, tls_ca, tls_cert, tls_key,
               connect_timeout)
    except (ProtoFLError, TimeoutError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)


def _federation(preset: str, config: Path | None, overrides: dict[str, Any], rounds: int | None,
                min_clients: int | None, round_timeout: float | None, seed: int | None, public_data: str | None,
                data_dir: str | None) -> tuple[Any, Any]:
    """The validated config and, for ERPA, the public set carved exactly as the simulator carves it."""
    from protofl.data import load_dataset
    from protofl.data.federation import public_set
    from protofl.presets import make_config

    overrides.update({k: v for k, v in dict(rounds=rounds, min_clients=min_clients, round_timeout=round_timeout,
                                            seed=seed).items() if v is not None})
    train = None
    if public_data is not None:
        train, _ = load_dataset(public_data, data_dir=data_dir, seed=overrides.get("seed", 0))
        overrides.update(num_classes=train.num_classes, in_shape=tuple(train.in_shape))
    cfg = make_config(preset, str(config) if config else None, **overrides)
    if not (cfg.erpa and cfg.public_per_class > 0):
        return cfg, None
    if train is None:
        raise ConfigError(f"preset '{cfg.preset}' uses ERPA anchors and needs a public set: pass --public-data "
                          f"fashion-mnist (or synthetic:..., npz:PATH), or --set public_per_class=0")
    return cfg, public_set(train, cfg)


def _serve(cfg: Any, public: Any, fed: str, broker: str | None, state_dir: Path | None, port: int, local_broker: str,
           username: str | None, password: str | None, tls_ca: str | None, tls_cert: str | None,
           tls_key: str | None, connect_timeout: float) -> None:
    from broker_server.broker import BrokerStartError, start_local_broker
    from broker_server.service import AggregatorService, save_server_model
    from protofl.transport.broker_url import parse_broker_url

    with contextlib.ExitStack() as stack:
        protocol = "auto"
        if broker is None:
            workdir = state_dir / "broker" if state_dir else None
            try:
                local = start_local_broker(local_broker, port=port, workdir=workdir)  # type: ignore[arg-type]
            except BrokerStartError as exc:
                if "Address already in use" in str(exc):
                    raise ConfigError(f"port {port} is in use, probably by another broker: join it with --broker "
                                      f"mqtt://127.0.0.1:{port}, or pass --port 0 for any free port") from None
                raise
            stack.callback(getattr(local, "cleanup", local.stop))
            broker, protocol = local.url, local.protocol
        options = parse_broker_url(broker).with_auth(username, password, tls_ca, tls_cert, tls_key)
        rounds_file = None
        if state_dir is not None:
            state_dir.mkdir(parents=True, exist_ok=True)
            rounds_file = stack.enter_context((state_dir / "rounds.jsonl").open("a"))

        def on_round_end(rec: Any) -> None:
            if rounds_file is not None:
                rounds_file.write(json.dumps({"fed": fed, **asdict(rec)}) + "\n")
                rounds_file.flush()

        service = AggregatorService(cfg, fed, options, public=public, protocol=protocol,  # type: ignore[arg-type]
                                    on_round_end=on_round_end)
        service.start(connect_timeout)
        log.info("devices join with: protofl-edge join --broker %s --fed %s --client-id ID --data PATH",
                 options.url, fed)

        def on_signal(signum: int, frame: FrameType | None) -> None:
            log.info("stopping (signal %d)", signum)
            service.stop()

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            service.run()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            service.close()
            if state_dir is not None:
                path = save_server_model(service.aggregator.model, state_dir / "server_model.npz")
                log.info("server model written to %s", path)
        agg = service.aggregator
        if agg.finished:
            log.info("federation '%s' finished: %d rounds, dropped uploads %s", fed, len(agg.records),
                     agg.dropped or "none")

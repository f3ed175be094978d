"""`protofl-server start`: the aggregator as a long-running service (and, by default, its own broker)."""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import logging
import signal
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import typer

from broker_server.cli_common import CLIP_OPTION, data_shape, fixed_by_user, parse_clip, parse_sets
from broker_server.rounds import OFFLINE_GRACE_S
from broker_server.security import read_allow_list
from protofl import cli_options
from protofl.algorithms.robust import ClipPolicy
from protofl.errors import ConfigError, ProtoFLError
from protofl.plan import RoundPlan
from protofl.presets import preset_names

log = logging.getLogger("protofl.service")


def start_command(
    broker: str | None = typer.Option(None, help="Join this broker (mqtt://host:port or mqtts://...). Default: "
                                                 "start a local one (mosquitto if installed, else embedded amqtt)."),
    fed: str = typer.Option("default", help="Federation name (topics live under protofl/{fed}/)."),
    preset: str = typer.Option("protofl", help=f"Method to run: {' | '.join(preset_names())}."),
    config: Path | None = typer.Option(None, help="TOML file of config overrides (a federation table)."),
    min_clients: int | None = typer.Option(None, help="Clients needed to start round 1 and to close a phase at its "
                                                      "deadline."),
    round_timeout: float | None = typer.Option(None, help="Seconds a phase waits for uploads before closing with "
                                                          "whoever sent."),
    rounds: int | None = typer.Option(None, help="Communication rounds."),
    seed: int | None = typer.Option(None, help="Seed of the initial adapter, support masks and public set."),
    public_data: str | None = typer.Option(None, "--public-data", help="Dataset the public set is drawn from "
                                                                          "(presets with public-set anchors)."),
    data_dir: str | None = typer.Option(None, "--data-dir", help="Where --public-data's files are (fashion-mnist)."),
    state_dir: Path | None = typer.Option(None, "--state-dir", help="Keep the federation here: its upload journal "
                                             "and checkpoint (crash safe: run the same command again to resume), "
                                             "the local broker's files, credentials, rounds.jsonl and "
                                             "server_model.npz."),
    set_: list[str] = typer.Option([], "--set", help="Override a config field: --set lr=0.05 (repeatable)."),
    port: int = typer.Option(1883, help="Port of the local broker (0 = any free port)."),
    listen: str | None = typer.Option(None, help="HOST:PORT the local broker listens on (default 127.0.0.1:--port); "
                                                    "0.0.0.0:1883 serves other machines."),
    local_broker: str = typer.Option("auto", help="Local broker: auto | mosquitto | amqtt (amqtt enforces no "
                                                  "passwords or ACL: needs --insecure)."),
    allow: Path | None = typer.Option(None, help="Device ids allowed to join, one a line: each gets credentials, "
                                                    "anyone else is ignored."),
    devices: int | None = typer.Option(None, help="Without --allow: generate credentials for device-1..device-N "
                                                     "(default: --min-clients)."),
    broker_cert: str | None = typer.Option(None, "--broker-cert", help="TLS: the local broker's certificate (PEM; "
                                              "its names must be the host devices connect to). Needs --broker-key "
                                              "and --tls-ca (the CA that signed it)."),
    broker_key: str | None = typer.Option(None, "--broker-key", help="TLS: the local broker's private key (PEM)."),
    client_ca: str | None = typer.Option(None, "--client-ca", help="TLS: require every client (this server too: "
                                            "--tls-cert/--tls-key) to present a certificate signed by this CA."),
    max_clients: int | None = typer.Option(None, help="Accept at most this many devices; later joins are dropped."),
    offline_grace: float = typer.Option(OFFLINE_GRACE_S, help="Seconds a device whose connection dropped (its last "
                                        "will) keeps its place in the open round before the round stops waiting "
                                        "for it: a flaky link that reconnects within it still delivers."),
    insecure: bool = typer.Option(False, "--insecure", help="Local broker without passwords or ACL (anyone who "
                                  "reaches it can read uploads and publish rounds). Development only."),
    robust: str = typer.Option("mean", help="Aggregate plain-mean prototypes and adapters with mean | median | "
                                             "trimmed (coordinate-wise; ignores claimed sample counts)."),
    clip_factor: float = typer.Option(10.0, help="Clip every upload to this many times the median upload norm "
                                                 "of the previous round, around the current global value."),
    clip_first: float = typer.Option(1e4, help="The clipping radius of the first round (no statistics yet)."),
    clip: str = CLIP_OPTION,
    username: str | None = cli_options.USERNAME,
    password: str | None = cli_options.PASSWORD,
    tls_ca: str | None = cli_options.TLS_CA,
    tls_cert: str | None = cli_options.TLS_CERT,
    tls_key: str | None = cli_options.TLS_KEY,
    connect_timeout: float = cli_options.CONNECT_TIMEOUT,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log every join, upload drop and phase."),
) -> None:
    """Run the aggregator until the federation's last round: one log line per round."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("protofl.server").setLevel(logging.INFO if verbose else logging.WARNING)
    try:
        cfg, public = _federation(preset, config, parse_sets(set_), rounds, min_clients, round_timeout, seed,
                                  public_data, data_dir)
        try:
            policy = ClipPolicy(factor=clip_factor, first_radius=clip_first, robust=robust, enabled=parse_clip(clip))
        except ValueError as exc:
            raise ConfigError(f"{exc} (--robust, --clip-factor, --clip-first)") from None
        if not offline_grace >= 0:
            raise ConfigError(f"--offline-grace must be >= 0 seconds, got {offline_grace}")
        if max_clients is not None and max_clients < 1:
            raise ConfigError(f"--max-clients must be at least 1, got {max_clients}")
        access = Access(listen or f"127.0.0.1:{port}", insecure, read_allow_list(allow) if allow else None, devices,
                        max_clients, listener_tls(broker_cert, broker_key, client_ca, tls_ca, tls_cert, tls_key))
        _serve(cfg, public, fed, broker, state_dir, access, local_broker, username, password, tls_ca, tls_cert,
               tls_key, connect_timeout, policy, offline_grace)
    except (ProtoFLError, TimeoutError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def _federation(preset: str, config: Path | None, overrides: dict[str, Any], rounds: int | None,
                min_clients: int | None, round_timeout: float | None, seed: int | None, public_data: str | None,
                data_dir: str | None) -> tuple[Any, Any]:
    """The validated config and, where its plan has public classes, the public set carved exactly as the
    simulator carves it."""
    from protofl.data import load_dataset
    from protofl.data.federation import public_set
    from protofl.presets import make_config

    overrides.update({k: v for k, v in dict(rounds=rounds, min_clients=min_clients, round_timeout=round_timeout,
                                            seed=seed).items() if v is not None})
    train = None
    if public_data is not None:
        shape = data_shape(fixed_by_user(str(config) if config else None, overrides),
                           lambda: make_config(preset, str(config) if config else None, **overrides))
        train, _ = load_dataset(public_data, data_dir=data_dir, seed=overrides.get("seed", 0), **shape)
        overrides.update(num_classes=train.num_classes, in_shape=tuple(train.in_shape))
    cfg = make_config(preset, str(config) if config else None, **overrides)
    if not RoundPlan.from_config(cfg).public_classes:
        return cfg, None
    if train is None:
        raise ConfigError(f"preset '{cfg.preset}' uses public-set anchors and needs a public set: pass --public-data "
                          f"fashion-mnist (or synthetic:..., npz:PATH), or --set public_per_class=0")
    return cfg, public_set(train, cfg)


@dataclass(frozen=True)
class Access:
    """Who may reach the local broker and the federation: where it listens, credentials, allowed ids."""

    listen: str
    insecure: bool = False
    allow: list[str] | None = None
    devices: int | None = None
    max_clients: int | None = None
    tls: Any = None  # broker.ListenerTls of the local broker, or None (plain TCP)

    def host_port(self) -> tuple[str, int]:
        host, sep, port = self.listen.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ConfigError(f"--listen '{self.listen}': expected HOST:PORT, e.g. 0.0.0.0:1883 or 127.0.0.1:1883")
        return host, int(port)

    def device_ids(self, cfg: Any) -> list[str]:
        if self.allow is not None:
            return self.allow
        return [f"device-{i}" for i in range(1, (self.devices or cfg.min_clients) + 1)]


def listener_tls(cert: str | None, key: str | None, client_ca: str | None, tls_ca: str | None,
                 tls_cert: str | None, tls_key: str | None) -> Any:
    """The local broker's TLS listener from the flags, or None; checks the server can connect to it."""
    from broker_server.broker import ListenerTls

    if not (cert or key or client_ca):
        return None
    if not (cert and key):
        raise ConfigError("TLS on the local broker needs both --broker-cert and --broker-key")
    if not tls_ca:
        raise ConfigError("--broker-cert needs --tls-ca, the CA that signed it: the server verifies its own broker "
                          "(and devices need the same file)")
    if client_ca and not (tls_cert and tls_key):
        raise ConfigError("--client-ca makes the broker require client certificates, this server's too: pass "
                          "--tls-cert and --tls-key")
    for flag, path in (("--broker-cert", cert), ("--broker-key", key), ("--client-ca", client_ca)):
        if path and not Path(path).is_file():
            raise ConfigError(f"{flag} {path}: no such file")
    return ListenerTls(certfile=cert, keyfile=key, cafile=client_ca or tls_ca, require_client_cert=bool(client_ca))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _local_broker(stack: contextlib.ExitStack, cfg: Any, fed: str, state_dir: Path | None, access: Access,
                  local_broker: str) -> tuple[str, str, Any]:
    """Start the local broker, secured unless --insecure; returns (url, protocol, BrokerAuth or None)."""
    from broker_server.broker import PACKET_HEADROOM, MosquittoBroker, PortInUse, start_local_broker
    from broker_server.security import load_or_create
    from broker_server.shell import decoder_limits
    from broker_server.supervisor import BrokerSupervisor

    host, port = access.host_port()
    auth = None
    if access.insecure:
        where = "on loopback only" if is_loopback(host) else f"on {host}, reachable from other machines"
        log.warning("--insecure: the broker accepts anyone %s: they can read every upload and publish rounds", where)
    else:
        sec_dir = state_dir / "security" if state_dir else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="protofl-security-")))
        auth = load_or_create(sec_dir, fed, access.device_ids(cfg))
        _announce_credentials(auth, persistent=state_dir is not None)
    if not is_loopback(host) and access.tls is None:
        log.warning("listening on %s without TLS: passwords and uploads cross the network in clear; pass "
                    "--broker-cert/--broker-key/--tls-ca (SECURITY.md)", host)
    # The broker refuses what the aggregator's decoder would refuse anyway (plus the packet's header).
    packet = decoder_limits(cfg).max_message_bytes + PACKET_HEADROOM
    try:
        local = start_local_broker(local_broker, port=port, host=host,  # type: ignore[arg-type]
                                   workdir=state_dir / "broker" if state_dir else None, max_packet_size=packet,
                                   auth_lines=auth.mosquitto_lines() if auth else (), allow_amqtt=access.insecure,
                                   tls=access.tls, die_with_parent=True)
    except PortInUse as exc:
        raise ConfigError(f"{exc} (to serve on any free port: --port 0)") from None
    stack.callback(getattr(local, "cleanup", local.stop))
    if isinstance(local, MosquittoBroker):
        # Restarted if it dies; the ExitStack stops the supervisor before it stops the broker.
        stack.callback(BrokerSupervisor(local).start().stop)
    # Clients connect over loopback when the broker listens on every interface.
    url = local.url.replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//[::1]:")
    return url, local.protocol, auth


def last_logged_round(path: Path) -> int:
    """The highest round in a rounds.jsonl (0 if none; a torn last line from a crash is ignored)."""
    last = 0
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                last = max(last, int(json.loads(line)["round"]))
            except (ValueError, KeyError, TypeError):
                continue
    return last


def _announce_credentials(auth: Any, persistent: bool) -> None:
    """Tell the operator where the device credentials are (or, when they vanish at exit, show them once)."""
    new = ", ".join(auth.new_devices) or "none"
    if persistent:
        log.info("credentials in %s (new devices: %s): give each device its devices/<id>.json and run "
                 "protofl-edge join --credentials FILE", auth.directory, new)
        return
    lines = "\n".join(f"  {i} {auth.secrets.devices[i]}" for i in sorted(auth.secrets.devices))
    log.warning("no --state-dir: credentials for this run only (shown once; protofl-edge join --username ID "
                "--password PASSWORD):\n%s", lines)


def _serve(cfg: Any, public: Any, fed: str, broker: str | None, state_dir: Path | None, access: Access,
           local_broker: str, username: str | None, password: str | None, tls_ca: str | None, tls_cert: str | None,
           tls_key: str | None, connect_timeout: float, policy: Any = None,
           offline_grace: float = OFFLINE_GRACE_S) -> None:
    from broker_server.service import AggregatorService, save_server_model
    from protofl.transport.broker_url import parse_broker_url

    with contextlib.ExitStack() as stack:
        protocol = "auto"
        members = access.allow
        broker_is_ours = broker is None
        if broker is None:
            broker, protocol, auth = _local_broker(stack, cfg, fed, state_dir, access, local_broker)
            if auth is not None:
                username, password = auth.secrets.server.username, auth.secrets.server.password
                members = sorted(auth.secrets.devices) if members is None else members
        elif username is None:
            log.warning("joining %s without credentials: unless that broker enforces an ACL (protofl-server "
                        "broker-config writes one), anyone on it can read uploads and publish rounds", broker)
        options = parse_broker_url(broker).with_auth(username, password, tls_ca, tls_cert, tls_key)
        if broker_is_ours and access.tls is not None:
            # Our own broker over loopback: its certificate names the host devices use, not 127.0.0.1.
            options = dataclasses.replace(options, tls_check_hostname=False)
        rounds_file = None
        logged = 0  # the last round rounds.jsonl holds: a restarted server that closes it again adds no line
        if state_dir is not None:
            state_dir.mkdir(parents=True, exist_ok=True)
            logged = last_logged_round(state_dir / "rounds.jsonl")
            rounds_file = stack.enter_context((state_dir / "rounds.jsonl").open("a"))

        def on_round_end(rec: Any) -> None:
            nonlocal logged
            if rounds_file is not None and rec.round > logged:
                rounds_file.write(json.dumps({"fed": fed, **asdict(rec)}) + "\n")
                rounds_file.flush()
                logged = rec.round

        service = AggregatorService(cfg, fed, options, public=public, protocol=protocol,  # type: ignore[arg-type]
                                    on_round_end=on_round_end, members=members, policy=policy,
                                    max_clients=access.max_clients, offline_grace=offline_grace,
                                    state_dir=state_dir)
        service.start(connect_timeout)
        if service.resumed and service.finished:
            log.warning("federation '%s' in %s finished already (%d rounds); writing its model again. For a new "
                        "federation use another --state-dir", fed, state_dir, len(service.aggregator.records))
        who = "--credentials devices/ID.json" if username and broker_is_ours else "--client-id ID"
        log.info("devices join with: protofl-edge join --broker %s --fed %s %s --data PATH", options.url, fed, who)

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
            log.info("federation '%s' finished: %d rounds, dropped uploads %s, clipped uploads %s", fed,
                     len(agg.records), agg.dropped or "none", agg.model.clipped or "none")

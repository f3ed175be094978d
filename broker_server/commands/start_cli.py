"""`protofl-server start`: the aggregator as a long-running service (and, by default, its own broker)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import typer

from broker_server.cli_common import CLIP_OPTION, data_shape, fixed_by_user, parse_clip, parse_sets, read_classes, sets
from broker_server.core import secagg_run
from broker_server.core.rounds import OFFLINE_GRACE_S
from broker_server.ops.capacity import DEFAULT_QUEUE, resend_window, uploads_per_phase
from broker_server.ops.device_logs import LOG_DIR, DeviceLogs
from broker_server.ops.fleet_run import stop_requested
from broker_server.ops.security import read_allow_list
from broker_server.settings import (
    DEFAULT_SHARD_TIMEOUT_S,
    Admission,
    Broker,
    Durability,
    Federation,
    Hooks,
    MqttVersion,
    Pacing,
    Sharding,
    Validation,
    Watchers,
)
from protofl import cli_options, privacy
from protofl.algorithms.robust import ClipPolicy
from protofl.errors import ConfigError, ProtoFLError
from protofl.names import check_name
from protofl.plan import RoundPlan
from protofl.presets import preset_names
from protofl.signals import log_from_handler
from protofl.transport.broker_url import CONNECT_TIMEOUT_S

if TYPE_CHECKING:
    from broker_server.ops.privacy_ledger import FleetView
    from protofl.privacy import DpSettings

log = logging.getLogger("protofl.service")
UNSERVED_TIMEOUT_S = 600.0  # `--unserved-timeout`'s default: a fleet run that no device can serve fails after this


def _positive(value: float, flag: str) -> float:
    if not value > 0:
        raise ConfigError(f"{flag} {value:g}: give a number of seconds above 0")
    return value


# `start --help` groups the options by the settings bundle they build (settings.py; `Access` and the broker's
# connection here), so 52 options read as the nine things they configure.
FEDERATION, BROKER = cli_options.FEDERATION_PANEL, cli_options.BROKER_PANEL
VALIDATION, ADMISSION, DURABILITY = "Validation", "Admission", "Durability"
VALIDATION_SHARE = 0.2  # --validation-share: a fifth of each class, as an own data set's held-out split
ACCESS, SHARDING, WATCHERS = "Local broker (Access)", "Sharding", "Watchers"


def start_command(
    broker: str | None = typer.Option(
        None,
        help="Join this broker (mqtt://host:port or mqtts://...). Default: "
        "start a local one (mosquitto if installed, else embedded amqtt).",
        rich_help_panel=BROKER,
    ),
    fed: str = typer.Option(
        "default", help="Federation name (topics live under protofl/{fed}/).", rich_help_panel=FEDERATION
    ),
    preset: str = typer.Option(
        "protofl", help=f"Method to run: {' | '.join(preset_names())}.", rich_help_panel=FEDERATION
    ),
    config: Path | None = typer.Option(
        None, help="TOML file of config overrides (a federation table).", rich_help_panel=FEDERATION
    ),
    min_clients: int | None = typer.Option(
        None, help="Clients needed to start round 1 and to close a phase at its deadline.", rich_help_panel=FEDERATION
    ),
    round_timeout: float | None = typer.Option(
        None, help="Seconds a phase waits for uploads before closing with whoever sent.", rich_help_panel=FEDERATION
    ),
    rounds: int | None = typer.Option(None, help="Communication rounds.", rich_help_panel=FEDERATION),
    seed: int | None = typer.Option(
        None, help="Seed of the initial adapter, support masks and public set.", rich_help_panel=FEDERATION
    ),
    public_data: str | None = typer.Option(
        None,
        "--public-data",
        help="Dataset the public set is drawn from (presets with public-set anchors).",
        rich_help_panel=FEDERATION,
    ),
    data_dir: str | None = typer.Option(
        None,
        "--data-dir",
        help="Where --public-data's (and --validation's) files are (fashion-mnist).",
        rich_help_panel=FEDERATION,
    ),
    classes: Path | None = typer.Option(
        None,
        "--classes",
        help="The federation's class names, one a line (the first is class 0): in the config, so every device "
        "matches its class folders (and a CSV's label names) with them and refuses others. Default: "
        "--public-data's names (fashion-mnist's, an image folder's class folders), else none.",
        rich_help_panel=FEDERATION,
    ),
    validation: str | None = typer.Option(
        None,
        "--validation",
        help="Labelled data the server scores the federation's deployable model on every round (the global "
        "predictor; FedAvg: its global model): its test split where it has one (fashion-mnist, an image folder's "
        "test/), else all of it; the same data as --public-data: a stratified share of it (--validation-share), "
        "the rest trains the backbone. In status, the live page, /metrics and rounds.jsonl. Needs torch here.",
        rich_help_panel=VALIDATION,
    ),
    validation_limit: int | None = typer.Option(
        2000,
        "--validation-limit",
        help="Score a seeded random N of --validation's images (default 2000; 0: all).",
        rich_help_panel=VALIDATION,
    ),
    validation_share: float = typer.Option(
        VALIDATION_SHARE,
        "--validation-share",
        help="--validation the same data as --public-data (without a test split of its own): the share of each "
        "class held out for validation, disjoint from the public set. 0: all of it trains the backbone and "
        "validation scores those same images (optimistic: said in the log).",
        rich_help_panel=VALIDATION,
    ),
    state_dir: Path | None = typer.Option(
        None,
        "--state-dir",
        help="Keep the federation here: its upload journal "
        "and checkpoint (crash safe: run the same command again to resume), "
        "the local broker's files, credentials, rounds.jsonl and "
        "server_model.npz.",
        rich_help_panel=DURABILITY,
    ),
    set_: list[str] = typer.Option(
        [],
        "--set",
        help="Override a config field or a technique option: --set lr=0.05, --set TECHNIQUE.OPTION=value (repeatable).",
        rich_help_panel=FEDERATION,
    ),
    port: int = typer.Option(1883, help="Port of the local broker (0 = any free port).", rich_help_panel=ACCESS),
    listen: str | None = typer.Option(
        None,
        help="HOST:PORT the local broker listens on (default 127.0.0.1:--port); 0.0.0.0:1883 serves other machines.",
        rich_help_panel=ACCESS,
    ),
    local_broker: str = typer.Option(
        "auto",
        help="Local broker: auto | mosquitto | amqtt (amqtt enforces no passwords or ACL: needs --insecure).",
        rich_help_panel=ACCESS,
    ),
    allow: Path | None = typer.Option(
        None,
        help="Device ids allowed to join, one a line: each gets credentials, anyone else is ignored.",
        rich_help_panel=ADMISSION,
    ),
    devices: int | None = typer.Option(
        None,
        help="Without --allow: generate credentials for device-1..device-N (default: --min-clients).",
        rich_help_panel=ADMISSION,
    ),
    tls: str = typer.Option(
        "auto",
        "--tls",
        help="TLS on the local broker with the federation's generated CA, "
        "whose certificate travels in every devices/<id>.json: auto (on when --listen is beyond "
        "loopback) | on | off. --broker-cert/--broker-key/--tls-ca serve your own instead.",
        rich_help_panel=ACCESS,
    ),
    broker_cert: str | None = typer.Option(
        None,
        "--broker-cert",
        help="TLS: the local broker's certificate (PEM; "
        "its names must be the host devices connect to). Needs --broker-key "
        "and --tls-ca (the CA that signed it).",
        rich_help_panel=ACCESS,
    ),
    broker_key: str | None = typer.Option(
        None, "--broker-key", help="TLS: the local broker's private key (PEM).", rich_help_panel=ACCESS
    ),
    client_ca: str | None = typer.Option(
        None,
        "--client-ca",
        help="TLS: require every device to present a "
        "certificate signed by this CA (the server itself uses the broker's "
        "unix socket).",
        rich_help_panel=ACCESS,
    ),
    max_clients: int | None = typer.Option(
        None, help="Accept at most this many devices; later joins are dropped.", rich_help_panel=ADMISSION
    ),
    broker_queue: int | None = typer.Option(
        None,
        "--broker-queue",
        help="Messages the local broker holds for the "
        "aggregator beyond those in flight (mosquitto max_queued_messages); "
        "past it the broker drops them after acknowledging them to the "
        "devices, and the server asks those devices to re-send, never more at "
        "once than half of it holds. Default: from the fleet (devices x what "
        "one sends in a phase x 2, at least 10000). With --broker: what that "
        "broker's max_queued_messages is (default 10000).",
        rich_help_panel=ACCESS,
    ),
    offline_grace: float = typer.Option(
        OFFLINE_GRACE_S,
        help="Seconds a device whose connection dropped (its last "
        "will) keeps its place in the open round before the round stops waiting "
        "for it: a flaky link that reconnects within it still delivers.",
        rich_help_panel=FEDERATION,
    ),
    insecure: bool = typer.Option(
        False,
        "--insecure",
        help="Local broker without passwords or ACL (anyone who "
        "reaches it can read uploads and publish rounds). Development only.",
        rich_help_panel=ADMISSION,
    ),
    robust: str = typer.Option(
        "mean",
        help="Aggregate plain-mean prototypes and adapters with mean | median | "
        "trimmed (coordinate-wise; ignores claimed sample counts).",
        rich_help_panel=FEDERATION,
    ),
    clip_factor: float = typer.Option(
        10.0,
        help="Clip every upload to this many times the median upload norm "
        "of the previous round, around the current global value.",
        rich_help_panel=FEDERATION,
    ),
    clip_first: float = typer.Option(
        1e4, help="The clipping radius of the first round (no statistics yet).", rich_help_panel=FEDERATION
    ),
    clip: str = CLIP_OPTION,
    username: str | None = cli_options.USERNAME,
    password: str | None = cli_options.PASSWORD,
    tls_ca: str | None = cli_options.TLS_CA,
    tls_cert: str | None = cli_options.TLS_CERT,
    tls_key: str | None = cli_options.TLS_KEY,
    connect_timeout: float = cli_options.CONNECT_TIMEOUT,
    metrics_port: int | None = typer.Option(
        None,
        "--metrics-port",
        help="Serve Prometheus metrics on this port "
        "(/metrics; 0 = any free port): rounds, phase, members, uploads, bytes, "
        "accuracy, round durations, journal fsyncs, broker restarts.",
        rich_help_panel=WATCHERS,
    ),
    metrics_host: str = typer.Option(
        "127.0.0.1",
        "--metrics-host",
        help="Address of --metrics-port (0.0.0.0 lets a Prometheus on another machine scrape it).",
        rich_help_panel=WATCHERS,
    ),
    ui_port: int | None = typer.Option(
        None,
        "--ui-port",
        help="Serve the live page on this port (0 = any free "
        "port): devices, round timeline, accuracy and bytes curves.",
        rich_help_panel=WATCHERS,
    ),
    ui_host: str = typer.Option(
        "127.0.0.1",
        "--ui-host",
        help="Address of --ui-port; beyond loopback the page asks for a password (user protofl).",
        rich_help_panel=WATCHERS,
    ),
    ui_password: str | None = typer.Option(
        None,
        "--ui-password",
        envvar="PROTOFL_UI_PASSWORD",
        help="The live page's password (default beyond loopback: generated once into STATE_DIR/security/ui-password).",
        rich_help_panel=WATCHERS,
    ),
    shards: int = typer.Option(
        0,
        "--shards",
        help="Aggregate on N shard processes sharing the uploads (an MQTT 5 "
        "shared subscription), merged by this server at each phase's close: the same result "
        "as one aggregator, N cores. 0: one aggregator.",
        rich_help_panel=SHARDING,
    ),
    spawn_shards: bool = typer.Option(
        True,
        "--spawn-shards/--no-spawn-shards",
        help="--shards N: run the shards here, "
        "as children restarted when they die; --no-spawn-shards waits for N `protofl-"
        "server shard` processes on other machines (their credentials: STATE_DIR/"
        "security/shards/).",
        rich_help_panel=SHARDING,
    ),
    sites: str | None = typer.Option(
        None,
        "--sites",
        help="Pre-aggregated sites, NAME,...: each site's broker "
        "(bridged to this one) runs `protofl-server shard --site NAME`, which folds its "
        "devices' uploads there and sends one partial per phase.",
        rich_help_panel=SHARDING,
    ),
    shard_timeout: float = typer.Option(
        DEFAULT_SHARD_TIMEOUT_S,
        "--shard-timeout",
        help="--shards/--sites: "
        "seconds a closing phase waits for a shard's partial before it closes "
        "without that shard's uploads (a shard on a machine that is gone); a spawned "
        "shard is restarted in seconds and resumes from its journal. Give remote "
        "shards the same --shard-timeout: the broker keeps a gone shard's share of "
        "the uploads this long.",
        rich_help_panel=SHARDING,
    ),
    shard_credentials: Path | None = typer.Option(
        None,
        "--shard-credentials",
        help="--broker with --shards: the "
        "directory of shard-I.json credentials (broker-config --shards N "
        "writes it) the spawned shards use.",
        rich_help_panel=SHARDING,
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log every join, upload drop and phase."),
    fleet_run: str | None = typer.Option(
        None, "--fleet-run", hidden=True, help="This is run NAME of a fleet (broker_server/fleet/fleet.py starts it)."
    ),
    revoked_file: Path | None = typer.Option(
        None, "--revoked-file", hidden=True, help="A fleet's revoked devices (broker_server/ops/enrol.py): watched."
    ),
    unserved_timeout: float = typer.Option(
        600.0,
        "--unserved-timeout",
        help="A fleet's run (run submit): it fails, with the devices' reasons, when no device has joined it this "
        "many seconds after one said it cannot serve it, or at once when every enrolled device said so; the queue "
        "moves on.",
    ),
    device_logs: Path | None = typer.Option(
        None, "--device-logs", hidden=True, help="Where the devices' log lines go (default: STATE_DIR/device-logs)."
    ),
    fleet_ledger: Path | None = typer.Option(
        None,
        "--fleet-ledger",
        hidden=True,
        help="A fleet's privacy ledger (broker_server/ops/privacy_ledger.py): shown; this run's spend is written.",
    ),
) -> None:
    """Run the aggregator until the federation's last round: one log line per round."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("protofl.server").setLevel(logging.INFO if verbose else logging.WARNING)
    try:
        overrides = parse_sets(set_)
        read_classes(classes, overrides)
        cfg, public, scored, backbone, norm = _federation(
            preset,
            config,
            overrides,
            rounds,
            min_clients,
            round_timeout,
            seed,
            public_data,
            data_dir,
            validation,
            validation_limit,
            state_dir,
            validation_share,
        )
        try:
            policy = ClipPolicy(factor=clip_factor, first_radius=clip_first, robust=robust, enabled=parse_clip(clip))
        except ValueError as exc:
            raise ConfigError(f"{exc} (--robust, --clip-factor, --clip-first)") from None
        # Every option once, into its group (settings.py): validated there, with the reason and the option.
        durability = Durability(state_dir)
        federation = Federation(
            cfg, fed, public=public, policy=policy, offline_grace=offline_grace, validation=scored, norm=norm
        )
        admission = Admission(max_clients=max_clients)  # the members: credentials' devices or --allow, in _serve
        site_names = tuple(check_name(s.strip(), "--sites: site") for s in (sites or "").split(",") if s.strip())
        sharding = Sharding(shards, site_names, shard_timeout, spawn_shards, shard_credentials)
        if cfg.secagg:  # what cannot combine with secure aggregation, refused before anything starts
            secagg_run.check_config(cfg, policy, sharded=bool(shards or site_names))
            log.info("secure aggregation, at --min-clients: %s", secagg_run.parameters_line(cfg))
        access = Access(
            listen or f"127.0.0.1:{port}",
            insecure,
            read_allow_list(allow) if allow else None,
            devices,
            max_clients,
            listener_tls(broker_cert, broker_key, client_ca, tls_ca, tls),
            tls,
            client_ca,
            shards,
        )
        access.check(external_broker=broker is not None)
        queue = _broker_capacity(
            cfg, access, broker_queue, external=broker is not None, bridged=_bridged(state_dir, access.insecure)
        )
        watching = Watching(metrics_host, metrics_port, ui_host, ui_port, ui_password)
        check_sharding(sharding, cfg, policy, external_broker=broker is not None, secured=username is not None)
        # The server reaches a broker of its own through that broker's unix socket: no TLS files there.
        client = ClientAuth(username, password, *((tls_ca, tls_cert, tls_key) if broker is not None else ()))
        _serve(
            Start(
                federation,
                durability,
                admission,
                sharding,
                watching,
                access,
                client,
                broker,
                local_broker,
                queue,
                connect_timeout,
                None if fleet_run is None else check_name(fleet_run, "--fleet-run"),
                revoked_file,
                device_logs,
                fleet_ledger,
                _positive(unserved_timeout, "--unserved-timeout"),
                backbone,
            )
        )
    except (ProtoFLError, TimeoutError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def _federation(
    preset: str,
    config: Path | None,
    overrides: dict[str, Any],
    rounds: int | None,
    min_clients: int | None,
    round_timeout: float | None,
    seed: int | None,
    public_data: str | None,
    data_dir: str | None,
    validation: str | None = None,
    validation_limit: int | None = None,
    state_dir: Path | None = None,
    validation_share: float = VALIDATION_SHARE,
) -> tuple[Any, Any, Validation | None, Backbone | None, tuple[tuple[float, ...], tuple[float, ...]] | None]:
    """The validated config and, where its plan has public classes, the public set carved exactly as the
    simulator carves it. The class names of --public-data name the federation's classes unless --classes or the
    config does, or `state_dir` holds a federation started without names (it resumes as it was started). Where the
    plan has a shared backbone, its training (minutes) is returned as a step `_serve` runs once the broker and the
    devices' credentials are up, not run here."""
    import numpy as np

    from protofl.data.classnames import data_class_names
    from protofl.data.federation import fit_public, public_set, server_split
    from protofl.presets import make_config

    overrides.update(
        {
            k: v
            for k, v in dict(rounds=rounds, min_clients=min_clients, round_timeout=round_timeout, seed=seed).items()
            if v is not None
        }
    )
    train, val, norm = None, None, None
    if public_data is not None:
        fixed = fixed_by_user(str(config) if config else None, overrides)
        shape = data_shape(fixed, lambda: make_config(preset, str(config) if config else None, **overrides))
        # the data as it is: no share silently held out (a --validation of the same data is split below, said)
        train, own_test = _server_source(public_data, data_dir=data_dir, seed=overrides.get("seed", 0), **shape)
        overrides.update(num_classes=train.num_classes, in_shape=tuple(train.in_shape))
        if "class_names" not in fixed and not _started_without_names(state_dir):
            # the public data's own names (fashion-mnist's, class folders) name the classes
            overrides["class_names"] = data_class_names(public_data, train.num_classes)
        if validation is not None and validation.strip() == public_data.strip():
            train, val = server_split(train, own_test, validation_share, overrides.get("seed", 0), public_data)
    cfg = make_config(preset, str(config) if config else None, strict=True, **overrides)
    if train is not None:  # a public set that fits the public data (or none, where nothing uses one)
        cfg = fit_public(
            train, cfg, fixed=sets(str(config) if config else None, overrides, "public_per_class"), server_only=True
        )
    plan = RoundPlan.from_config(cfg)
    if validation is not None and not plan.shared_backbone and cfg.federate != "full":
        raise ConfigError(
            f"--validation scores the federation's deployable model: the global predictor's head on the shared "
            f"backbone, or FedAvg's global model; preset '{cfg.preset}' has neither (it runs with the ridge "
            f"predictor: --set ridge=true, where nothing else is federated)"
        )
    if validation is not None and val is None:
        # other data than --public-data: its own test split where it has one, else all of it
        v_train, v_test = _server_source(
            validation,
            data_dir=data_dir,
            num_classes=cfg.num_classes,
            in_shape=cfg.in_shape,
            class_names=cfg.class_names,
        )
        val = v_test if v_test is not None else v_train
    if val is not None and validation_limit and validation_limit < len(val.y):
        val = val.subset(np.sort(np.random.default_rng([cfg.seed, 0x7A1]).permutation(len(val.y))[:validation_limit]))
        log.info("--validation: %d of its images scored (--validation-limit; 0: all)", validation_limit)
    if train is not None:
        norm = (tuple(train.mean), tuple(train.std))  # the server's data's: how a model it trains or scores sees it
    elif val is not None:
        norm = (tuple(val.mean), tuple(val.std))
    if plan.shared_backbone:
        public = public_set(train, cfg) if train is not None and plan.public_classes else None
        return cfg, public, None, lambda: _with_backbone(cfg, train, public, val), norm
    scored = None
    if val is not None:  # FedAvg: its global model, scored by a torch child process each round
        from broker_server.ops.model_scorer import ModelScorer

        assert norm is not None
        scorer = ModelScorer(cfg, val.x, list(norm[0]), list(norm[1]))
        scored = Validation(None, np.asarray(val.y, np.int64), f"{len(val.y):,} images of {val.name}", scorer.predict)
    if not plan.public_classes:
        return cfg, None, scored, None, norm
    if train is None:
        raise ConfigError(
            f"preset '{cfg.preset}' uses public-set anchors and needs a public set: pass --public-data "
            f"fashion-mnist (or synthetic:..., npz:PATH), or --set public_per_class=0"
        )
    return cfg, public_set(train, cfg), scored, None, norm


Backbone = Callable[[], "tuple[Any, Validation | None]"]  # the shared backbone's training: (public, validation)


def _server_source(spec: str, **kwargs: Any) -> tuple[Any, Any]:
    """(the data, its own test split or None) of the server's `spec`, nothing held out: fashion-mnist's test set,
    an image folder's test/, an npz's x_test; the synthetic generator's test set counts as one here (it stands for
    the data's own held-out images)."""
    from protofl.data import load_dataset
    from protofl.data.loaders import load_source

    if spec.partition(":")[0].strip().lower() == "synthetic":
        return load_dataset(spec, **kwargs)
    return load_source(spec, holdout=None, **kwargs)


def _started_without_names(state_dir: Path | None) -> bool:
    """Whether `state_dir` holds a federation whose saved config names no classes (one started before the names
    were part of the config, or without them): it resumes without names rather than refusing the changed config."""
    saved = None if state_dir is None else state_dir / "aggregator" / "federation.json"
    if saved is None or not saved.is_file():
        return False
    try:
        config = json.loads(saved.read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return False  # the resume says what is wrong with it
    return isinstance(config, dict) and "class_names" not in config


def _with_backbone(cfg: Any, train: Any, public: Any, validation: Any = None) -> tuple[Any, Validation | None]:
    """The public message with the federation's shared backbone (the ridge predictor's), trained on the public set
    by the torch side in a child process (the server stays torch-free; edge_agent/training/backbone.py), and the
    server's
    validation data (`--validation`: a Dataset, or None) embedded with it. Without --public-data none travels and
    the devices use the seeded initial model (random features), which is said."""
    import numpy as np

    from protofl.data.federation import public_indices, with_shared_backbone

    idx = public_indices(train, cfg) if train is not None and cfg.backbone_epochs else np.zeros(0, np.int64)
    if len(idx) == 0 and cfg.public_per_class and cfg.backbone_epochs:
        log.warning(
            "the global predictor's shared backbone is the seeded initial model (random features): pass "
            "--public-data DATA (e.g. fashion-mnist) to train it on the public set, or --set ridge=false"
        )
    if len(idx) == 0 and validation is None:
        return public, None
    with tempfile.TemporaryDirectory(prefix="protofl-backbone-") as tmp:
        t = Path(tmp)
        (t / "config.json").write_text(json.dumps(cfg.to_dict()))
        argv = [sys.executable, "-m", "edge_agent.training.backbone", str(t / "config.json")]
        if len(idx):
            np.savez(
                t / "public.npz", x=train.x[idx], y=train.y[idx], mean=np.array(train.mean), std=np.array(train.std)
            )
            argv += ["--public", str(t / "public.npz"), "--out", str(t / "backbone.npy")]
            argv += ["--graph-out", str(t / "graph.onnx")]  # its forward pass for lite devices (protofl/lite.py)
            log.info(
                "training the shared backbone on the public set (%d images, %d epochs)", len(idx), cfg.backbone_epochs
            )
        if validation is not None:  # normalised as the backbone's inputs are (the public data's), where it is trained
            like = train if len(idx) else validation
            np.savez(t / "val.npz", x=validation.x, mean=np.array(like.mean), std=np.array(like.std))
            argv += ["--embed", str(t / "val.npz"), "--embed-out", str(t / "val.npy")]
        done = _run_child(argv)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            if "No module named" in done.stderr:
                raise ConfigError(
                    f"training the global predictor's shared backbone (--public-data) and scoring it (--validation) "
                    f"need torch on the server ({last}): pip install 'protofl-edge[device]' here, or leave both out "
                    f"(the devices then use the seeded initial model as the backbone)"
                )
            raise ConfigError(f"the shared backbone's child process failed: {done.stderr.strip()[-2000:]}")
        vec = np.load(t / "backbone.npy", allow_pickle=False) if len(idx) else None
        like = train if len(idx) else validation
        graph, layout = None, None
        if (t / "graph.onnx").is_file():
            graph = (t / "graph.onnx").read_bytes()
            layout = [(str(n), tuple(sh)) for n, sh in json.loads((t / "graph.onnx.json").read_text())]
        elif len(idx):
            said = [ln for ln in done.stderr.splitlines() if ln.startswith("no ONNX graph")]
            log.warning(
                "%s: lite devices (no torch) cannot join", said[-1] if said else "no ONNX graph of the backbone"
            )
        scored = (
            None
            if validation is None
            else Validation(
                np.load(t / "val.npy", allow_pickle=False),
                np.asarray(validation.y, np.int64),
                f"{len(validation.y):,} images of {validation.name}",
                embed=_reembedder(cfg, validation.x, like.mean, like.std),
            )
        )
    if vec is None:
        return public, scored
    return with_shared_backbone(public, train, vec, graph, layout), scored


def _run_child(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """The backbone's child process, its progress lines ("shared backbone: epoch 3/20 done (41 s)") logged as they
    come (minutes of training are not minutes of silence), the rest of its output kept for an error message."""
    from broker_server.ops.broker import _die_with_parent  # the training dies with `start`, however it ends

    kept: list[str] = []
    with subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=_die_with_parent
    ) as child:
        assert child.stderr is not None
        try:
            for line in child.stderr:
                if line.startswith("shared backbone: "):
                    log.info("%s", line.rstrip())
                else:
                    kept.append(line)
            code = child.wait()
        finally:  # stopped meanwhile (a signal, Ctrl-C): the training stops with it
            if child.poll() is None:
                child.kill()
    return subprocess.CompletedProcess(argv, code, "", "".join(kept))


def _reembedder(cfg: Any, x: Any, mean: Any, std: Any) -> Any:
    """The validation images' features under a whole-model vector (the ridge predictor's route refreshes the backbone
    each round), computed by the torch side in a child process as the first were (the server stays torch-free)."""
    import subprocess

    import numpy as np

    def embed(vector: Any) -> Any:
        with tempfile.TemporaryDirectory(prefix="protofl-validation-") as tmp:
            t = Path(tmp)
            (t / "config.json").write_text(json.dumps(cfg.to_dict()))
            np.save(t / "g.npy", np.asarray(vector, np.float32), allow_pickle=False)
            np.savez(t / "val.npz", x=x, mean=np.array(mean), std=np.array(std))
            argv = [sys.executable, "-m", "edge_agent.training.backbone", str(t / "config.json"), "--backbone",
                    str(t / "g.npy"), "--embed", str(t / "val.npz"), "--embed-out", str(t / "val.npy")]  # fmt: skip
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"scoring the refreshed predictor failed: {done.stderr.strip()[-2000:]}")
            return np.load(t / "val.npy", allow_pickle=False)

    return embed


def _backbone_of(agg: Any) -> Any:
    """The public message that ships the shared backbone (None: none, or the seeded model)."""
    return agg.machine.public


def _bridged(state_dir: Path | None, insecure: bool) -> set[str]:
    """Devices of this federation at bridged site brokers (broker-config --bridge wrote them in its credentials)."""
    from broker_server.ops.security import bridged_devices

    return set() if state_dir is None or insecure else bridged_devices(state_dir / "security")


def _broker_capacity(
    cfg: Any, access: Access, broker_queue: int | None, external: bool, bridged: set[str] | None = None
) -> int:
    """The local broker's queue for the aggregator (--broker-queue, or sized from the fleet), after raising the
    open-file limit as far as the hard limit allows; a fleet the limit cannot hold is refused here, before
    anything is written (broker_server/ops/capacity.py). Devices at bridged site brokers (`bridged`) count in the
    fleet whose burst the queue holds, not in the connections the local broker serves."""
    from broker_server.core.shell import decoder_limits
    from broker_server.ops.capacity import (
        BURST_EXTRA,
        held_bytes,
        inflight_window,
        queue_for_fleet,
        raise_open_files,
        uploads_per_phase,
    )
    from protofl.humanize import human_bytes

    if broker_queue is not None and broker_queue < 1:
        raise ConfigError(f"--broker-queue must be at least 1 message, got {broker_queue}")
    if external:  # not ours to size (protofl-server broker-config prints a line for N devices): what it holds
        return broker_queue or DEFAULT_QUEUE
    bridged = bridged or set()
    direct = set(access.device_ids(cfg)) - bridged
    fleet = max(len(direct) + len(bridged), access.max_clients or 0)
    raise_open_files(max(len(direct), (access.max_clients or 0) - len(bridged)))
    queue = broker_queue or queue_for_fleet(fleet, uploads_per_phase(cfg))
    largest = decoder_limits(cfg).max_message_bytes
    burst = fleet * (uploads_per_phase(cfg) + BURST_EXTRA)  # what this fleet sends in its busiest phase
    log.info(
        "the local broker queues up to %d messages for the aggregator (%s, fleet of %d) and %d in flight to each of "
        "its readers; this fleet's busiest phase sends it %d messages: at most %s, were each the largest the "
        "federation accepts (%s)",
        queue,
        "--broker-queue" if broker_queue else "sized from the fleet",
        fleet,
        inflight_window(),
        burst,
        human_bytes(held_bytes(min(queue, burst), largest, window=0)),
        human_bytes(largest),
    )
    return queue


TLS_MODES = ("auto", "on", "off")


def check_sharding(sharding: Sharding, cfg: Any, policy: Any, *, external_broker: bool, secured: bool) -> None:
    """What `start` refuses of --shards/--sites/--shard-credentials, before anything runs."""
    from broker_server.core.stages import check_mergeable

    if not sharding.active:
        if sharding.credentials is not None:
            raise ConfigError("--shard-credentials is for --shards N")
        return
    check_mergeable(cfg, policy)  # NotMergeable (a ConfigError's sibling): the reason, before anything runs
    if sharding.credentials is not None and not external_broker:
        raise ConfigError(
            "--shard-credentials is for --broker: the broker `start` spawns gets its shards' "
            "credentials generated (STATE_DIR/security/shards/)"
        )
    if external_broker and sharding.spawn and secured and sharding.credentials is None:
        raise ConfigError(
            "--shards N with --broker: pass --shard-credentials DIR (protofl-server broker-config "
            "--shards N writes DIR/shards/shard-I.json), or --no-spawn-shards and run "
            "`protofl-server shard` yourself"
        )


def spawn_shards(
    sharding: Sharding,
    stack: contextlib.ExitStack,
    fed: str,
    broker_url: str,
    state_dir: Path | None,
    auth: Any,
    connect_timeout: float,
) -> Any:
    """Start the shards as children of this server (restarted when they die); None unless asked to."""
    from broker_server.scaleout.shard_service import ShardProcesses, child_env, shard_command

    if not sharding.shards or not sharding.spawn:
        return None
    root = (
        state_dir / "shards"
        if state_dir is not None
        else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="protofl-shards-")))
    )

    def credentials(i: int) -> Path | None:
        if auth is not None:
            return Path(auth.shard_file(i))
        return sharding.credentials / f"shard-{i}.json" if sharding.credentials is not None else None

    commands = [
        shard_command(fed, broker_url, i, root / f"shard-{i}", credentials(i), connect_timeout, sharding.timeout)
        for i in range(sharding.shards)
    ]
    procs = ShardProcesses(commands, root, env=child_env()).start()
    stack.callback(procs.stop)
    log.info(
        "%d aggregator shard(s) running (pids %s; logs in %s)", sharding.shards, " ".join(map(str, procs.pids())), root
    )
    return procs


@dataclass(frozen=True)
class ClientAuth:
    """How the server authenticates to a broker it joins (--broker): --username/--password, --tls-* files (a broker
    of its own it reaches through that broker's unix socket, as the user `start` generated)."""

    username: str | None = None
    password: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None


@dataclass(frozen=True)
class Watching:
    """Where the server shows itself: the Prometheus endpoint and the live page (None: not served)."""

    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    ui_host: str = "127.0.0.1"
    ui_port: int | None = None
    ui_password: str | None = None

    def serve(
        self, stack: contextlib.ExitStack, state_dir: Path | None, logs_dir: Path | None = None
    ) -> tuple[Any, Any]:
        """Start the HTTP servers asked for (before the broker: a taken port fails the start at once); returns
        the board they read and the metrics the service observes (None without --metrics-port). The page shows
        the device logs kept in `logs_dir`."""
        from broker_server.watch.board import SnapshotBoard

        board, metrics = SnapshotBoard(), None
        if self.metrics_port is not None:
            from broker_server.watch.metrics import FederationMetrics, serve_metrics

            metrics = FederationMetrics(board)
            endpoint = serve_metrics(metrics, self.metrics_host, self.metrics_port)
            stack.callback(endpoint.close)
            log.info("Prometheus metrics on %s", endpoint.url)
        if self.ui_port is not None:
            from broker_server.watch.ui import serve_ui, ui_password

            loopback = is_loopback(self.ui_host)
            password = ui_password(
                self.ui_password, self.ui_host, loopback, state_dir / "security" if state_dir is not None else None
            )
            endpoint = serve_ui(board, self.ui_host, self.ui_port, password, logs_dir)
            stack.callback(endpoint.close)
            log.info(
                "live page on %s%s", endpoint.url, "" if password is None else " (user protofl, password required)"
            )
            if not loopback:
                log.warning(
                    "the live page on %s speaks plain HTTP: its password crosses the network in clear; put "
                    "it behind a TLS proxy or an SSH tunnel beyond a trusted network (SECURITY.md)",
                    self.ui_host,
                )
        return board, metrics


@dataclass(frozen=True)
class Access:
    """Who may reach the local broker and the federation: where it listens, credentials, allowed ids, TLS."""

    listen: str
    insecure: bool = False
    allow: list[str] | None = None
    devices: int | None = None
    max_clients: int | None = None
    tls: Any = None  # broker.ListenerTls from --broker-cert/--broker-key, or None
    tls_mode: str = "auto"  # --tls: the generated federation CA (broker_server/ops/pki.py) when tls is None
    client_ca: str | None = None  # --client-ca: devices must present a certificate it signed
    shards: int = 0  # aggregator shards, each with credentials of its own

    def check(self, external_broker: bool = False) -> None:
        if self.tls_mode not in TLS_MODES:
            raise ConfigError(f"--tls must be auto, on or off, got '{self.tls_mode}'")
        if external_broker and self.tls_mode != "auto":
            raise ConfigError("--tls applies to the local broker; with --broker, use mqtts:// and --tls-ca")
        if self.insecure and (self.tls_mode == "on" or self.client_ca) and self.tls is None:
            raise ConfigError(
                "--tls on (or --client-ca) hands devices the federation CA in their credentials files, "
                "which --insecure does not write; drop --insecure, or serve your own certificate "
                "(--broker-cert/--broker-key/--tls-ca)"
            )

    def generated_tls(self, host: str) -> bool:
        """Whether the local broker serves TLS with the federation's generated CA: by default when it
        listens beyond loopback, or requires client certificates; never with files of the operator's own,
        nor without credentials files."""
        if self.tls is not None or self.insecure or self.tls_mode == "off":
            return False
        return self.tls_mode == "on" or self.client_ca is not None or not is_loopback(host)

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


def listener_tls(
    cert: str | None, key: str | None, client_ca: str | None, tls_ca: str | None, mode: str = "auto"
) -> Any:
    """The local broker's TLS listener from the operator's own files, or None (then `Access` decides on
    the generated CA). The server's own connection uses the broker's unix socket, so it needs no client
    certificate even where --client-ca requires one of every device."""
    from broker_server.ops.broker import ListenerTls

    for flag, path in (("--broker-cert", cert), ("--broker-key", key), ("--client-ca", client_ca)):
        if path and not Path(path).is_file():
            raise ConfigError(f"{flag} {path}: no such file")
    if mode == "off" and (cert or key or client_ca):
        raise ConfigError("--tls off contradicts --broker-cert/--broker-key/--client-ca")
    if not (cert or key):
        return None
    if not (cert and key):
        raise ConfigError("TLS on the local broker needs both --broker-cert and --broker-key")
    if not tls_ca:
        raise ConfigError("--broker-cert needs --tls-ca, the CA that signed it (devices need the same file)")
    return ListenerTls(certfile=cert, keyfile=key, cafile=client_ca or tls_ca, require_client_cert=bool(client_ca))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _local_broker(
    stack: contextlib.ExitStack,
    cfg: Any,
    fed: str,
    state_dir: Path | None,
    access: Access,
    local_broker: str,
    queue: int,
    packet: int | None = None,
) -> tuple[str, MqttVersion, Any]:
    """Start the local broker, secured unless --insecure; returns (the server's URL, protocol, BrokerAuth or
    None). Its packet limit is `cfg`'s largest message, or `packet` bytes (a fleet's, whose runs differ). The
    server's URL is the broker's unix socket (mosquitto), which no other process can stand in for. Nothing is
    written before the port is known to be free, and the devices' credentials files only once the broker listens."""
    from broker_server.ops.broker import MosquittoBroker
    from broker_server.ops.security import prepare

    host, port = access.host_port()
    _check_port(host, port)
    sec_dir = None if access.insecure else _security_dir(stack, state_dir)
    auth = prepare(sec_dir, fed, access.device_ids(cfg), access.shards) if sec_dir is not None else None
    tls, ca_pem = _broker_tls(access, sec_dir, fed, host)
    _warn_exposure(access, host, tls)
    local = _start_broker(stack, cfg, state_dir, access, local_broker, auth, tls, queue, packet)
    if auth is not None:
        auth.provision(ca_pem, broker=_reached_at(local, host))
        _announce_credentials(auth, persistent=state_dir is not None)
    _announce_join(local, fed, host, auth, ca_pem)
    if isinstance(local, MosquittoBroker) and local.socket_path is not None:
        return local.unix_url, local.protocol, auth
    # Clients connect over loopback when the broker listens on every interface.
    url = local.url.replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//[::1]:")
    return url, local.protocol, auth


def _check_port(host: str, port: int) -> None:
    from broker_server.ops.broker import PortInUse, check_port_free

    try:
        if port:
            check_port_free(host, port)
    except PortInUse as exc:
        raise ConfigError(f"{exc} (to serve on any free port: --port 0)") from None


def _security_dir(stack: contextlib.ExitStack, state_dir: Path | None) -> Path:
    if state_dir is not None:
        return state_dir / "security"
    return Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="protofl-security-")))


def _broker_tls(access: Access, sec_dir: Path | None, fed: str, host: str) -> tuple[Any, str | None]:
    """(the broker's TLS listener or None, the generated CA's certificate for the devices' files or None)."""
    if not access.generated_tls(host):
        return access.tls, None
    from broker_server.ops.pki import broker_names, ensure_federation_tls

    assert sec_dir is not None  # generated_tls is never true with --insecure
    fed_tls = ensure_federation_tls(sec_dir / "tls", fed, broker_names(host))
    return fed_tls.listener(access.client_ca), fed_tls.ca_pem()


def _warn_exposure(access: Access, host: str, tls: Any) -> None:
    if access.insecure:
        where = "on loopback only" if is_loopback(host) else f"on {host}, reachable from other machines"
        log.warning("--insecure: the broker accepts anyone %s: they can read every upload and publish rounds", where)
    if not is_loopback(host) and tls is None:
        log.warning(
            "listening on %s without TLS (--tls off or --insecure): passwords and uploads cross the network "
            "in clear, and a process that takes the broker's port while it is down gets them (SECURITY.md)",
            host,
        )


def _start_broker(
    stack: contextlib.ExitStack,
    cfg: Any,
    state_dir: Path | None,
    access: Access,
    local_broker: str,
    auth: Any,
    tls: Any,
    queue: int,
    packet: int | None = None,
) -> Any:
    from broker_server.core.shell import decoder_limits
    from broker_server.ops.broker import PACKET_HEADROOM, MosquittoBroker, PortInUse, start_local_broker
    from broker_server.ops.supervisor import BrokerSupervisor

    host, port = access.host_port()
    # The broker refuses what the aggregator's decoder would refuse anyway (plus the packet's header).
    packet = packet or decoder_limits(cfg).max_message_bytes + PACKET_HEADROOM
    try:
        local = start_local_broker(
            local_broker,  # type: ignore[arg-type]
            port=port,
            host=host,
            workdir=state_dir / "broker" if state_dir else None,
            max_packet_size=packet,
            auth_lines=auth.mosquitto_lines() if auth else (),
            allow_amqtt=access.insecure,
            tls=tls,
            die_with_parent=True,
            local_socket=True,
            max_queued_messages=queue,
        )
    except PortInUse as exc:
        raise ConfigError(f"{exc} (to serve on any free port: --port 0)") from None
    stack.callback(getattr(local, "cleanup", local.stop))
    if isinstance(local, MosquittoBroker):
        # Restarted if it dies; the ExitStack stops the supervisor before it stops the broker.
        stack.callback(BrokerSupervisor(local).start().stop)
    return local


def _reached_at(local: Any, host: str) -> str:
    """The local broker's address as devices and watchers reach it (not the server's own unix socket)."""
    import socket

    shown = socket.gethostname() if host in ("0.0.0.0", "::") else host
    return f"{local.url.split('://')[0]}://{f'[{shown}]' if ':' in shown else shown}:{local.port}"


def _announce_join(local: Any, fed: str, host: str, auth: Any, ca_pem: str | None) -> None:
    """How devices join: the broker's address as they reach it (not the server's own unix socket)."""
    url = _reached_at(local, host)
    if ca_pem is not None:
        how = "--credentials devices/ID.json (TLS: the file carries the federation CA that verifies the broker)"
    elif auth is not None:
        how = "--credentials devices/ID.json" + (" --tls-ca CA" if url.startswith("mqtts://") else "")
    else:
        how = "--client-id ID"
    log.info("devices join with: protofl-edge join --broker %s --fed %s %s --data PATH", url, fed, how)


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
        log.info(
            "credentials in %s (new devices: %s): give each device its devices/<id>.json and run "
            "protofl-edge join --credentials FILE; watchers: protofl-server status --credentials %s",
            auth.directory,
            new,
            auth.monitor_file,
        )
        return
    lines = "\n".join(f"  {i} {auth.secrets.devices[i]}" for i in sorted(auth.secrets.devices))
    monitor = auth.secrets.monitor
    log.warning(
        "no --state-dir: credentials for this run only (shown once; protofl-edge join --username ID "
        "--password PASSWORD, or --credentials with the files in %s):\n%s\nthe read-only monitor "
        "(protofl-server status --broker URL --username %s --password PASSWORD): %s",
        auth.directory / "devices",
        lines,
        monitor.username,
        monitor.password,
    )


@dataclass(frozen=True)
class Start:
    """Everything `start` runs with, built once from its options: the service's groups (settings.py), and what
    only `start` does (its endpoints for watchers, the local broker and who reaches it, the broker it joins)."""

    federation: Federation
    durability: Durability
    admission: Admission
    sharding: Sharding
    watching: Watching
    access: Access
    client: ClientAuth
    broker: str | None = None  # --broker: join this one; None: run a local one (`local_broker`)
    local_broker: str = "auto"
    queue: int = DEFAULT_QUEUE  # messages the broker holds for the server (capacity.py)
    connect_timeout: float = CONNECT_TIMEOUT_S
    fleet_run: str | None = None  # run NAME of a fleet (broker_server/fleet/fleet.py): said on the fleet topic
    revoked_file: Path | None = None  # a fleet's revoked devices (broker_server/ops/enrol.py), watched while serving
    device_logs: Path | None = (
        None  # where devices' log lines go (broker_server/ops/device_logs.py; default in state dir)
    )
    fleet_ledger: Path | None = None  # a fleet's privacy ledger (broker_server/ops/privacy_ledger.py), with fleet_run
    unserved_timeout: float = UNSERVED_TIMEOUT_S  # a fleet's run no device can serve fails after this (`Unserved`)
    backbone: Backbone | None = None  # the shared backbone's training, run once the broker is up (`_federation`)


def _watch_revoked(service: Any, fed: str, path: Path | None, unserved: Unserved | None = None) -> Any:
    """`service.run`'s `until`: on the service's thread, each device revoked meanwhile is said to the aggregator as
    its "revoked" presence (broker_server/ops/enrol.py); it returns when the federation is done, as `run` would, or
    when `unserved` says that no device can serve this fleet run."""
    from broker_server.ops.enrol import Revocations, revoked_presence
    from protofl import topics

    watch = Revocations(path) if path is not None else None

    def until() -> bool:
        for client_id in watch.poll() if watch is not None else ():
            log.warning("device %s revoked: it leaves the federation", client_id)
            service.aggregator.on_presence(topics.presence(fed, client_id), revoked_presence(fed, client_id))
        if unserved is not None and unserved.check(service.aggregator, watch.seen if watch is not None else set()):
            return True
        return bool(service.finished and not service.round_log.pending)

    return until


class Unserved:
    """A fleet's run that no device can serve (a model package, a technique the devices lack): each device says why
    on its presence (the aggregator counts it in `refusals`) and none joins. The run fails, instead of waiting for
    ever and holding the fleet's queue, once every enrolled device (not revoked) has said so, or `timeout` seconds
    after the first said so while none has joined; `why` then says so, with each device's reason."""

    def __init__(
        self, timeout: float, enrolled: Callable[[], list[str]], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.timeout, self.enrolled, self.clock = timeout, enrolled, clock
        self.first: float | None = None  # when the first refusal was seen
        self.why = ""

    def check(self, agg: Any, revoked: set[str]) -> bool:
        refusals: dict[str, tuple[int, str]] = agg.refusals
        if agg.clients or not refusals:
            self.first = None
            return False
        now = self.clock()
        if self.first is None:
            self.first = now
        members = set(self.enrolled()) - revoked
        everyone = bool(members) and members <= set(refusals)
        if not everyone and now - self.first < self.timeout:
            return False
        reasons = "; ".join(f"{who}: {why}" for who, (_, why) in sorted(refusals.items()))
        who = "every enrolled device said why" if everyone else f"none joined {self.timeout:g} s after one said why"
        self.why = f"no device can serve it: {who} ({reasons})"
        return True


def _fleet_members(s: Start) -> Callable[[], list[str]]:
    """The devices enrolled in the fleet this run is of, now (read from its credentials: `devices add` changes them
    while a run serves)."""
    from broker_server.ops.enrol import enrolled

    fleet = s.revoked_file.parent.parent if s.revoked_file is not None else None  # FLEET/security/revoked
    return lambda: enrolled(fleet) if fleet is not None else []


def _write_why(state_dir: Path, why: str) -> None:
    """Why this fleet run failed, in its state dir (broker_server/fleet/runs.py: `run list` shows it)."""
    from broker_server.ops.fleet_run import WHY

    tmp = state_dir / (WHY + ".tmp")
    tmp.write_text(why.replace("\n", " ") + "\n")
    os.replace(tmp, state_dir / WHY)


def _fleet_view(s: Start) -> FleetView | None:
    """A fleet run's view of the fleet's privacy ledger, for its watchers (None outside a fleet)."""
    from broker_server.ops.privacy_ledger import FleetView

    if s.fleet_ledger is None or s.fleet_run is None:
        return None
    return FleetView.read(s.fleet_ledger, s.fleet_run)


def _spend_writer(s: Start, state_dir: Path | None, dp: DpSettings | None) -> Callable[[Any, bool], None]:
    """`write(service, final)`: a fleet run's spend so far in its state dir's spend.json, which the fleet records in
    its privacy ledger when the run's server exits (broker_server/ops/privacy_ledger.py); nothing outside a fleet."""
    from broker_server.ops.privacy_ledger import run_spend, write_spend

    run = s.fleet_run

    def write(service: Any, final: bool) -> None:
        if run is None or s.fleet_ledger is None or state_dir is None:
            return
        m = service.aggregator.machine
        write_spend(state_dir, run_spend(run, dp, m.state.accepted, len(m.records), final))

    return write


def _serve(s: Start) -> None:
    from broker_server.core.artifacts import write_server_artifacts
    from broker_server.core.progress import accuracies
    from broker_server.ops.security import private_dir, private_file
    from broker_server.ops.supervisor import broker_restarts, stop_all_supervisors
    from broker_server.service import ROUNDS_LOG, AggregatorService, save_server_model, server_transport
    from protofl.transport.broker_url import parse_broker_url

    cfg, fed, state_dir, access = s.federation.cfg, s.federation.fed, s.durability.state_dir, s.access
    if state_dir is not None:
        private_dir(state_dir)  # 0700: status.json, rounds.jsonl, the journal name devices
    with contextlib.ExitStack() as stack:
        logs_dir = s.device_logs or (state_dir / LOG_DIR if state_dir is not None else None)
        board, metrics = s.watching.serve(stack, state_dir, logs_dir)
        protocol: MqttVersion = "auto"
        members = access.allow
        broker, username, password = s.broker, s.client.username, s.client.password
        broker_is_ours = broker is None
        auth = None
        if broker is None:
            broker, protocol, auth = _local_broker(stack, cfg, fed, state_dir, access, s.local_broker, s.queue)
            if auth is not None:
                username, password = auth.secrets.server.username, auth.secrets.server.password
                members = sorted(auth.secrets.devices) if members is None else members
        elif username is None:
            log.warning(
                "joining %s without credentials: unless that broker enforces an ACL (protofl-server "
                "broker-config writes one), anyone on it can read uploads and publish rounds",
                broker,
            )
        if s.backbone is not None:  # the broker and the credentials first: then minutes of training, with progress
            public, scored = s.backbone()
            s = replace(s, federation=replace(s.federation, public=public, validation=scored), backbone=None)
        # A broker of our own: its unix socket, no TLS files there, and no other process can stand in for it.
        options = parse_broker_url(broker).with_auth(
            username, password, s.client.tls_ca, s.client.tls_cert, s.client.tls_key
        )
        link = Broker(options, protocol, connect_timeout=s.connect_timeout, queue=s.queue)
        rounds_file = None
        logged = 0  # the last round rounds.jsonl holds: a restarted server that closes it again adds no line
        if state_dir is not None:
            logged = last_logged_round(state_dir / ROUNDS_LOG)
            rounds_file = stack.enter_context(open(private_file(state_dir / ROUNDS_LOG), "a"))

        live: list[Any] = []  # the service, once built: a journal replay closes rounds before it exists

        dp = privacy.resolve(cfg, cfg.draft)  # differential privacy: each round's line says the epsilon spent
        spend = _spend_writer(s, state_dir, dp)

        def on_round_end(rec: Any) -> None:
            if live:
                spend(live[0], False)
            if state_dir is not None and live:  # what a device could be given now (docs/design.md section 9)
                write_server_artifacts(
                    live[0].aggregator.model,
                    state_dir / "artifacts",
                    fed=fed,
                    round_=rec.round,
                    finished=rec.round >= cfg.rounds or live[0].aggregator.finished,  # (or its DP budget spent)
                    backbone=_backbone_of(live[0].aggregator),
                    norm=s.federation.norm,
                )

        def on_round_logged(rec: Any, accs: dict[str, float | None], reported: int) -> None:
            """A round's line once its metrics are in (or their grace passed): bytes, clients, accuracies and how
            many clients' metrics they are over."""
            nonlocal logged
            if rounds_file is not None and rec.round > logged:
                rounds_file.write(
                    json.dumps(
                        {
                            "fed": fed,
                            "preset": cfg.preset,
                            **asdict(rec),
                            **accs,
                            "metrics_from": reported,
                            **({"epsilon": dp.spent(rec.round)} if dp is not None else {}),
                        }
                    )
                    + "\n"
                )
                rounds_file.flush()
                logged = rec.round

        pacing = Pacing(resend_window=resend_window(s.queue, uploads_per_phase(cfg)))
        hooks = Hooks(on_round_end=on_round_end, on_round_logged=on_round_logged)
        watchers = Watchers(board, metrics, broker_restarts if broker_is_ours else None, _fleet_view(s))
        transport = server_transport(link, fed, durable=s.durability.enabled)
        service = AggregatorService(
            s.federation,
            transport,
            admission=replace(s.admission, members=members),
            durability=s.durability,
            sharding=s.sharding,
            pacing=pacing,
            watchers=watchers,
            hooks=hooks,
        )
        live.append(service)
        spend(service, False)  # before it serves: what its journal says it spent (nothing for a new run)
        spawn_shards(s.sharding, stack, fed, broker, state_dir, auth if broker_is_ours else None, s.connect_timeout)

        def on_signal(signum: int, frame: FrameType | None) -> None:
            log_from_handler(log, logging.INFO, "stopping (signal %d)", signum)
            stop_all_supervisors()  # our broker may have had the signal too: that is no crash to restart after
            service.stop()

        # Before the service says it serves: a signal from then on is a clean stop.
        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        started = False
        try:
            service.start(link.connect_timeout)
            started = True
            if logs_dir is not None:
                DeviceLogs(logs_dir, fed).subscribe(service.transport)
            # A round that closed before a crash but was not logged yet (its metrics were awaited) gets its line
            # now, without the accuracies that died with the process; rounds closed again by the replay wait for
            # theirs as usual.
            waiting = {rec.round for rec in service.round_log.pending}
            for rec in service.aggregator.records:
                if rec.round not in waiting:
                    on_round_logged(rec, accuracies([]), 0)
            if service.resumed and service.finished:
                log.warning(
                    "federation '%s' in %s finished already (%d rounds); writing its model again. For a "
                    "new federation use another --state-dir",
                    fed,
                    state_dir,
                    len(service.aggregator.records),
                )
            if not broker_is_ours:  # for our own broker, _local_broker said how devices reach it
                log.info(
                    "devices join with: protofl-edge join --broker %s --fed %s --client-id ID --data PATH",
                    options.url,
                    fed,
                )
            if s.fleet_run is not None:
                from broker_server.ops.fleet_run import announce_run, end_run

                announce_run(service.transport, fed, s.fleet_run)
            unserved = Unserved(s.unserved_timeout, _fleet_members(s)) if s.fleet_run is not None else None
            watching_fleet = s.revoked_file is not None or unserved is not None
            service.run(until=_watch_revoked(service, fed, s.revoked_file, unserved) if watching_fleet else None)
            if unserved is not None and unserved.why:
                log.error("run '%s' failed: %s", s.fleet_run, unserved.why)
                if state_dir is not None:
                    _write_why(state_dir, unserved.why)
                end_run(service.transport, fed, "failed: no device can serve it")
                raise ConfigError(f"run '{s.fleet_run}' failed: {unserved.why}")
            if s.fleet_run is not None and (service.finished or stop_requested(state_dir)):
                end_run(service.transport, fed)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            service.close()
            spend(service, True)
            if state_dir is not None and started:
                path = save_server_model(service.aggregator.model, state_dir / "server_model.npz")
                write_server_artifacts(
                    service.aggregator.model,
                    state_dir / "artifacts",
                    fed=fed,
                    round_=len(service.aggregator.records),
                    finished=service.aggregator.finished,
                    backbone=_backbone_of(service.aggregator),
                    norm=s.federation.norm,
                )
                log.info("server model written to %s (deployable artifacts in %s)", path, state_dir / "artifacts")
        agg = service.aggregator
        if agg.finished:
            log.info(
                "federation '%s' finished: %d rounds, dropped uploads %s, clipped rows %s",
                fed,
                len(agg.records),
                agg.dropped or "none",
                agg.model.clipped or "none",
            )
            if dp is not None:
                log.info("%s", privacy.describe(privacy.ledger(dp, len(agg.records))))
            if agg.machine.state.stopped:
                log.warning("federation '%s' stopped early: %s", fed, agg.machine.state.stopped)

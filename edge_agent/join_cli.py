"""`protofl-edge join`: run this device in a federation until it finishes.

Its exit status says how it ended (docs/how-to/fleet.md, "Exit codes"): 0 the federation finished; 1 it left before
(a signal, `--timeout`); 2 an error it cannot get past (bad options or data, no broker within --connect-timeout, a
federation it cannot join); 3 (EXIT_OVER_MEMORY, edge_agent/core/memory.py) it outgrew its profile's memory;
4 (EXIT_REVOKED) the fleet revoked it: the broker refuses its credentials; 130 a second Ctrl-C.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import typer

from edge_agent.api import make_lite_runner, make_runner, resolve_identity
from edge_agent.ops.log_ship import LEVELS, LogShipper
from protofl import cli_options
from protofl.errors import ConfigError, ProtoFLError, RevokedError
from protofl.requirements import torch_available
from protofl.signals import log_from_handler

if TYPE_CHECKING:
    from edge_agent.core.emulation import Emulation


def _emulation(
    profile: str, adaptive: bool, share: float, time_scale: float, emulate_compute: bool, sample_cost: float = 0.0
) -> Emulation | None:
    """--profile and its switches, checked before torch is imported (a bad profile exits 2 at once)."""
    from edge_agent.core.emulation import Emulation
    from protofl.profiles import parse_pair

    if not time_scale > 0:
        raise ConfigError(f"--time-scale must be > 0, got {time_scale}")
    if not 0 < share <= 1:
        raise ConfigError(f"--upload-share must be in (0, 1], got {share}")
    if not sample_cost >= 0:
        raise ConfigError(f"--sample-cost must be >= 0 seconds per sample, got {sample_cost}")
    if sample_cost and not emulate_compute:
        raise ConfigError("--sample-cost times the emulated compute: add --emulate-compute")
    if not profile:
        if emulate_compute:
            raise ConfigError("--emulate-compute needs a device profile (--profile rpi4 or rpi4+lte)")
        return None
    device, link = parse_pair(profile)
    if emulate_compute and device is None:
        raise ConfigError(f"--emulate-compute needs a device profile; '{profile}' names only a link")
    return Emulation(
        device=device,
        link=link,
        time_scale=time_scale,
        emulate_compute=emulate_compute,
        adaptive=adaptive and link is not None,
        upload_share=share,
        sample_cost_s=sample_cost,
    )


# `join --help` groups the options by what they configure (the broker connection's group is shared with `start`).
BROKER = cli_options.BROKER_PANEL
EXIT_REVOKED = 4  # join's exit status when the fleet revoked this device (a service must not restart it)
DEVICE, DATA, MODEL, EMULATION, STATE, LOGGING = (
    "This device",
    "Data",
    "Model and training",
    "Emulation",
    "State and artifacts",
    "Logging",
)


def join_command(
    broker: str = typer.Option(
        "mqtt://127.0.0.1:1883", help="Broker URL: mqtt://host[:port] or mqtts://host[:port].", rich_help_panel=BROKER
    ),
    fed: str | None = typer.Option(
        None,
        help="Federation name (the server's --fed; default: the one in --credentials, else 'default').",
        rich_help_panel=DEVICE,
    ),
    client_id: str | None = typer.Option(
        None,
        "--client-id",
        help="This device's id (letters, digits, _ . -); default: the user name of --credentials.",
        rich_help_panel=DEVICE,
    ),
    data: str = typer.Option(
        ...,
        help="fashion-mnist | synthetic[:n=..] | npz:PATH | idx:DIR | imagefolder:DIR | "
        "csv:FILE[,label=COL] | package.module:function | an .npz/.csv file or "
        "a directory; shaped to the federation's classes and in_shape.",
        rich_help_panel=DATA,
    ),
    data_dir: str | None = typer.Option(
        None, "--data-dir", help="Where fashion-mnist's files are.", rich_help_panel=DATA
    ),
    partition: str | None = typer.Option(
        None, help="Take client i's Dirichlet share, i/N (trials with the simulator's split).", rich_help_panel=DATA
    ),
    alpha: float = typer.Option(0.5, help="Dirichlet alpha of --partition.", rich_help_panel=DATA),
    seed: int | None = typer.Option(
        None, help="Seed of --partition and synthetic data (default: the federation's).", rich_help_panel=DATA
    ),
    test_limit: int | None = typer.Option(
        None, help="With --partition: evaluate on the first N test samples.", rich_help_panel=DATA
    ),
    train_limit: int | None = typer.Option(
        None, help="With --partition: the simulator's --train-limit.", rich_help_panel=DATA
    ),
    arch: str | None = typer.Option(
        None,
        help="Backbone: a built-in name (protofl-edge models), "
        "package.module:factory, or an installed protofl.models name "
        "(default: the federation's).",
        rich_help_panel=MODEL,
    ),
    device: str = typer.Option("auto", help="auto | cpu | cuda.", rich_help_panel=MODEL),
    profile: str = typer.Option(
        "",
        help="Device and/or link profile: NAME or FILE, or DEVICE+LINK (rpi4+lte); "
        "names: protofl-edge profiles (a link profile turns on adaptive uploads).",
        rich_help_panel=EMULATION,
    ),
    adaptive: bool = typer.Option(
        True,
        "--adaptive/--no-adaptive",
        help="With a link profile: fit each upload to the link and the round deadline.",
        rich_help_panel=EMULATION,
    ),
    upload_share: float = typer.Option(
        0.8, help="Share of the time left before the deadline an upload may use.", rich_help_panel=EMULATION
    ),
    time_scale: float = typer.Option(
        1.0, help="Simulation only: the link and clocks run this many times faster.", rich_help_panel=EMULATION
    ),
    emulate_compute: bool = typer.Option(
        False,
        "--emulate-compute",
        help="Simulation only: hold uploads back as "
        "long as the device profile's compute factor says training takes there.",
        rich_help_panel=EMULATION,
    ),
    sample_cost: float = typer.Option(
        0.0,
        help="Simulation only, with --emulate-compute: compute from the profile, this many seconds of training per "
        "sample held (divided by the compute factor), not the measured CPU time.",
        rich_help_panel=EMULATION,
    ),
    tag: list[str] = typer.Option(
        [],
        "--tag",
        help="A label for this device (repeatable): a run may select its devices by tag (--set select=tag:NAME).",
        rich_help_panel=DEVICE,
    ),
    eval_every: int = typer.Option(1, help="Report accuracy every N rounds (and in the last).", rich_help_panel=MODEL),
    test_every: int | None = typer.Option(
        None,
        help="With --partition: score the official test set every N rounds "
        "(a multiple of --eval-every) and in the last; "
        "default: the last round only.",
        rich_help_panel=MODEL,
    ),
    threads: int | None = typer.Option(
        None, help="torch CPU threads (default: torch's choice).", rich_help_panel=MODEL
    ),
    extractor: str = typer.Option(
        "torch", help="Prototype extraction and prediction: torch | onnx (onnxruntime).", rich_help_panel=MODEL
    ),
    state_dir: Path | None = typer.Option(
        None,
        "--state-dir",
        help="Keep a local checkpoint here after every "
        "round (model, round state, last uploads): restarted, the device "
        "resumes where it was instead of starting over. Its deployable "
        "artifacts go to DIR/artifacts.",
        rich_help_panel=STATE,
    ),
    artifacts: Path | None = typer.Option(
        None,
        "--artifacts",
        help="Write this device's deployable artifacts "
        "(model, prototypes: protofl-export onnx --from reads them) here, "
        "under devices/<id>/ (default: STATE_DIR/artifacts).",
        rich_help_panel=STATE,
    ),
    username: str | None = cli_options.USERNAME,
    password: str | None = cli_options.PASSWORD,
    credentials: Path | None = typer.Option(
        None,
        help="This device's credentials file (devices/<id>.json, written by protofl-server start or broker-config).",
        rich_help_panel=BROKER,
    ),
    tls_ca: str | None = cli_options.TLS_CA,
    tls_cert: str | None = cli_options.TLS_CERT,
    tls_key: str | None = cli_options.TLS_KEY,
    mqtt: str = typer.Option(
        "auto", "--mqtt", help="MQTT version: auto (5, else 3.1.1) | 5 | 3.1.1.", rich_help_panel=BROKER
    ),
    connect_timeout: float = cli_options.CONNECT_TIMEOUT,
    keepalive: int = typer.Option(
        30,
        help="MQTT keepalive (s): on a slow link, longer than its longest transfer "
        "(paho counts a message as activity only once it is complete).",
        rich_help_panel=BROKER,
    ),
    ship_logs: str = typer.Option(
        "warning",
        "--ship-logs",
        help="Send this device's log lines at this level or above to the server (protofl-server logs ID), at most "
        "60 a minute: debug | info | warning | error | off (info: a line or two a round, more bytes on a slow link).",
        rich_help_panel=LOGGING,
    ),
    lite: bool = typer.Option(
        False,
        "--lite",
        help="Join as a lite device: no training, the shared backbone's forward passes in onnxruntime (what a "
        "device without torch does anyway: pip install 'protofl-edge[lite]'). Serves presets with the ridge "
        "predictor (the default protofl preset); others refuse it.",
        rich_help_panel=MODEL,
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging.", rich_help_panel=LOGGING),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Warnings and errors only.", rich_help_panel=LOGGING),
) -> None:
    """Join a federation: train locally each round and upload prototypes / adapters; survives drops. Exits 0 when
    the federation finished, 1 when it left before, 2 on an error, 3 over its profile's memory, 4 revoked."""
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        client_id, username, password, fed = resolve_identity(client_id, username, password, credentials, fed)
        emulation = _emulation(profile, adaptive, upload_share, time_scale, emulate_compute, sample_cost)
        if ship_logs not in (*LEVELS, "off"):
            raise ConfigError(f"--ship-logs must be one of {', '.join(LEVELS)} or off, got '{ship_logs}'")
        if not 1 <= keepalive <= 65535:
            raise ConfigError(f"--keepalive must be in 1..65535 s, got {keepalive}")
        if lite or not torch_available():
            runner = _lite_runner(
                broker, fed, client_id, data, data_dir, partition, alpha, seed, test_limit, train_limit, profile,
                threads, username, password, tls_ca, tls_cert, tls_key, mqtt, connect_timeout, keepalive,
                credentials, lite=lite, arch=arch, state_dir=state_dir, artifacts=artifacts,
                emulate=emulation is not None and (emulation.emulate_compute or emulation.link is not None),
                extractor=extractor,
            )  # fmt: skip
        else:
            runner = make_runner(
                broker,
                fed,
                client_id,
                data,
                data_dir,
                partition,
                alpha,
                seed,
                test_limit,
                train_limit,
                arch,
                device,
                profile,
                eval_every,
                threads,
                username,
                password,
                tls_ca,
                tls_cert,
                tls_key,
                mqtt,
                connect_timeout,
                extractor,
                emulation,
                keepalive,
                test_every,
                state_dir,
                credentials,
                artifacts,
                tags=tag,
            )
    except ProtoFLError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if runner.stopping:
            raise KeyboardInterrupt  # second signal: do not wait for the current training step
        log_from_handler(
            logging.getLogger("protofl.edge"), logging.WARNING, "%s: leaving (signal %d)", runner.client_id, signum
        )
        runner.stop()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    shipper = (
        None if ship_logs == "off" else LogShipper(runner.transport, runner.fed, runner.client_id, LEVELS[ship_logs])
    )
    if shipper is not None:
        logging.getLogger("protofl").addHandler(shipper)
    try:
        agent = runner.run()
    except RevokedError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_REVOKED) from None
    except ProtoFLError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if shipper is not None:
            logging.getLogger("protofl").removeHandler(shipper)
    if agent is None or not agent.finished:
        raise typer.Exit(1)  # left before the federation finished


def _lite_runner(*args: Any, lite: bool, arch: str | None, state_dir: Path | None, artifacts: Path | None,
                 emulate: bool, extractor: str) -> Any:  # fmt: skip
    """`join` on a lite device (edge_agent/ops/lite.py): the options that need torch are refused, saying so."""
    why = "" if lite else "torch is not installed here, so this device joins as a lite device (--lite); "
    for given, option in (
        (arch is not None, "--arch"),
        (state_dir is not None, "--state-dir"),
        (artifacts is not None, "--artifacts"),
        (emulate, "--emulate-compute and a link --profile"),
        (extractor != "torch", "--extractor"),
    ):
        if given:
            raise ConfigError(
                f"{why}{option} is for a device that trains (torch): leave it out, or pip install "
                f"'protofl-edge[device]'"
            )
    if not lite:
        logging.getLogger("protofl.edge").info("torch is not installed: joining as a lite device (onnxruntime)")
    return make_lite_runner(*args)

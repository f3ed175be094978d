"""`protofl-server`: the aggregator's command line."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column, Table

from broker_server.cli_common import CLIP_OPTION, parse_clip, parse_sets, print_whole, read_classes
from broker_server.commands.shard_cli import shard_cli
from broker_server.commands.start_cli import start_command
from broker_server.fleet.fleet import fleet_command, logs_command, run_app, service_app
from broker_server.ops.enrol import devices_app
from broker_server.watch.status_cli import status_command
from protofl import cli_options, learning, privacy
from protofl.algorithms.robust import clip_text
from protofl.data.loaders import check_source
from protofl.errors import ConfigError, ProtoFLError
from protofl.humanize import accuracy_label, accuracy_legend, human_bytes, human_duration
from protofl.plan import RoundPlan
from protofl.presets import all_presets, make_config, preset_names
from protofl.schedule import describe_test_cadence

app = typer.Typer(
    help="protofl-edge aggregator: run a federation server or simulate one on this machine.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console(stderr=True)


# The summary table's accuracy columns, in order (the report's keys; older reports lack predictor_acc).
TABLE_ACCURACIES = ("local_acc", "local_proto_acc", "global_acc", "global_proto_acc", "ensemble_acc", "predictor_acc")


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.2f}"


def _summary(report: dict[str, Any]) -> Table:
    sim = report["simulation"]
    title = f"{report['preset']} on {sim['dataset']}"
    if "test_every" in sim:  # older reports do not say; they scored it every --eval-every round
        # The header says which rounds have global, ensemble and predictor figures: by default the last only.
        title += (
            f"\nglobal, ensemble, predictor %: the test set ({sim['test_samples']:,} images) scored in "
            f"{describe_test_cadence(sim['test_every'], report['config'].get('rounds'))} (--test-every N)"
        )
    t = Table(title=title, show_lines=False, caption_justify="left")
    for col in (
        "round",
        *(accuracy_label(k) + " %" for k in TABLE_ACCURACIES),
        "uplink",
        "downlink",
        "clients",
        "clipped",
    ):
        t.add_column(col, justify="right", overflow="fold")  # piped (80 columns): wrapped, never cut with "…"
    for r in report["rounds"]:
        t.add_row(
            str(r["round"]),
            *(_fmt(r.get(k)) for k in TABLE_ACCURACIES),
            human_bytes(r["uplink_bytes"]),
            human_bytes(r["downlink_bytes"]),
            str(r["clients"]),
            _clip_cell(r),
        )
    tot = report["totals"]
    t.caption = (
        f"total uplink {human_bytes(tot['uplink_bytes'])}, downlink {human_bytes(tot['downlink_bytes'])}, "
        f"wall {tot['wall_s']:.1f} s, device {report['simulation']['device']}, "
        f"clipping {report['simulation'].get('clip', 'on')}"
    )
    t.caption += f"\n{accuracy_legend(TABLE_ACCURACIES)}"  # what each accuracy measures: local is not the federation's
    if report.get("privacy"):
        t.caption += "\n" + privacy.describe(report["privacy"])
        if report["privacy"].get("stopped"):
            t.caption += f"\nstopped: {report['privacy']['stopped']}"
    predictor = report.get("predictor") or {}
    if predictor.get("reason"):  # what "predictor %" is, or why it is empty
        t.caption += f"\npredictor: {predictor['reason']}"
    if report.get("learning"):  # protofl/learning.py: flat accuracies
        t.caption += f"\nWARNING: the federation is {report['learning']}; {learning.ADVICE}"
    return t


def _clip_cell(row: dict[str, Any]) -> str:
    """A round's clipped rows of rows checked, per kind ('-' when nothing was checked: clipping off)."""
    return clip_text(row.get("clipped", {}), row.get("clip_checked", {})) or "-"


def _progress_status(row: dict[str, Any]) -> str:
    sim = f"sim {human_duration(row['sim_time_s'])} " if row.get("sim_time_s") is not None else ""
    clipped = f" clipped {_clip_cell(row)}" if row.get("clip_checked") else ""
    return (
        f"{sim}{accuracy_label('local_acc')} {_fmt(row['local_acc'])}% global {_fmt(row['global_acc'])}% "
        f"up {human_bytes(row['uplink_bytes'])}{clipped}"
    )


# `simulate --help` groups the options by what they configure (the federation's, as in `start`).
FEDERATION, BROKER = cli_options.FEDERATION_PANEL, cli_options.BROKER_PANEL
DATA, DEVICES, PROFILES, BACKEND, OUTPUT = "Data", "Devices", "Profiles and links", "Backend", "Output"


@app.command()
def simulate(
    preset: str = typer.Option(
        "protofl", help=f"Method to run: {', '.join(preset_names())}.", rich_help_panel=FEDERATION
    ),
    dataset: str = typer.Option(
        "synthetic",
        help="fashion-mnist | synthetic[:n=..,classes=..] | npz:PATH | idx:DIR | "
        "imagefolder:DIR | csv:FILE[,label=COL] | package.module:function "
        "(--set num_classes=K --set in_shape=C,H,W fix the shape)",
        rich_help_panel=DATA,
    ),
    data_dir: str | None = typer.Option(
        None, "--data-dir", help="Where the dataset's files are (fashion-mnist, idx).", rich_help_panel=DATA
    ),
    classes: Path | None = typer.Option(
        None,
        "--classes",
        help="The federation's class names, one a line (the first is class 0): class folders and a CSV's label "
        "names are matched with them. Default: an image folder's class folders (an npz's class_names), else none.",
        rich_help_panel=DATA,
    ),
    clients: int | None = typer.Option(
        None, help="Number of simulated devices (default 5, or as many as --profiles lists).", rich_help_panel=DATA
    ),
    alpha: float = typer.Option(
        0.5, help="Dirichlet concentration of the label partition (smaller = more skewed).", rich_help_panel=DATA
    ),
    rounds: int = typer.Option(3, help="Communication rounds.", rich_help_panel=FEDERATION),
    seed: int = typer.Option(0, help="Seed for partition, models and training order.", rich_help_panel=FEDERATION),
    arch: str | None = typer.Option(
        None,
        help="Architecture, or a comma list assigned round-robin: built-in "
        "names (cnn,mlp,...), package.module:factory, installed protofl.models names.",
        rich_help_panel=DEVICES,
    ),
    transport: str = typer.Option(
        "inprocess",
        help="inprocess (fast, in one process) | mqtt (a real broker, one agent process per client).",
        rich_help_panel=BACKEND,
    ),
    backend: str = typer.Option(
        "local",
        help="Where the devices run: local (this machine, as --transport says) | "
        "ray (Ray workers; the aggregator stays here; needs "
        "protofl-edge[ray]).",
        rich_help_panel=BACKEND,
    ),
    ray_address: str | None = typer.Option(
        None,
        "--ray-address",
        help="ray: join this cluster (auto, host:port, ray://host:10001); default: start a local Ray instance.",
        rich_help_panel=BACKEND,
    ),
    device_resources: str = typer.Option(
        "cpu=1",
        "--device-resources",
        help="ray: each device's share of a node, cpu=N[,gpu=N] (cpu=1,gpu=0.25: four devices per GPU).",
        rich_help_panel=BACKEND,
    ),
    ray_workers: int | None = typer.Option(
        None,
        "--ray-workers",
        help="ray: at most this many workers (default: as many as the cluster holds at --device-resources).",
        rich_help_panel=BACKEND,
    ),
    ray_max_restarts: int = typer.Option(
        1,
        "--ray-max-restarts",
        help="ray: a worker whose process dies is started "
        "again this often (its devices join again); then its devices are lost.",
        rich_help_panel=BACKEND,
    ),
    broker: str | None = typer.Option(
        None,
        help="mqtt: use this broker (mqtt://host:port or mqtts://...); default: "
        "start a local one (mosquitto if installed, else embedded amqtt).",
        rich_help_panel=BROKER,
    ),
    local_broker: str = typer.Option(
        "auto", help="mqtt: the local broker, auto | mosquitto | amqtt.", rich_help_panel=BROKER
    ),
    username: str | None = typer.Option(None, help="mqtt: MQTT user name.", rich_help_panel=BROKER),
    password: str | None = typer.Option(
        None, envvar="PROTOFL_MQTT_PASSWORD", help="mqtt: MQTT password.", rich_help_panel=BROKER
    ),
    tls_ca: str | None = typer.Option(
        None, "--tls-ca", help="mqtt: CA certificate (PEM) of the broker.", rich_help_panel=BROKER
    ),
    tls_cert: str | None = typer.Option(
        None, "--tls-cert", help="mqtt: client certificate (PEM).", rich_help_panel=BROKER
    ),
    tls_key: str | None = typer.Option(
        None, "--tls-key", help="mqtt: client private key (PEM).", rich_help_panel=BROKER
    ),
    config: Path | None = typer.Option(
        None, help="TOML file of config overrides (a federation table).", rich_help_panel=FEDERATION
    ),
    train_limit: int | None = typer.Option(
        None, help="Train on a seeded random subset of N samples (faster).", rich_help_panel=DATA
    ),
    test_limit: int | None = typer.Option(
        None, help="Evaluate on the first N test samples only (faster).", rich_help_panel=DATA
    ),
    eval_every: int = typer.Option(
        1, help="Clients report accuracy every N rounds (and in the last).", rich_help_panel=FEDERATION
    ),
    test_every: int | None = typer.Option(
        None,
        help="Score global and ensemble accuracy on the test set every N "
        "rounds (a multiple of --eval-every) and in the last; default: "
        "the last round only (the dearest part of evaluation).",
        rich_help_panel=FEDERATION,
    ),
    extractor: str = typer.Option(
        "torch", help="Agents extract prototypes with torch or onnx (onnxruntime).", rich_help_panel=DEVICES
    ),
    device: str = typer.Option(
        "cpu",
        help="Torch device of the agents and of FedAvg's global model: cpu | cuda | "
        "auto (cuda if torch sees one, else cpu).",
        rich_help_panel=DEVICES,
    ),
    profiles: str | None = typer.Option(
        None,
        help="mqtt: a fleet over emulated links, DEVICE+LINK:COUNT,... "
        "(rpi4+lte:4,rpi3+nb-iot:4); names from profiles/ or .toml files.",
        rich_help_panel=PROFILES,
    ),
    time_scale: float = typer.Option(
        1.0,
        help="--profiles: run links, delays, deadlines and compute this many times "
        "faster; reports give simulated (unscaled) time.",
        rich_help_panel=PROFILES,
    ),
    deadline: float | None = typer.Option(
        None, help="Round deadline in simulated seconds (the config's round_timeout).", rich_help_panel=PROFILES
    ),
    adaptive: bool = typer.Option(
        True,
        "--adaptive/--no-adaptive",
        help="--profiles: each device fits its upload to its link and the deadline (precision f4/f2/q8, sparse K).",
        rich_help_panel=PROFILES,
    ),
    upload_share: float = typer.Option(
        0.8, help="--profiles: share of the time left an upload may use.", rich_help_panel=PROFILES
    ),
    sample_cost: float = typer.Option(
        0.0,
        help="--profiles: compute from the profiles, this many seconds of training per sample a device holds "
        "(divided by its compute factor), and links timed from their profiles: simulated times the same "
        "whatever this machine's load (0: measured CPU time and links).",
        rich_help_panel=PROFILES,
    ),
    report_dir: Path | None = typer.Option(
        None,
        "--report-dir",
        help="Also write the report's PNGs and summary.md here (needs matplotlib).",
        rich_help_panel=OUTPUT,
    ),
    json_out: Path | None = typer.Option(
        None, "--json", help="Write the report (per-round accuracy and bytes) here.", rich_help_panel=OUTPUT
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Leave the run's deployable artifacts here: every device's "
        "model and prototypes, the federation's global state (protofl-export onnx "
        "--from DIR/devices/ID or DIR/global).",
        rich_help_panel=OUTPUT,
    ),
    set_: list[str] = typer.Option(
        [],
        "--set",
        help="Override a config field or a technique option: --set lr=0.05, --set TECHNIQUE.OPTION=value (repeatable).",
        rich_help_panel=FEDERATION,
    ),
    clip: str = CLIP_OPTION,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or table.", rich_help_panel=OUTPUT),
    verbose: bool = typer.Option(
        False, "--verbose", "-v", help="Log every round and dropped message.", rich_help_panel=OUTPUT
    ),
) -> None:
    """Simulate a whole federation on this machine and report accuracy and bytes per round."""
    from broker_server.simulation import SimulationSpec, run_simulation
    from protofl.requirements import require_torch

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")
    if not quiet:
        logging.getLogger("protofl.data").setLevel(logging.INFO)  # what own data loading did: loaded, skipped
        logging.getLogger("protofl.models").setLevel(logging.INFO)  # an own backbone's measured feature width
    try:
        check_source(dataset)  # a wrong path or spec fails now, not after torch is imported
        require_torch("protofl-server simulate")  # the simulated devices train with torch
        overrides = parse_sets(set_)
        read_classes(classes, overrides)
        clip_on = parse_clip(clip)
        if deadline is not None:
            overrides["round_timeout"] = deadline
        if clients is None:
            from protofl.profiles import parse_fleet

            clients = sum(c.count for c in parse_fleet(profiles)) if profiles else 5
        broker_options = None
        if broker is not None or username or tls_ca or tls_cert or tls_key:
            from protofl.transport.broker_url import parse_broker_url

            if broker is None:
                raise ConfigError(
                    "--username/--tls-* need --broker (the local broker gets generated credentials "
                    "and speaks plain TCP on loopback)"
                )
            broker_options = parse_broker_url(broker).with_auth(username, password, tls_ca, tls_cert, tls_key)
        spec = SimulationSpec(
            preset=preset,
            dataset=dataset,
            data_dir=data_dir,
            clients=clients,
            alpha=alpha,
            rounds=rounds,
            seed=seed,
            archs=tuple(arch.split(",")) if arch else None,
            transport=transport,
            broker=broker_options,
            broker_kind=local_broker,
            config_file=str(config) if config else None,
            train_limit=train_limit,
            test_limit=test_limit,
            eval_every=eval_every,
            test_every=test_every,
            extractor=extractor,
            device=device,
            overrides=overrides,
            profiles=profiles,
            time_scale=time_scale,
            adaptive=adaptive,
            upload_share=upload_share,
            sample_cost_s=sample_cost,
            clip=clip_on,
            out_dir=str(out.resolve()) if out is not None else None,
            backend=backend,
            ray_address=ray_address,
            device_resources=device_resources,
            ray_workers=ray_workers,
            ray_max_restarts=ray_max_restarts,
        )
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=12),
            MofNCompleteColumn(),
            # the round's figures fold onto a second line where the terminal is narrow, rather than being cut
            TextColumn("{task.fields[status]}", table_column=Column(overflow="fold")),
            TimeElapsedColumn(),
            console=console,
            disable=quiet,
        )
        task = progress.add_task(f"{preset} rounds", total=rounds, status="")

        def on_round(row: dict[str, Any]) -> None:
            progress.update(task, advance=1, status=_progress_status(row))

        try:  # the bar is drawn once the inputs are checked and the data loaded (on_start), not before
            report = run_simulation(spec, on_round=on_round, on_start=progress.start)
            if report["rounds"]:
                # A row is shown once its metrics are in or their grace passed, and late metrics still reach
                # the report: the bar ends on the report's own last row, the figures the table shows.
                progress.update(task, completed=len(report["rounds"]), status=_progress_status(report["rounds"][-1]))
        finally:
            progress.stop()
    except ProtoFLError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=2))
    if report_dir is not None:
        _write_report(report, report_dir)
    if not quiet:
        print_whole(_summary(report))
        if json_out:
            console.print(f"report written to {json_out}")
        if out is not None:
            console.print(f"deployable artifacts in {out} (protofl-export onnx --from {out}/devices/ID)")


def _write_report(run: dict[str, Any], out: Path) -> None:
    from broker_server.commands.report_cli import write_report

    try:
        paths = write_report(run, out)
    except ProtoFLError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None
    console.print(f"report: {', '.join(str(p) for p in paths)}")


@app.command()
def report(
    run_json: Path = typer.Argument(
        ..., help="A run's JSON (simulate --json), or several (one per preset).", exists=False
    ),
    more: list[Path] = typer.Argument(None, help="More runs to compare (e.g. one per preset)."),
    out: Path = typer.Option(..., "--out", help="Directory for the PNGs and summary.md."),
    target: float | None = typer.Option(
        None, help="Target accuracy for time-to-target (0-1; default: 90 % of the best final accuracy among the runs)."
    ),
    metric: str = typer.Option(
        "global",
        help="global (each device on the official test set, every class; a run that never scored it: local) | "
        "local (each device on its own held-out split: its own classes only) | predictor (the global predictor: "
        "a simulation's test set, or a server's --validation data).",
    ),
) -> None:
    """Plots and a markdown summary of simulate runs: accuracy vs simulated time and uplink, timelines."""
    from broker_server.commands.report_cli import load_runs, write_report

    try:
        runs = load_runs([run_json, *(more or [])])
        paths = write_report(runs, out, target=target, metric=metric)
    except ProtoFLError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None
    for p in paths:
        console.print(str(p))


@app.command()
def presets() -> None:
    """List the presets (built in, and brought by installed techniques): the techniques each runs and its values."""
    t = Table(title="presets")
    t.add_column("preset")
    t.add_column("techniques")
    t.add_column("values")
    for name, values in all_presets().items():
        plan = RoundPlan.from_config(make_config(name))
        t.add_row(name, ", ".join(plan.techniques) or "-", ", ".join(f"{k}={v}" for k, v in values.items()))
    Console().print(t)


@app.command("broker-config")
def broker_config(
    out: Path = typer.Option(
        ...,
        help="Directory for credentials.json, passwd, acl and devices/<id>.json "
        "(existing credentials there are kept; new ids are added). With --bridge: "
        "the site broker's directory (mosquitto.conf and its files).",
    ),
    fed: str = typer.Option("default", help="Federation name (the server's --fed)."),
    allow: Path | None = typer.Option(None, help="Device ids, one a line: each gets credentials."),
    devices: int = typer.Option(
        0, help="Without --allow: credentials for device-1..device-N (with --bridge: SITE-device-1..SITE-device-N)."
    ),
    shards: int = typer.Option(
        0,
        help="Credentials (and ACL) for aggregator shards 0..N-1: shards/shard-I.json, for "
        "`protofl-server shard --credentials` on each shard's machine.",
    ),
    broker_queue: int | None = typer.Option(
        None,
        "--broker-queue",
        help="The max_queued_messages line printed: "
        "messages the broker holds for the aggregator beyond those in flight "
        "(default: from the fleet, devices x 10, at least 10000). With --bridge: "
        "what the site broker holds for its bridge while the core is slow or "
        "unreachable (default: from the site's devices, the same way).",
    ),
    bridge: str | None = typer.Option(
        None,
        "--bridge",
        metavar="SITE",
        help="Write a site broker instead: a "
        "Mosquitto for the devices at site SITE (--allow/--devices), bridged to the "
        "core broker (--core), whose credentials in --core-dir gain the bridge's user "
        "and the site's devices.",
    ),
    core: str | None = typer.Option(
        None,
        "--core",
        help="--bridge: the core broker as the site reaches it "
        "(mqtt://HOST:PORT, or mqtts://HOST:PORT when it serves TLS).",
    ),
    core_dir: Path | None = typer.Option(
        None,
        "--core-dir",
        help="--bridge: the core's security directory "
        "(STATE/security of protofl-server start --state-dir STATE, or an earlier "
        "broker-config --out): credentials.json and, with TLS, tls/.",
    ),
    core_ca: Path | None = typer.Option(
        None,
        "--core-ca",
        help="--bridge: the CA that signed the core broker's "
        "certificate, when it is your own (--broker-cert); default: the "
        "federation's generated CA in --core-dir/tls.",
    ),
    listen: str = typer.Option("0.0.0.0:1883", help="--bridge: HOST:PORT the site broker listens on for its devices."),
    tls: str = typer.Option(
        "auto",
        "--tls",
        help="--bridge: TLS on the site's listener with a certificate the "
        "federation CA signs: auto (on beyond loopback) | on | off.",
    ),
    pre_aggregate: bool = typer.Option(
        False,
        "--pre-aggregate",
        help="--bridge: the site folds its devices' uploads "
        "on a pre-aggregator (protofl-server shard --site SITE, credentials in "
        "OUT/site-aggregator.json) and its bridge carries one partial per phase "
        "instead of every upload; the core runs start --sites SITE.",
    ),
) -> None:
    """Write the password file and ACL for a Mosquitto you run yourself, and each device's credentials; with
    --bridge, a site broker's files (run it with: mosquitto -c OUT/mosquitto.conf)."""
    from broker_server.ops.broker import PACKET_HEADROOM, SYS_INTERVAL_S
    from broker_server.ops.capacity import queue_for_fleet
    from broker_server.ops.security import load_or_create, read_allow_list
    from protofl.wire import Limits

    try:
        if bridge is None:
            used = [
                flag
                for flag, value in (
                    ("--core", core),
                    ("--core-dir", core_dir),
                    ("--core-ca", core_ca),
                    ("--pre-aggregate", pre_aggregate or None),
                )
                if value is not None
            ]
            if used:
                raise ConfigError(f"{', '.join(used)} configure a site broker: add --bridge SITE")
        if broker_queue is not None and broker_queue < 1:
            raise ConfigError(f"--broker-queue must be at least 1 message, got {broker_queue}")
        if bridge is not None:
            _site_broker(
                out, fed, allow, devices, bridge, core, core_dir, core_ca, listen, tls, broker_queue, pre_aggregate
            )
            return
        ids = read_allow_list(allow) if allow else [f"device-{i}" for i in range(1, devices + 1)]
        auth = load_or_create(out, fed, ids, shards=shards)
    except ProtoFLError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None
    server = auth.secrets.server
    typer.echo(
        "\n".join(
            [
                "# add to mosquitto.conf (then restart mosquitto, or send it SIGHUP to reload the files):",
                *auth.mosquitto_lines(),
                "# larger packets than the aggregator decodes are refused by the broker (raise it "
                "for FedAvg on big models)",
                f"max_packet_size {Limits().max_message_bytes + PACKET_HEADROOM}",
                "# messages held for the aggregator while it catches up with a round's burst; past "
                "it mosquitto drops them",
                "# after acknowledging them (the server sees $SYS/broker/publish/messages/dropped "
                "and asks for re-sends)",
                f"max_queued_messages {broker_queue or queue_for_fleet(len(auth.secrets.devices), 2)}",
                f"sys_interval {SYS_INTERVAL_S}",
                f"# the server: protofl-server start --broker mqtt://HOST:PORT --fed {fed} --username "
                f"{server.username} "
                f"(password in {auth.directory / 'credentials.json'}, pass it as $PROTOFL_MQTT_PASSWORD)",
                f"# each device: protofl-edge join --broker mqtt://HOST:PORT "
                f"--credentials {auth.directory / 'devices'}/ID.json",
                f"# watchers: protofl-server status --broker mqtt://HOST:PORT --credentials {auth.monitor_file} "
                f"(read-only: the server's status and summary topics)",
                f"# {len(auth.secrets.devices)} device(s), new: {', '.join(auth.new_devices) or 'none'}",
                *(
                    [
                        f"# aggregator shards: protofl-server shard --broker mqtt://HOST:PORT --fed "
                        f"{fed} --index I --credentials "
                        f"{auth.directory / 'shards'}/shard-I.json --state-dir DIR; the server: start ... --shards "
                        f"{len(auth.secrets.shard_passwords)} --no-spawn-shards (the same --shard-timeout on both)"
                    ]
                    if auth.secrets.shard_passwords
                    else []
                ),
            ]
        )
    )


def _site_broker(
    out: Path,
    fed: str,
    allow: Path | None,
    devices: int,
    site: str,
    core: str | None,
    core_dir: Path | None,
    core_ca: Path | None,
    listen: str,
    tls: str,
    queue: int | None,
    pre_aggregate: bool = False,
) -> None:
    """broker-config --bridge: the site broker's files, and what to do with them."""
    from broker_server.commands.start_cli import TLS_MODES, Access, is_loopback
    from broker_server.ops.security import read_allow_list
    from broker_server.scaleout.bridge import write_site_broker

    if core is None or core_dir is None:
        raise ConfigError(
            "--bridge needs --core URL (the core broker as the site reaches it) and --core-dir DIR "
            "(the core's security directory: STATE/security of protofl-server start)"
        )
    if tls not in TLS_MODES:
        raise ConfigError(f"--tls must be auto, on or off, got '{tls}'")
    if core_dir.exists() and not (core_dir / "credentials.json").is_file():
        raise ConfigError(
            f"--core-dir {core_dir} holds no credentials.json: give the core's security directory "
            f"(STATE/security of protofl-server start --state-dir STATE), or a new directory for a "
            f"federation whose server has not started yet"
        )
    host, port = Access(listen).host_port()
    ids = read_allow_list(allow) if allow else [f"{site}-device-{i}" for i in range(1, devices + 1)]
    made = write_site_broker(
        core_dir,
        out,
        fed,
        site,
        core,
        ids,
        (host, port),
        tls=tls == "on" or (tls == "auto" and not is_loopback(host)),
        core_ca=core_ca,
        queue=queue,
        pre_aggregate=pre_aggregate,
    )
    scheme = "mqtts" if made.site_tls else "mqtt"
    shown = "HOST" if host in ("0.0.0.0", "::") else host
    typer.echo(
        "\n".join(
            [
                f"# site broker '{site}' of federation '{fed}' in {made.directory}: run it with",
                f"mosquitto -c {made.broker.config_path}",
                f"# it bridges to {core} as {made.core_auth.secrets.bridge(site).username} "
                f"({'TLS, verified with ' + str(made.directory / 'core-ca.crt') if made.core_tls else 'plain TCP'})",
                f"# the core: its credentials in {core_dir} now hold the bridge and the site's devices; (re)start the "
                f"server (protofl-server start --state-dir ... resumes) so that its broker and membership take them "
                f"(a start with --allow FILE: list the site's devices in FILE too)",
                *(
                    [f"# the core's broker certificate was signed again to name {parse_host(core)}: restart the core"]
                    if made.core_cert_renewed
                    else []
                ),
                f"# each device at the site: protofl-edge join --broker {scheme}://{shown}:{port} "
                f"--credentials {made.directory / 'devices'}/ID.json",
                *(
                    [
                        f"# the site's pre-aggregator, beside the site broker: protofl-server shard "
                        f"--site {site} --fed {fed} "
                        f"--broker {scheme}://{shown}:{port} --credentials {made.aggregator_file} --state-dir DIR",
                        f"# the core's server: protofl-server start ... --sites {site} (with every "
                        f"pre-aggregated site's name)",
                    ]
                    if made.pre_aggregated
                    else []
                ),
                f"# {len(made.devices)} site device(s): "
                f"{', '.join(made.devices[:5])}{' ...' if len(made.devices) > 5 else ''}",
            ]
        )
    )


def parse_host(url: str) -> str:
    from protofl.transport.broker_url import parse_broker_url

    return parse_broker_url(url).host


app.command("start")(start_command)  # the long-running service, in its own module
app.command("status")(status_command)  # watching it: broker_server/watch/
app.command("shard")(shard_cli)  # one aggregator shard of a `start --shards N` federation
app.command("fleet")(fleet_command)  # one long-running server for many runs: broker_server/fleet/fleet.py
app.add_typer(run_app, name="run")  # a fleet's runs: submit, list, stop, logs
app.add_typer(service_app, name="service")  # the fleet as a systemd unit
app.command("logs")(logs_command)  # a device's log lines, kept at the server: broker_server/ops/device_logs.py
app.add_typer(devices_app, name="devices")  # enrol and revoke devices on a running fleet: broker_server/ops/enrol.py


if __name__ == "__main__":
    app()

"""A fleet: one long-running server, its broker, credentials and enrolment, serving many runs one after another.

`protofl-server fleet --state-dir FLEET` starts the fleet's broker once (FLEET/broker, FLEET/security: the
devices' credentials, as `start` writes them) and serves the runs submitted with `protofl-server run submit`
(broker_server/fleet/runs.py), in order. Each run is a `protofl-server start` of its own, a child process that joins
the fleet's broker as the fleet's server user through the broker's unix socket, with its own state dir
FLEET/runs/<name>/ (journal, checkpoint, rounds.jsonl, artifacts: crash exact as a single `start`). The child
dies with the fleet server (PR_SET_PDEATHSIG); a fleet server started again resumes the run it died under.

Devices stay connected between runs: a run's server says its name on the retained `server/fleet` topic
(`announce_run`) and, when it ends, clears its retained config, public set and round and says the fleet is idle
(`end_run`); a device of a fleet then waits for the next run's config instead of leaving (edge_agent/ops/runner.py).

The fleet keeps a privacy ledger (broker_server/ops/privacy_ledger.py): each run's server says what it spent on each
device (FLEET/runs/NAME/spend.json); when the run's server has exited, the fleet records it in
FLEET/privacy-ledger.json. With a budget (`--epsilon-budget`, kept in fleet.json), `run submit` refuses a run
that would take an enrolled device over it, and the fleet checks a queued run again before starting it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import typer

from broker_server.fleet import runs
from broker_server.ops import privacy_ledger
from broker_server.ops.device_logs import LOG_DIR
from broker_server.ops.privacy_ledger import BUDGET_KEY, check_budget_value
from protofl.errors import ConfigError, ProtoFLError
from protofl.names import check_name, printable
from protofl.signals import log_from_handler
from protofl.systemd import USER_HELP
from protofl.transport.broker_url import PASSWORD_ENV

log = logging.getLogger("protofl.fleet")
FLEET_FILE = "fleet.json"
FLEET_PACKET_MB = 64  # the fleet's broker refuses bigger messages (runs differ: no one config sizes it)
POLL_S = 1.0  # how often an idle fleet looks for a submitted run, and a running one for a stop request


def _fleet_file(state_dir: Path, fed: str, listen: str, epsilon_budget: float | None = None) -> dict[str, Any]:
    """The fleet's settings, kept from its first start: the federation name cannot change under its devices. The
    privacy budget is kept from the start that set it; a later --epsilon-budget changes it."""
    path = state_dir / FLEET_FILE
    saved: dict[str, Any] = {"fed": fed, "listen": listen}
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("fed") != fed:
            raise ConfigError(f"{state_dir} is fleet '{saved.get('fed')}', not '{fed}': pass --fed {saved.get('fed')}")
        if epsilon_budget is None or saved.get(BUDGET_KEY) == epsilon_budget:
            return dict(saved)
    if epsilon_budget is not None:
        if saved.get(BUDGET_KEY) is not None:
            log.info("fleet: privacy budget epsilon %g (was %g)", epsilon_budget, saved[BUDGET_KEY])
        saved[BUDGET_KEY] = check_budget_value(epsilon_budget)
    tmp = path.with_name(FLEET_FILE + ".tmp")
    tmp.write_text(json.dumps(saved) + "\n")
    os.replace(tmp, path)
    return saved


def fleet_command(
    state_dir: Path = typer.Option(..., "--state-dir", help="The fleet's state dir: broker, credentials, runs/."),
    fed: str = typer.Option("default", help="Federation name of the fleet (topics live under protofl/{fed}/)."),
    port: int = typer.Option(1883, help="Port of the fleet's broker (0 = any free port)."),
    listen: str | None = typer.Option(
        None, help="HOST:PORT the broker listens on (default 127.0.0.1:--port); 0.0.0.0:1883 serves other machines."
    ),
    allow: Path | None = typer.Option(
        None, help="Device ids enrolled at the first start, one a line (later: protofl-server devices add)."
    ),
    devices: int | None = typer.Option(None, help="Without --allow: enrol device-1..device-N."),
    tls: str = typer.Option("auto", "--tls", help="auto (on beyond loopback) | on | off: the fleet's generated CA."),
    local_broker: str = typer.Option("mosquitto", help="mosquitto (passwords, ACL, enrolment while it runs)."),
    max_message_mb: int = typer.Option(
        FLEET_PACKET_MB, "--max-message-mb", help="The largest message the fleet's broker carries (MB)."
    ),
    connect_timeout: float = typer.Option(30.0, help="Seconds a run's server waits for the broker at its start."),
    epsilon_budget: float | None = typer.Option(
        None,
        "--epsilon-budget",
        help="The privacy budget of each device over all runs (epsilons summed): run submit refuses a run that "
        "could take an enrolled device over it. Kept in fleet.json; given again, it changes.",
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log every run's joins and phases too."),
) -> None:
    """Serve a fleet: its broker and credentials stay up; the runs submitted (protofl-server run submit) run one
    after another; devices (protofl-edge join) stay connected between them."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    try:
        if allow is None and devices is None and not (state_dir / "security" / "credentials.json").is_file():
            raise ConfigError("a new fleet needs its devices: --allow FILE or --devices N")
        _serve_fleet(
            state_dir,
            fed,
            listen or f"127.0.0.1:{port}",
            allow,
            devices,
            tls,
            local_broker,
            max_message_mb,
            connect_timeout,
            verbose,
            epsilon_budget,
        )
    except ProtoFLError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def _serve_fleet(
    state_dir: Path,
    fed: str,
    listen: str,
    allow: Path | None,
    devices: int | None,
    tls: str,
    local_broker: str,
    max_message_mb: int,
    connect_timeout: float,
    verbose: bool,
    epsilon_budget: float | None = None,
) -> None:
    from broker_server.commands.start_cli import Access, _local_broker, listener_tls
    from broker_server.ops.broker import PACKET_HEADROOM
    from broker_server.ops.enrol import revoked
    from broker_server.ops.security import private_dir, read_allow_list
    from broker_server.ops.supervisor import stop_all_supervisors

    check_name(fed, "--fed")
    private_dir(state_dir)
    _fleet_file(state_dir, fed, listen, epsilon_budget)
    enrolled = _enrolled(state_dir)
    ids = read_allow_list(allow) if allow else enrolled or [f"device-{i}" for i in range(1, (devices or 0) + 1)]
    ids = [i for i in ids if i not in revoked(state_dir)]  # `devices revoke` took them out: not enrolled again
    access = Access(
        listen, False, sorted(set(ids) | set(enrolled)), None, None, listener_tls(None, None, None, None, tls), tls
    )
    access.check()
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log_from_handler(log, logging.INFO, "fleet: stopping (signal %d)", signum)
        stop_all_supervisors()
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with contextlib.ExitStack() as stack:
            url, _, auth = _local_broker(
                stack, None, fed, state_dir, access, local_broker, 10000, max_message_mb * 2**20 + PACKET_HEADROOM
            )
            assert auth is not None
            log.info(
                "fleet '%s' serving in %s: submit runs with protofl-server run submit --fleet %s NAME ...",
                fed,
                state_dir,
                state_dir,
            )
            said = ""
            while not stop.is_set():
                try:
                    run = runs.next_run(state_dir)
                except ConfigError as exc:  # a run's file broken by hand: said (once), the fleet stays up
                    if str(exc) != said:
                        said = str(exc)
                        log.error("fleet: %s; fix or remove it", exc)
                    stop.wait(POLL_S)
                    continue
                if run is None:
                    stop.wait(POLL_S)
                    continue
                _serve_run(run, url, fed, auth, connect_timeout, verbose, stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _enrolled(state_dir: Path) -> list[str]:
    from broker_server.ops.enrol import enrolled

    return enrolled(state_dir)


def _serve_run(
    run: runs.Run, url: str, fed: str, auth: object, connect_timeout: float, verbose: bool, stop: threading.Event
) -> None:
    """Run `run` as a child `start` on the fleet's broker until it ends (or the fleet stops: it stays `running`,
    and resumes when the fleet starts again)."""
    from broker_server.scaleout.shard_service import child_env

    secrets = auth.secrets  # type: ignore[attr-defined]
    fleet = run.dir.parent.parent
    resumed = run.state == "running"
    try:
        refused = None if resumed else runs.over_budget(fleet, run.name)
    except ProtoFLError as exc:  # its options no longer build a config: its `start` says why, in its log
        log.warning("run '%s': its planned epsilon is not known (%s)", run.name, exc)
        refused = None
    if refused is not None:  # the budget was lowered since it was submitted
        log.error("run '%s' not started: %s", run.name, refused)
        run.set_why(f"not started: {refused}")
        with open(run.log, "a") as out:
            out.write(f"not started: {refused}\n")
        run.set_state("failed")
        return
    argv = [
        sys.executable,
        "-m",
        "broker_server.cli",
        "start",
        "--broker",
        url,
        "--fed",
        fed,
        "--username",
        secrets.server.username,
        "--state-dir",
        str(run.dir),
        "--fleet-run",
        run.name,
        "--revoked-file",
        str(run.dir.parent.parent / "security" / "revoked"),
        "--device-logs",
        str(run.dir.parent.parent / LOG_DIR),
        "--fleet-ledger",
        str(privacy_ledger.ledger_path(fleet)),
        "--connect-timeout",
        str(connect_timeout),
        *(["--verbose"] if verbose else []),
        *run.args,
    ]
    env = child_env()
    env[PASSWORD_ENV] = secrets.server.password
    run.set_state("running")
    log.info("run '%s' %s (log: %s)", run.name, "resumes" if resumed else "starts", run.log)
    with open(run.log, "ab") as out:
        child = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=_killed_with_parent)
    asked = False
    while child.poll() is None:
        if stop.is_set():
            child.send_signal(signal.SIGTERM)  # the run stays `running`: the fleet resumes it when it starts again
            child.wait()
            return
        if run.stop_requested and not asked:
            asked = True
            child.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(POLL_S)
    code = child.returncode
    _record_spend(run, fleet)  # before the run is marked over: a fleet dying here records it again, the same
    state = "stopped" if run.stop_requested else "finished" if code == 0 else "failed"
    if code != 0:
        # Its server died (kill -9, an OOM kill) or gave up: what it left retained (its config, public set, round,
        # the fleet naming it) is cleared and the fleet said idle before the next run's server starts, so that the
        # devices drop this run before they see the next one's config (else they take it as this run's).
        if state == "failed" and not run.why:
            run.set_why(f"its server exited with {_exit_text(code)}; see its log (run logs {run.name})")
        _say_over(url, fed, secrets.server.username, secrets.server.password, state)
    if state == "finished":
        _report(run)
    run.set_state(state)
    log.info("run '%s' %s (exit %d)", run.name, state, code)


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _say_over(url: str, fed: str, username: str, password: str, why: str) -> None:
    """Clear a run whose server died from the broker (fleet_run.end_run), as the fleet's server user: the run's
    server is gone, so this connection takes its client id for a moment."""
    from broker_server.ops.fleet_run import end_run
    from protofl.transport.broker_url import parse_broker_url
    from protofl.transport.mqtt import MqttTransport

    transport = MqttTransport(parse_broker_url(url).with_auth(username, password), username, deliver="thread")
    try:
        transport.connect(10.0)
        end_run(transport, fed, why)
        if not transport.flush(10.0):
            log.warning("fleet: the end of the run was not acknowledged by the broker within 10 s")
    except (ProtoFLError, OSError, TimeoutError) as exc:
        log.error("fleet: could not clear the ended run's retained messages: %s", exc)
    finally:
        transport.close()


def _record_spend(run: runs.Run, fleet: Path) -> None:
    """The ended run's spend, in the fleet's privacy ledger (nothing where its server never served)."""
    try:
        spend = privacy_ledger.read_spend(run.dir)
        if spend is not None:
            _charge(run, fleet, spend)
    except ProtoFLError as exc:
        log.error("run '%s': NOT recorded in the privacy ledger: %s", run.name, exc)


def _charge(run: runs.Run, fleet: Path, spend: privacy_ledger.RunSpend) -> None:
    if not spend.final:
        log.warning(
            "run '%s': its server ended without its last figures; every enrolled device is charged its planned "
            "epsilon (%s)",
            run.name,
            "unbounded: no DP" if spend.planned is None else f"{spend.planned:g}",
        )
    ledger = privacy_ledger.record(fleet, spend.charged_to(_enrolled(fleet)))
    charged = ledger.runs[run.name]
    log.info(
        "run '%s': privacy ledger: %d device(s) charged %s (%d round(s)); the most spent now: %s",
        run.name,
        len(charged.devices),
        "unbounded epsilon (no DP)"
        if charged.planned is None
        else f"epsilon up to {max((s.epsilon for s in charged.devices.values()), default=0.0):.3g}",
        charged.rounds,
        max(ledger.totals().values(), key=lambda s: s.epsilon, default=privacy_ledger.Spend()).text(),
    )


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None  # loaded before any fork


def _killed_with_parent() -> None:
    """In the forked run server, before exec: SIGKILL when the fleet server dies without stopping it (a crash of
    the fleet is a crash of its run: the run resumes from its journal when the fleet starts again)."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _report(run: runs.Run) -> None:
    """The run's report (protofl-server report) in FLEET/runs/NAME/report/: the plots where matplotlib is
    installed, the summary always."""
    from broker_server.commands.report_cli import load_runs, summary, write_report

    out = run.dir / "report"
    try:
        loaded = load_runs([run.dir / "rounds.jsonl"])
        try:
            write_report(loaded, out)
        except ConfigError as exc:  # no matplotlib: the summary still
            log.warning("run '%s': report without plots (%s)", run.name, exc)
            out.mkdir(exist_ok=True)
            (out / "summary.md").write_text(summary(loaded))
    except (ProtoFLError, OSError) as exc:
        log.error("run '%s': no report: %s", run.name, exc)
        return
    log.info("run '%s': report in %s", run.name, out)


# -- protofl-server run submit|list|resume|stop|logs -----------------------------------------------------------------
run_app = typer.Typer(
    help="A fleet's runs: submit one to the queue, list them, resume or stop one, read its server log."
)
FLEET_OPTION = typer.Option(..., "--fleet", help="The fleet's state dir (protofl-server fleet --state-dir).")


@run_app.command("submit", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run_submit(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="The run's name (letters, digits, _ . -): its directory FLEET/runs/NAME."),
    fleet: Path = FLEET_OPTION,
) -> None:
    """Queue a run: the options after NAME are `protofl-server start`'s (--preset, --rounds, --min-clients, --set,
    --public-data, --classes ...), except what the fleet sets (broker, credentials, --fed, --state-dir)."""
    try:
        run = runs.submit(fleet, name, list(ctx.args))
    except ProtoFLError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"run '{run.name}' queued (#{run.seq}) in {run.dir}")


@run_app.command("list")
def run_list(fleet: Path = FLEET_OPTION) -> None:
    """The fleet's runs in order: name, state, rounds logged, the options they run with."""
    from broker_server.commands.start_cli import last_logged_round

    try:
        runs.check_fleet(fleet)
        found = runs.list_runs(fleet)
    except ProtoFLError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if not found:
        typer.echo("no runs (protofl-server run submit --fleet FLEET NAME ...)")
    for run in found:
        typer.echo(
            f"{run.seq:>3} {run.name:<20} {run.state:<9} rounds {last_logged_round(run.dir / 'rounds.jsonl'):>3}  "
            f"{' '.join(run.args)}"
        )
        if run.state == "failed" and run.why:
            typer.echo(f"    failed: {printable(run.why, 2000)}")


@run_app.command("resume")
def run_resume(name: str = typer.Argument(...), fleet: Path = FLEET_OPTION) -> None:
    """Queue a failed or stopped run again, at the end of the queue: its server resumes from its journal (the rounds
    it did are kept) with the options it was submitted with."""
    try:
        run = runs.resume(fleet, name)
    except ProtoFLError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"run '{run.name}' queued again (#{run.seq}); it resumes from round {_rounds(run)} in {run.dir}")


def _rounds(run: runs.Run) -> int:
    from broker_server.commands.start_cli import last_logged_round

    return last_logged_round(run.dir / "rounds.jsonl") + 1


@run_app.command("stop")
def run_stop(name: str = typer.Argument(...), fleet: Path = FLEET_OPTION) -> None:
    """Stop a run: a queued one never starts; a running one's server stops (its state stays in FLEET/runs/NAME)."""
    try:
        run = runs.request_stop(fleet, name)
    except ProtoFLError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"run '{run.name}': " + ("stopped" if run.state == "stopped" else "stop asked (the fleet stops it)"))


@run_app.command("logs")
def run_logs(
    name: str = typer.Argument(...),
    fleet: Path = FLEET_OPTION,
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing lines as the run writes them."),
) -> None:
    """A run's server log (its `start` output)."""
    import time

    try:
        run = runs.get_run(fleet, name)
    except ProtoFLError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if not run.log.exists():
        typer.echo(f"run '{name}' is {run.state}: no log yet", err=True)
        if not follow:
            return
    pos = 0
    while True:
        if run.log.exists():
            with open(run.log, "rb") as f:
                f.seek(pos)
                chunk = f.read()
                pos += len(chunk)
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
        if not follow or (run.state in runs.OVER and pos >= os.path.getsize(run.log)):
            return
        time.sleep(0.5)


# -- protofl-server service install ----------------------------------------------------------------------------------
service_app = typer.Typer(help="Run the fleet as a systemd service.")


@service_app.command("install", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def service_install(
    ctx: typer.Context,
    state_dir: Path = typer.Option(..., "--state-dir", help="The fleet's state dir."),
    out: Path = typer.Option(Path("/etc/systemd/system"), "--out", help="Where the unit file goes."),
    name: str = typer.Option("protofl-fleet", "--name", help="The unit's name (NAME.service)."),
    max_devices: int = typer.Option(
        0, "--max-devices", help="Connections the broker must hold (LimitNOFILE); default: the enrolled, x2, >= 1000."
    ),
    user: str | None = typer.Option(None, "--user", help=USER_HELP),
) -> None:
    """Write a systemd unit for `protofl-server fleet --state-dir DIR [the options after --]`: restarted on failure
    (the run it died under resumes, crash exact), started at boot, LimitNOFILE for the fleet's connections."""
    from broker_server.ops.capacity import files_for_fleet
    from protofl.cli_options import check_options
    from protofl.systemd import Unit, carried_env, install, python_module

    args = ["--state-dir", str(state_dir.resolve()), *ctx.args]

    def build() -> Unit:
        check_options(fleet_command, "fleet", args)
        devices = max_devices or max(1000, 2 * len(_enrolled(state_dir)))
        return Unit(
            name,
            f"protofl-edge fleet server ({state_dir.resolve()})",
            python_module("broker_server.cli", "fleet", *args),
            state_dir.resolve().parent,
            nofile=files_for_fleet(devices) + 1024,  # the broker's connections, and the server's own files
            env=carried_env(),
            user=user,
            writes=(state_dir.resolve(),),
        )

    install(build, out)


def logs_command(
    device: str = typer.Argument(..., help="The device id."),
    fleet: Path = typer.Option(..., "--fleet", help="The fleet's state dir (or a `start --state-dir`)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing lines as they come."),
) -> None:
    """A device's log lines, shipped by the device (protofl-edge join --ship-logs) and kept at the server (at most
    30 lines a minute and 512 KB per device)."""
    import time

    from broker_server.ops.device_logs import log_files

    try:
        files = log_files(fleet / LOG_DIR, device)
    except ProtoFLError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if not files and not follow:
        typer.echo(f"no log lines from {device} in {fleet / LOG_DIR}", err=True)
        raise typer.Exit(1)
    for path in files[:-1]:
        sys.stdout.write(path.read_text(errors="replace"))
    current = fleet / LOG_DIR / f"{device}.log"
    pos = 0
    while True:
        try:
            with open(current, "rb") as f:
                if os.fstat(f.fileno()).st_size < pos:
                    pos = 0  # rotated
                f.seek(pos)
                chunk = f.read()
                pos += len(chunk)
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
        except OSError:
            pass
        if not follow:
            return
        time.sleep(0.5)

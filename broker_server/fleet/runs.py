"""A fleet's runs (broker_server/fleet/fleet.py): the queue of submitted runs under FLEET/runs/, one directory a run.

`FLEET/runs/<name>/` is that run's state dir, as `protofl-server start --state-dir` keeps one (journal,
checkpoint, rounds.jsonl, artifacts, report), plus `run.json` (its `start` options and its place in the queue),
`state` (queued | running | finished | failed | stopped), `server.log` (the run's server log),
`stop-requested` (`run stop` asks the fleet to stop it), `why` (why it failed: its server died, or no device can
serve it; `run list` shows it) and `spend.json` (what it spent on each device, for the
fleet's privacy ledger, broker_server/ops/privacy_ledger.py, which `submit` holds a new run to). Only files: the
commands that submit, list and stop runs need no connection to the fleet server, which reads the queue between
runs. A run that was `running` when the fleet server died resumes first when it comes back (crash exact: its
journal and checkpoint).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker_server.ops import privacy_ledger
from broker_server.ops.fleet_run import RUNS, SPEC, STATE, STOP, WHY, stop_requested
from protofl.errors import ConfigError
from protofl.names import check_name

LOG = "server.log"
STATES = ("queued", "running", "finished", "failed", "stopped")
OVER = ("finished", "failed", "stopped")
# What the fleet sets for every run (its broker, credentials, federation name, state dir): not a run's to choose.
FLEET_OWNED = (
    "--broker",
    "--state-dir",
    "--fed",
    "--username",
    "--password",
    "--tls-ca",
    "--tls-cert",
    "--tls-key",
    "--listen",
    "--port",
    "--allow",
    "--devices",
    "--insecure",
    "--tls",
    "--local-broker",
    "--broker-cert",
    "--broker-key",
    "--client-ca",
    "--fleet-run",
    "--fleet-ledger",
)


@dataclass(frozen=True)
class Run:
    name: str
    dir: Path
    seq: int
    args: tuple[str, ...]
    submitted: float

    @property
    def state(self) -> str:
        try:
            return (self.dir / STATE).read_text().strip() or "queued"
        except OSError:
            return "queued"

    def set_state(self, state: str) -> None:
        assert state in STATES, state
        tmp = self.dir / (STATE + ".tmp")
        tmp.write_text(state + "\n")
        os.replace(tmp, self.dir / STATE)

    @property
    def stop_requested(self) -> bool:
        return stop_requested(self.dir)

    @property
    def log(self) -> Path:
        return self.dir / LOG

    @property
    def why(self) -> str:
        """Why the run failed ("" where nothing was said)."""
        try:
            return (self.dir / WHY).read_text().strip()
        except OSError:
            return ""

    def set_why(self, why: str) -> None:
        tmp = self.dir / (WHY + ".tmp")
        tmp.write_text(why.replace("\n", " ") + "\n")
        os.replace(tmp, self.dir / WHY)


def runs_dir(fleet: Path) -> Path:
    return fleet / RUNS


def _read(path: Path) -> Run:
    try:
        raw = json.loads((path / SPEC).read_text())
        return Run(str(raw["name"]), path, int(raw["seq"]), tuple(map(str, raw["args"])), float(raw["submitted"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path / SPEC}: not a run's file ({exc})") from None


def list_runs(fleet: Path) -> list[Run]:
    """The fleet's runs in the order they were submitted."""
    root = runs_dir(fleet)
    if not root.is_dir():
        return []
    # Not `submit`'s .NAME.tmp, half written (the fleet server died reading one: issue 59).
    found = (p for p in root.iterdir() if not p.name.startswith(".") and (p / SPEC).is_file())
    return sorted((_read(p) for p in found), key=lambda r: r.seq)


def get_run(fleet: Path, name: str) -> Run:
    path = runs_dir(fleet) / check_name(name, "run name")
    if not (path / SPEC).is_file():
        known = ", ".join(r.name for r in list_runs(fleet)) or "none"
        raise ConfigError(f"no run '{name}' in fleet {fleet} (runs: {known})")
    return _read(path)


def check_fleet(fleet: Path) -> None:
    if not (fleet / "fleet.json").is_file():
        raise ConfigError(
            f"{fleet} is no fleet's state dir (no fleet.json): start one with protofl-server fleet --state-dir {fleet}"
        )


def submit(fleet: Path, name: str, args: list[str]) -> Run:
    """Queue run `name` with these `start` options (checked: a bad one changes nothing)."""
    check_fleet(fleet)
    check_name(name, "run name")
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in FLEET_OWNED:
            raise ConfigError(f"{flag}: the fleet sets it for every run (its broker, credentials and state dir)")
    path = runs_dir(fleet) / name
    if path.exists():
        raise ConfigError(
            f"run '{name}' exists in fleet {fleet} (state: {get_run(fleet, name).state}); pick a new name"
        )
    params = _check_start_options(args)
    refused = over_budget(fleet, name, params)
    if refused is not None:
        raise ConfigError(refused)
    seq = max((r.seq for r in list_runs(fleet)), default=0) + 1
    runs_dir(fleet).mkdir(mode=0o700, exist_ok=True)
    tmp = runs_dir(fleet) / f".{name}.tmp"
    tmp.mkdir(mode=0o700)
    (tmp / SPEC).write_text(json.dumps({"name": name, "seq": seq, "args": args, "submitted": time.time()}) + "\n")
    (tmp / STATE).write_text("queued\n")
    os.replace(tmp, path)  # the fleet server never sees half a run
    return _read(path)


def _check_start_options(args: list[str]) -> dict[str, Any]:
    """Parse `args` as `protofl-server start` would, without running anything: the options' values."""
    from broker_server.commands.start_cli import start_command
    from protofl.cli_options import check_options

    return check_options(start_command, "start", args)


def planned_epsilon(params: dict[str, Any]) -> float | None:
    """The most a run with these `start` options may spend on a device: its `dp_epsilon` from its preset, config
    file and --set (None: no differential privacy)."""
    from broker_server.cli_common import parse_sets
    from protofl.presets import make_config

    config = params.get("config")
    cfg = make_config(params["preset"], str(config) if config else None, strict=True, **parse_sets(params["set_"]))
    return None if cfg.dp_epsilon is None else float(cfg.dp_epsilon)


def over_budget(fleet: Path, name: str, params: dict[str, Any] | None = None) -> str | None:
    """Why run `name` (its `start` options `params`; default: its run.json's) may not run on this fleet: its
    planned epsilon, after the runs queued or running before it, would take an enrolled device over the fleet's
    budget (None: it fits, or there is no budget). `submit` asks, and the fleet again before it starts a queued run
    (the budget may have been lowered since)."""
    from broker_server.ops.enrol import enrolled

    limit = privacy_ledger.budget(fleet)
    if limit is None:
        return None
    queued = list_runs(fleet)
    seq = next((r.seq for r in queued if r.name == name), None)  # None: a new submission, after every run
    if params is None:
        params = _check_start_options(list(get_run(fleet, name).args))
    ahead = [
        privacy_ledger.Planned(r.name, planned_epsilon(_check_start_options(list(r.args))))
        for r in queued
        if r.state in ("queued", "running") and r.name != name and (seq is None or r.seq < seq)
    ]
    return privacy_ledger.over_budget(
        privacy_ledger.read_ledger(privacy_ledger.ledger_path(fleet)),
        enrolled(fleet),
        limit,
        privacy_ledger.Planned(name, planned_epsilon(params)),
        ahead,
    )


def next_run(fleet: Path) -> Run | None:
    """The run to serve now: one that was running (the fleet server died under it), else the first queued."""
    runs = list_runs(fleet)
    for run in runs:
        if run.state == "running":
            return run
    return next((r for r in runs if r.state == "queued"), None)


def request_stop(fleet: Path, name: str) -> Run:
    """Ask the fleet to stop run `name` (a queued one is stopped at once; a running one by the fleet server)."""
    run = get_run(fleet, name)
    if run.state in OVER:
        raise ConfigError(f"run '{name}' is {run.state} already")
    (run.dir / STOP).write_text(f"{time.time()}\n")
    if run.state == "queued":
        run.set_state("stopped")
    return run


RESUMABLE = ("failed", "stopped")


def resume(fleet: Path, name: str) -> Run:
    """Queue run `name` again (a failed or stopped one), at the end of the queue, with the options it was submitted
    with and its state dir as it is: its server resumes from its journal and checkpoint, crash exact, and goes on
    from the rounds it did (a resubmission under its name would have to throw them away)."""
    check_fleet(fleet)
    run = get_run(fleet, name)
    if run.state not in RESUMABLE:
        raise ConfigError(
            f"run '{name}' is {run.state}: only a failed or stopped run can be resumed (a finished one is over, "
            "a queued or running one has not ended)"
        )
    seq = max((r.seq for r in list_runs(fleet)), default=0) + 1
    tmp = run.dir / (SPEC + ".tmp")
    spec = {"name": run.name, "seq": seq, "args": list(run.args), "submitted": run.submitted}
    tmp.write_text(json.dumps(spec) + "\n")
    for stale in (STOP, WHY):
        (run.dir / stale).unlink(missing_ok=True)
    os.replace(tmp, run.dir / SPEC)
    run = _read(run.dir)
    run.set_state("queued")
    return run

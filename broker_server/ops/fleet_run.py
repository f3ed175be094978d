"""What a run's server (`start --fleet-run NAME`, which broker_server/fleet/fleet.py starts) does as one run of a fleet:
say its name on the retained `server/fleet` topic when it serves, and when it is over clear its retained config,
public set and round (no device of the next run reads them) and say the fleet is idle; and whether `run stop`
asked for it to stop (a stopped run is over too). Kept apart from fleet.py, which starts `start`. Also where a
fleet's runs live (FLEET/runs/NAME/, broker_server/fleet/runs.py keeps the queue there), so that `status --state-dir
FLEET` can show the run the fleet serves."""

from __future__ import annotations

from pathlib import Path

from protofl import topics
from protofl.transport import Transport
from protofl.wire import Status, encode_message

STOP = "stop-requested"  # in a run's state dir: `protofl-server run stop` asks the fleet to stop it
RUNS = "runs"  # FLEET/runs/NAME/: a run's state dir
SPEC, STATE = "run.json", "state"  # in a run's state dir: its options and place in the queue; its state
WHY = "why"  # in a run's state dir: why it failed, one line (`run list` shows it)


def announce_run(transport: Transport, fed: str, run: str) -> None:
    """Say (retained) that the fleet's current run is `run`."""
    payload = encode_message(Status(state="run", detail=run), fed=fed, sender=topics.SERVER_ID)
    transport.publish(topics.fleet(fed), payload, retain=True)


def end_run(transport: Transport, fed: str, why: str = "") -> None:
    """The run is over: its retained messages cleared, the fleet idle. `why` (e.g. "failed") is said with the idle
    status, for the devices' logs ("run 'NAME' ended (failed)"); "" for a run that finished or was stopped."""
    for topic in (topics.config(fed), topics.public(fed), topics.round_(fed)):
        transport.publish(topic, b"", retain=True)
    payload = encode_message(Status(state="idle", detail=why), fed=fed, sender=topics.SERVER_ID)
    transport.publish(topics.fleet(fed), payload, retain=True)


def current_run(fleet: Path) -> Path | None:
    """The state dir of the run fleet `fleet` serves (the one `running`), else of the last run that wrote its
    status; None where `fleet` is no fleet's state dir or no run has started."""
    root = fleet / RUNS
    if not (fleet / "fleet.json").is_file() or not root.is_dir():
        return None
    dirs = sorted(p for p in root.iterdir() if not p.name.startswith(".") and (p / SPEC).is_file())
    for path in dirs:
        try:
            if (path / STATE).read_text().strip() == "running":
                return path
        except OSError:
            continue
    shown = [p for p in dirs if (p / "status.json").is_file()]
    return max(shown, key=lambda p: (p / "status.json").stat().st_mtime, default=None)


def stop_requested(state_dir: Path | None) -> bool:
    """Whether `run stop` asked to stop the run kept in `state_dir`."""
    return state_dir is not None and (state_dir / STOP).exists()


def fleet_note(fleet: Path) -> str | None:
    """What `status --state-dir FLEET` says where no run's status tells the fleet's state: no run yet, a run starting
    (its server has written no status yet), or the fleet between runs; None where `fleet` is no fleet's state dir or
    the run it serves (or served last) has a status to show."""
    if not (fleet / "fleet.json").is_file():
        return None
    root = fleet / RUNS
    states: dict[str, str] = {}
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if (path / SPEC).is_file():
            try:
                states[path.name] = (path / STATE).read_text().strip() or "queued"
            except OSError:
                states[path.name] = "queued"
    count = {s: sum(1 for v in states.values() if v == s) for s in sorted(set(states.values()))}
    tally = ", ".join(f"{n} {s}" for s, n in count.items()) or "no run submitted"
    running = [n for n, s in states.items() if s == "running"]
    if running:
        if (root / running[0] / "status.json").is_file():
            return None
        return (
            f"fleet {fleet}: run '{running[0]}' is starting (its server has written no status yet: it brings up its "
            f"broker, then trains; `protofl-server run logs {running[0]} --fleet {fleet}` shows it); runs: {tally}"
        )
    queued = [n for n, s in states.items() if s == "queued"]
    if queued:
        return f"fleet {fleet}: run '{queued[0]}' is next in the queue; runs: {tally}"
    last = current_run(fleet)
    if last is not None:
        return None  # between runs: the last run's status says how it ended
    return (
        f"fleet {fleet}: idle, no run submitted yet (protofl-server run submit NAME --fleet {fleet} ...); "
        f"its devices wait connected"
    )

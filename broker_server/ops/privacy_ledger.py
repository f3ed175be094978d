"""A standing fleet's privacy ledger (issue 58): the epsilon and delta each device has spent across the fleet's runs,
and the fleet's budget that `run submit` holds a new run to.

Three files, each written atomically (owner-only, as the credentials are):

- `FLEET/runs/NAME/spend.json`: what run NAME has spent so far, written by the run's own server (`start
  --fleet-ledger`) when it starts, after every round it closes and when it ends (`final`). A run spends, on each
  device that took part in it (had at least one upload accepted: the round machine's `accepted`, durable state),
  the run's epsilon (protofl/privacy.py's accountant) at its rounds released: the rounds it closed, plus the
  round open when it ended for a device that uploaded in it. A run without differential privacy spends an
  unbounded epsilon (`null`) on each device that took part.
- `FLEET/privacy-ledger.json`: each ended run's spend, by run; written by the fleet server only, when a run's
  server has exited (a run is recorded once: its entry is replaced, never added to, so a fleet restarted between
  recording and marking the run over records the same figures again). A run whose server died without saying
  its last figures (killed on its own: no `final` spend) is charged its planned epsilon (`dp_epsilon`, the most
  it could spend) on every device enrolled then: what it sent in its open round is not known.
- `FLEET/fleet.json`'s `epsilon_budget` (`protofl-server fleet --epsilon-budget E`, kept from then on).

Composition across runs is basic: a device's epsilons add up, and so do its deltas (Dwork and Roth 2014, Thm 3.16).
Not tighter (advanced composition, or the RDP accountant across runs) because runs differ in mechanism and delta,
each run reports its own (epsilon, delta) rather than its RDP curve, and k runs are few: advanced composition gains
over the sum only beyond tens of runs of one mechanism, and would add a delta of its own. The sum is an upper bound
whatever the runs were, which is what a budget must hold.

A run's *planned* epsilon is its `dp_epsilon`: the run stops before a round that would spend more
(`privacy.stop_reason`). `run submit` refuses a run whose planned epsilon, added to each enrolled device's spend and
to the planned epsilon of the runs queued or running before it (those charged to every enrolled device: who takes
part is not known yet), would exceed the budget; a run without DP is refused under any budget. numpy-free.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from broker_server.ops.security import write_secret
from protofl.errors import ConfigError

if TYPE_CHECKING:
    from broker_server.core.rounds import Accepted
    from protofl.privacy import DpSettings

LEDGER = "privacy-ledger.json"
SPEND = "spend.json"
FLEET = "fleet.json"
BUDGET_KEY = "epsilon_budget"
COMPOSITION = "basic"  # epsilons and deltas summed over runs
UNBOUNDED = math.inf  # a run without differential privacy


@dataclass(frozen=True)
class Spend:
    """(epsilon, delta) spent; epsilon inf where a run without differential privacy took part."""

    epsilon: float = 0.0
    delta: float = 0.0

    def __add__(self, other: Spend) -> Spend:
        """Basic composition."""
        return Spend(self.epsilon + other.epsilon, self.delta + other.delta)

    def text(self) -> str:
        if math.isinf(self.epsilon):
            return "epsilon unbounded (a run without DP)"
        return f"epsilon {self.epsilon:.3g} (delta {self.delta:.3g})"

    def as_json(self) -> dict[str, Any]:
        return {"epsilon": None if math.isinf(self.epsilon) else self.epsilon, "delta": self.delta}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Spend:
        eps = raw.get("epsilon")
        return cls(UNBOUNDED if eps is None else float(eps), float(raw.get("delta", 0.0)))


@dataclass(frozen=True)
class RunSpend:
    """What one run spent on each device that took part in it."""

    run: str
    devices: dict[str, Spend] = field(default_factory=dict)
    planned: float | None = None  # dp_epsilon: the most the run may spend on a device (None: no DP, unbounded)
    delta: float = 0.0  # dp_delta
    rounds: int = 0  # rounds released (closed, or open with an upload in it)
    final: bool = False  # written by the run's server as it ended (else: its last figures are not known)

    def as_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "planned_epsilon": self.planned,
            "delta": self.delta,
            "rounds": self.rounds,
            "final": self.final,
            "devices": {d: s.as_json() for d, s in sorted(self.devices.items())},
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> RunSpend:
        planned = raw.get("planned_epsilon")
        return cls(
            str(raw["run"]),
            {str(d): Spend.from_json(s) for d, s in raw.get("devices", {}).items()},
            None if planned is None else float(planned),
            float(raw.get("delta", 0.0)),
            int(raw.get("rounds", 0)),
            bool(raw.get("final", False)),
        )

    def with_final(self) -> RunSpend:
        return RunSpend(self.run, self.devices, self.planned, self.delta, self.rounds, True)

    def charged_to(self, enrolled: Iterable[str]) -> RunSpend:
        """What the ledger records for this run: its figures where its server said them as it ended; else (killed
        on its own) its planned epsilon on every device enrolled, since its open round's senders are not known."""
        if self.final:
            return self
        worst = Spend(UNBOUNDED if self.planned is None else self.planned, self.delta)
        return RunSpend(self.run, {d: worst for d in {*self.devices, *enrolled}}, self.planned, self.delta, self.rounds)


def run_spend(run: str, dp: DpSettings | None, accepted: Mapping[str, Accepted], closed: int, final: bool) -> RunSpend:
    """A run's spend from its round machine's state: each device with an accepted upload is charged the run's
    epsilon at the rounds released up to its last upload (the closed rounds, or one more where its last upload was
    in the round still open). Not per round taken part: the state keeps a device's last upload, not every round."""
    devices: dict[str, Spend] = {}
    released = closed
    for device, a in accepted.items():
        if a.uploads <= 0:
            continue
        rounds = max(closed, a.round)
        released = max(released, rounds)
        devices[device] = Spend(UNBOUNDED, 0.0) if dp is None else Spend(dp.spent(rounds), dp.delta)
    return RunSpend(run, devices, None if dp is None else dp.epsilon, 0.0 if dp is None else dp.delta, released, final)


def write_spend(run_dir: Path, spend: RunSpend) -> None:
    write_secret(run_dir / SPEND, json.dumps(spend.as_json(), indent=1) + "\n")


def read_spend(run_dir: Path) -> RunSpend | None:
    """A run's spend file (None: its server never started serving, so it spent nothing)."""
    path = run_dir / SPEND
    if not path.is_file():
        return None
    try:
        return RunSpend.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{path}: not a run's spend ({exc})") from None


@dataclass(frozen=True)
class Ledger:
    """Each recorded run's spend, by run name."""

    runs: dict[str, RunSpend] = field(default_factory=dict)

    def totals(self, without: str | None = None) -> dict[str, Spend]:
        """Each device's spend over the recorded runs (basic composition), `without` one of them."""
        out: dict[str, Spend] = {}
        for name, spend in self.runs.items():
            if name == without:
                continue
            for device, s in spend.devices.items():
                out[device] = out.get(device, Spend()) + s
        return out

    def with_run(self, spend: RunSpend) -> Ledger:
        return Ledger({**self.runs, spend.run: spend})

    def as_json(self) -> dict[str, Any]:
        return {
            "v": 1,
            "composition": COMPOSITION,
            "runs": {name: s.as_json() for name, s in self.runs.items()},
            "devices": {d: s.as_json() for d, s in sorted(self.totals().items())},  # derived: for people reading it
        }


def ledger_path(fleet: Path) -> Path:
    return fleet / LEDGER


def read_ledger(path: Path) -> Ledger:
    """The ledger at `path` (empty where no run was recorded yet)."""
    if not path.is_file():
        return Ledger()
    try:
        raw = json.loads(path.read_text())
        return Ledger({str(n): RunSpend.from_json(s) for n, s in raw["runs"].items()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{path}: not a privacy ledger ({exc}); it is the fleet's record: restore it") from None


def record(fleet: Path, spend: RunSpend) -> Ledger:
    """Record an ended run's spend (replacing an earlier record of the same run) and return the ledger."""
    path = ledger_path(fleet)
    ledger = read_ledger(path).with_run(spend)
    write_secret(path, json.dumps(ledger.as_json(), indent=1, allow_nan=False) + "\n")
    return ledger


def budget(fleet: Path) -> float | None:
    """The fleet's epsilon budget (fleet.json), None where it has none."""
    try:
        value = json.loads((fleet / FLEET).read_text()).get(BUDGET_KEY)
    except (OSError, ValueError, AttributeError):
        return None
    return None if value is None else float(value)


def check_budget_value(value: float) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ConfigError(f"--epsilon-budget must be a number > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Planned:
    """A run not recorded yet, and the most it may spend on a device (None: no DP, unbounded)."""

    run: str
    epsilon: float | None


def over_budget(
    ledger: Ledger, enrolled: Iterable[str], limit: float, new: Planned, ahead: Iterable[Planned] = ()
) -> str | None:
    """Why run `new` would take an enrolled device over the fleet's budget `limit` (None: it fits). Each enrolled
    device is charged its recorded spend, the planned epsilon of the runs `ahead` of it (queued or running; a run
    recorded already is counted once, as recorded) and `new`'s."""
    if new.epsilon is None:
        return (
            f"run '{new.run}' has no differential privacy (dp_epsilon unset): its uploads spend an unbounded epsilon, "
            f"which the fleet's budget (epsilon {limit:g}) cannot hold; submit it with --set dp_epsilon=E"
        )
    ahead = [p for p in ahead if p.run not in ledger.runs and p.run != new.run]
    unbounded = [p.run for p in ahead if p.epsilon is None]
    committed = sum(p.epsilon or 0.0 for p in ahead)
    totals = ledger.totals()
    over = []
    for device in sorted(set(enrolled)):
        spent = totals.get(device, Spend())
        after = spent.epsilon + committed + new.epsilon
        if unbounded or after > limit * (1 + 1e-9):
            over.append((after, device, spent))
    if not over:
        return None
    over.sort(key=lambda x: (-x[0], x[1]))
    named = ", ".join(f"{d} (spent {s.text()}; would reach {a:.3g})" for a, d, s in over[:10])
    more = f" and {len(over) - 10} more" if len(over) > 10 else ""
    queued = (
        f", runs queued or running before it plan {committed:.3g} more"
        + (f" (unbounded: {', '.join(unbounded)} without DP)" if unbounded else "")
        if ahead
        else ""
    )
    return (
        f"run '{new.run}' (dp_epsilon {new.epsilon:g}) would take {len(over)} enrolled device(s) over the fleet's "
        f"privacy budget, epsilon {limit:g}{queued}: {named}{more}. Nothing was queued; lower dp_epsilon, or "
        f"raise the budget (protofl-server fleet --epsilon-budget E)"
    )


@dataclass(frozen=True)
class FleetView:
    """What a fleet run's server shows of the fleet's ledger (status, status.json, the retained summary): each
    device's spend over the fleet's other runs, read when it starts, plus what this run has spent so far."""

    run: str
    before: dict[str, Spend]
    budget: float | None = None

    @classmethod
    def read(cls, ledger_file: Path, run: str) -> FleetView:
        """The view for run `run` of the fleet whose ledger is `ledger_file` (its own record left out: a run
        resumed after it was recorded is not counted twice)."""
        return cls(run, read_ledger(ledger_file).totals(without=run), budget(ledger_file.parent))

    def now(self, spend: RunSpend) -> dict[str, Any]:
        """The snapshot's `fleet_privacy`: each device's spend, this run included (basic composition)."""
        devices = dict(self.before)
        for device, s in spend.devices.items():
            devices[device] = devices.get(device, Spend()) + s
        return {
            "composition": COMPOSITION,
            "epsilon_budget": self.budget,
            "run": self.run,
            "devices": {d: s.as_json() for d, s in sorted(devices.items())},
        }


def describe_fleet(view: Mapping[str, Any]) -> str:
    """A snapshot's `fleet_privacy` in one line (status): the devices that spent most."""
    spent = sorted(
        ((Spend.from_json(s), d) for d, s in view.get("devices", {}).items()), key=lambda x: (-x[0].epsilon, x[1])
    )
    limit = view.get("epsilon_budget")
    shown = ", ".join(f"{d} {s.text()}" for s, d in spent[:5]) or "nothing spent yet"
    more = f" and {len(spent) - 5} more" if len(spent) > 5 else ""
    return (
        f"fleet privacy ledger (epsilons and deltas summed over runs{f', budget epsilon {limit:g}' if limit else ''}"
        f"): {shown}{more}"
    )

"""The fleet's privacy ledger (broker_server/ops/privacy_ledger.py, issue 58) as plain values: what a run charges
each device, basic composition across runs, a run recorded twice, a killed run's charge, and the budget's refusal.
The fleet's commands are tested in test_fleet_ledger.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from broker_server.core.rounds import Accepted
from broker_server.ops.privacy_ledger import (
    FleetView,
    Ledger,
    Planned,
    RunSpend,
    Spend,
    describe_fleet,
    ledger_path,
    over_budget,
    read_ledger,
    read_spend,
    record,
    run_spend,
    write_spend,
)
from protofl.privacy import DpSettings, epsilon_after

DP = DpSettings(epsilon=8.0, delta=1e-5, clip=1.0, noise=1.5, rows=10)


def test_a_run_charges_each_device_that_uploaded_its_epsilon_at_the_rounds_released() -> None:
    accepted = {
        "a": Accepted(uploads=3, round=3),  # uploaded in round 3, still open: 3 rounds released to it
        "b": Accepted(uploads=1, round=1),  # left after round 1: charged the 2 closed rounds (its rounds not kept)
        "c": Accepted(uploads=0),  # never uploaded: not charged
    }
    spend = run_spend("r", DP, accepted, closed=2, final=True)
    assert set(spend.devices) == {"a", "b"} and spend.rounds == 3
    assert spend.devices["a"] == Spend(epsilon_after(1.5, 3, 1e-5), 1e-5)
    assert spend.devices["b"] == Spend(epsilon_after(1.5, 2, 1e-5), 1e-5)
    assert spend.planned == 8.0
    no_dp = run_spend("p", None, accepted, closed=2, final=True)
    assert math.isinf(no_dp.devices["a"].epsilon) and no_dp.planned is None


def test_runs_compose_by_summing_epsilons_and_deltas_and_a_run_recorded_again_counts_once(tmp_path: Path) -> None:
    one = RunSpend("one", {"a": Spend(2.0, 1e-5), "b": Spend(2.0, 1e-5)}, 8.0, 1e-5, 2, True)
    two = RunSpend("two", {"a": Spend(3.5, 1e-6)}, 8.0, 1e-6, 1, True)
    record(tmp_path, one)
    record(tmp_path, two)
    record(tmp_path, two)  # a fleet that died between recording and marking the run over records it again
    totals = read_ledger(ledger_path(tmp_path)).totals()
    assert totals["a"] == Spend(2.0 + 3.5, 1e-5 + 1e-6) and totals["b"] == Spend(2.0, 1e-5)
    assert read_ledger(ledger_path(tmp_path)).totals(without="two")["a"] == Spend(2.0, 1e-5)
    write_spend(tmp_path, two)
    assert read_spend(tmp_path) == two


def test_a_run_killed_without_its_last_figures_charges_its_planned_epsilon_to_every_enrolled_device() -> None:
    partial = RunSpend("k", {"a": Spend(1.0, 1e-5)}, 8.0, 1e-5, 1, final=False)
    charged = partial.charged_to(["a", "b"])
    assert charged.devices == {"a": Spend(8.0, 1e-5), "b": Spend(8.0, 1e-5)}
    assert partial.with_final().charged_to(["a", "b"]).devices == {"a": Spend(1.0, 1e-5)}


def test_the_budget_refuses_a_run_that_would_take_a_device_over_it_naming_the_devices() -> None:
    ledger = Ledger({"one": RunSpend("one", {"a": Spend(8.0, 1e-5), "b": Spend(4.0, 1e-5)}, 8.0, 1e-5, 1, True)})
    # a: 8 spent + 8 planned = 16 <= 20; b: 12
    assert over_budget(ledger, ["a", "b", "c"], 20.0, Planned("next", 8.0)) is None
    # with a queued run of 8 before it: a would reach 24 > 20, b 20 (fits), c 16
    why = over_budget(ledger, ["a", "b", "c"], 20.0, Planned("next", 8.0), [Planned("queued", 8.0)])
    assert why is not None and "device(s) over" in why and "a (spent epsilon 8 (delta 1e-05); would reach 24)" in why
    assert "b (" not in why and "budget, epsilon 20" in why and "plan 8 more" in why
    # a run without DP is unbounded: refused under any budget
    why = over_budget(ledger, ["a"], 1000.0, Planned("plain", None))
    assert why is not None and "no differential privacy" in why


def test_a_fleet_runs_view_adds_its_spend_so_far_to_the_other_runs() -> None:
    view = FleetView("two", {"a": Spend(8.0, 1e-5)}, budget=20.0)
    now = view.now(RunSpend("two", {"a": Spend(1.0, 1e-5), "b": Spend(1.0, 1e-5)}))
    assert now["devices"] == {"a": {"epsilon": 9.0, "delta": 2e-5}, "b": {"epsilon": 1.0, "delta": 1e-5}}
    line = describe_fleet(now)
    assert line.startswith(
        "fleet privacy ledger (epsilons and deltas summed over runs, budget epsilon 20): a epsilon 9"
    )


@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan])
def test_a_budget_must_be_a_positive_number(value: float) -> None:
    from broker_server.ops.privacy_ledger import check_budget_value
    from protofl.errors import ConfigError

    with pytest.raises(ConfigError, match="--epsilon-budget must be a number > 0"):
        check_budget_value(value)

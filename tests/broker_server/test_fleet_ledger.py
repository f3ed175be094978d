"""A fleet's privacy ledger through the real commands (issue 58): `protofl-server fleet --epsilon-budget 20`, two
`protofl-edge join` processes, two runs with local DP (dp_epsilon=8, one round each) submitted with `run submit`;
then each device's summed epsilon in `devices list` and in the fleet's `status` (the last run's status.json), a
third run that would take both devices over the budget refused with their names (the queue unchanged), and the
ledger read again after the fleet was stopped and started."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from broker_server.ops.broker import free_port
from tests.broker_server.fleet_helpers import RUN_SETTINGS, Fleet, server_cli

DEVICES = ["device-1", "device-2"]
DP_RUN = ["--preset", "tinyproto", "--min-clients", "2", "--rounds", "1", "--set", 'archs=["mlp"]']
DP_RUN += ["--set", "dp_epsilon=8"]


def listed(fleet: Fleet) -> dict[str, str]:
    out = server_cli("devices", "list", "--fleet", str(fleet.state)).stdout.splitlines()
    return {line.split()[0]: line for line in out}


@pytest.mark.slow
@pytest.mark.mosquitto
def test_two_dp_runs_are_summed_per_device_an_over_budget_run_is_refused_and_the_ledger_survives_a_restart(
    tmp_path: Path,
) -> None:
    fleet = Fleet(tmp_path, free_port(), len(DEVICES), extra=["--epsilon-budget", "20"])
    try:
        fleet.start()
        for i, device in enumerate(DEVICES):
            fleet.join(device, i, len(DEVICES))
        fleet.submit("dp-1", *DP_RUN)
        fleet.submit("dp-2", *DP_RUN)
        fleet.wait_state("dp-2", "finished", 240)
        assert fleet.state_of("dp-1") == "finished", fleet.tail()
        # Each device took part in both runs: 8 (one round calibrated to the run's budget) twice, deltas summed.
        ledger = json.loads((fleet.state / "privacy-ledger.json").read_text())
        assert ledger["composition"] == "basic" and sorted(ledger["runs"]) == ["dp-1", "dp-2"]
        for device in DEVICES:
            spent = ledger["devices"][device]
            assert spent["epsilon"] == pytest.approx(16.0, abs=1e-3) and spent["delta"] == pytest.approx(2e-5)
        rows = listed(fleet)
        for device in DEVICES:
            assert "enrolled" in rows[device] and "epsilon 16 (delta 2e-05) of budget 20" in rows[device], rows
        # The fleet's status (the run it served last: dp-2's status.json) shows the same, that run included.
        status = fleet.state
        doc = json.loads(server_cli("status", "--state-dir", str(status), "--json").stdout)
        seen = doc["fleet_privacy"]
        assert seen["epsilon_budget"] == 20 and seen["run"] == "dp-2", seen
        assert all(seen["devices"][d]["epsilon"] == pytest.approx(16.0, abs=1e-3) for d in DEVICES), seen
        said = server_cli("status", "--state-dir", str(status)).stdout
        assert "fleet privacy ledger (epsilons and deltas summed over runs, budget epsilon 20)" in said, said
        # A third such run would take each device to 24 > 20: refused, naming them; nothing queued.
        before = server_cli("run", "list", "--fleet", str(fleet.state)).stdout
        refused = server_cli("run", "submit", "dp-3", "--fleet", str(fleet.state), *DP_RUN, *RUN_SETTINGS, check=False)
        assert refused.returncode == 2, refused
        for device in DEVICES:
            assert f"{device} (spent epsilon 16 (delta 2e-05); would reach 24)" in refused.stderr, refused.stderr
        assert "privacy budget, epsilon 20" in refused.stderr, refused.stderr
        assert not fleet.run_dir("dp-3").exists()
        assert server_cli("run", "list", "--fleet", str(fleet.state)).stdout == before
        # The ledger is the fleet's: stopped and started again, it still holds both runs.
        fleet.stop()
        fleet.start()
        rows = listed(fleet)
        assert all("epsilon 16 (delta 2e-05) of budget 20" in rows[d] for d in DEVICES), rows
    finally:
        fleet.stop()

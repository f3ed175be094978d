"""A fleet's run queue as a user drives it (issue 45): `protofl-server run stop` on a queued run and on a running
one, the next queued run then served by the same `protofl-edge join` processes, never restarted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from broker_server.broker import free_port
from tests.broker_server.fleet_helpers import Fleet, server_cli, wait_for

DEVICES = ["device-1", "device-2"]
TINY = ["--preset", "tinyproto", "--min-clients", "2", "--set", 'archs=["mlp"]']


def rounds_of(fleet: Fleet, run: str) -> list[dict[str, object]]:
    path = fleet.run_dir(run) / "rounds.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
@pytest.mark.mosquitto
def test_run_stop_on_a_queued_and_a_running_run_then_the_next_run_is_served(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, free_port(), len(DEVICES))
    try:
        fleet.start()
        agents = [fleet.join(device, i, len(DEVICES)) for i, device in enumerate(DEVICES)]
        fleet.submit("long", *TINY, "--rounds", "500")  # far more rounds than the test waits for
        fleet.submit("never", *TINY, "--rounds", "2")
        fleet.submit("next", *TINY, "--rounds", "2")
        # A queued run stopped: stopped at once, by the command alone.
        said = server_cli("run", "stop", "never", "--fleet", str(fleet.state)).stdout
        assert "run 'never': stopped" in said, said
        assert fleet.state_of("never") == "stopped"
        # A running run stopped once it has logged a round: the fleet stops its server.
        fleet.wait_state("long", "running", 60)
        wait_for(lambda: len(rounds_of(fleet, "long")) >= 1, 120, "a round of run 'long'", fleet.tail)
        said = server_cli("run", "stop", "long", "--fleet", str(fleet.state)).stdout
        assert "run 'long': stop asked" in said, said
        fleet.wait_state("long", "stopped", 60)
        again = server_cli("run", "stop", "long", "--fleet", str(fleet.state), check=False)
        assert again.returncode == 2 and "stopped already" in again.stderr, again.stderr
        # The next queued run starts (the stopped one is skipped) and the same devices serve it to its end.
        fleet.wait_state("next", "finished", 120)
        assert fleet.state_of("never") == "stopped" and not (fleet.run_dir("never") / "server.log").exists()
        assert len(rounds_of(fleet, "long")) < 500
        rows = rounds_of(fleet, "next")
        assert [r["round"] for r in rows] == [1, 2] and all(r["clients"] == DEVICES for r in rows), rows
        for device, agent in zip(DEVICES, agents, strict=True):
            assert agent.poll() is None, fleet.tail()
            text = (fleet.logs / f"{device}.log").read_text()
            assert "run 'long' ended (stopped)" in text and "run 'next' finished" in text, text[-3000:]
            assert "run 'never'" not in text, text[-3000:]
        listed = server_cli("run", "list", "--fleet", str(fleet.state)).stdout.splitlines()
        assert [line.split()[1:3] for line in listed] == [
            ["long", "stopped"],
            ["never", "stopped"],
            ["next", "finished"],
        ], listed
    finally:
        fleet.stop()

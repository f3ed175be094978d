"""A fleet's run queue as a user drives it (issue 45): `protofl-server run stop` on a queued run and on a running
one, the next queued run then served by the same `protofl-edge join` processes, never restarted."""

from __future__ import annotations

import json
import re
import urllib.request
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
        fleet.submit("long", *TINY, "--rounds", "500", "--ui-port", "0")  # far more rounds than the test waits for
        fleet.submit("never", *TINY, "--rounds", "2")
        fleet.submit("next", *TINY, "--rounds", "2")
        # A queued run stopped: stopped at once, by the command alone.
        said = server_cli("run", "stop", "never", "--fleet", str(fleet.state)).stdout
        assert "run 'never': stopped" in said, said
        assert fleet.state_of("never") == "stopped"
        # A running run stopped once it has logged a round: the fleet stops its server.
        fleet.wait_state("long", "running", 60)
        wait_for(lambda: len(rounds_of(fleet, "long")) >= 1, 120, "a round of run 'long'", fleet.tail)
        # Its live page links each device's log lines, which the fleet keeps (join --ship-logs).
        page = re.search(r"live page on (http://\S+/)", (fleet.run_dir("long") / "server.log").read_text())
        assert page is not None, fleet.tail()
        shipped = fleet.state / "device-logs" / "device-1.log"
        wait_for(lambda: shipped.exists() and "trained, uploaded" in shipped.read_text(), 60, "device-1's log lines")
        body = urllib.request.urlopen(page.group(1) + "logs/device-1", timeout=10).read().decode()
        assert "device-1: trained, uploaded" in body, body[-2000:]
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


TESTS = Path(__file__).resolve().parents[1]
MODEL_PKG, TECHNIQUE_PKG = TESTS / "external_model", TESTS / "external_technique"


@pytest.mark.slow
@pytest.mark.mosquitto
def test_a_device_that_cannot_serve_a_run_says_why_and_serves_the_next(tmp_path: Path) -> None:
    """device-1 has neither the model package nor the technique package that two runs use; device-2 has both. Each
    of those runs is served by device-2 alone; device-1 says why it cannot serve it (its log, its presence, which the
    run's server logs) and serves the third run with device-2, never restarted."""
    fleet = Fleet(tmp_path, free_port(), len(DEVICES), paths=(TECHNIQUE_PKG,))
    try:
        fleet.start()
        plain = fleet.join("device-1", 0, 2)
        fleet.join("device-2", 1, 2, paths=(MODEL_PKG, TECHNIQUE_PKG))
        one = ["--min-clients", "1", "--rounds", "2"]
        fleet.submit("model", "--preset", "tinyproto", "--set", 'archs=["tinynet"]', *one)
        fleet.submit("technique", "--preset", "fedproto-median", "--set", 'archs=["mlp"]', *one)
        fleet.submit("both", *TINY, "--rounds", "2")
        fleet.wait_state("both", "finished", 240)
        text = (fleet.logs / "device-1.log").read_text()
        assert "cannot serve run 'model'" in text and "unknown architecture 'tinynet'" in text, text[-3000:]
        assert "cannot serve run 'technique'" in text and "median_proto" in text, text[-3000:]
        assert "run 'both' finished" in text and plain.poll() is None, text[-3000:]
        # The runs' servers say why device-1 is not in them; the third run's server reads no stale refusal.
        said = {run: (fleet.run_dir(run) / "server.log").read_text() for run in ("model", "technique", "both")}
        assert "device device-1: cannot serve run 'model'" in said["model"], said["model"][-3000:]
        assert "device device-1: cannot serve run 'technique'" in said["technique"], said["technique"][-3000:]
        assert "cannot serve" not in said["both"], said["both"][-3000:]
        # And so does the device's own log, shipped to the fleet (protofl-server logs device-1).
        shown = server_cli("logs", "device-1", "--fleet", str(fleet.state)).stdout
        assert "cannot serve run 'model'" in shown and "cannot serve run 'technique'" in shown, shown[-3000:]
        for run, clients in (("model", ["device-2"]), ("technique", ["device-2"]), ("both", DEVICES)):
            rows = rounds_of(fleet, run)
            assert [r["round"] for r in rows] == [1, 2] and all(r["clients"] == clients for r in rows), (run, rows)
    finally:
        fleet.stop()

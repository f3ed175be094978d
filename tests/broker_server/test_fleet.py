"""A fleet that lives (issue 45): one `protofl-server fleet` process, its own secured Mosquitto and credentials,
three `protofl-edge join` processes started once with the files the fleet wrote, and two different runs submitted
with `protofl-server run submit`, served back to back; the fleet server killed with SIGKILL during the second."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from broker_server.broker import MosquittoBroker, free_port
from broker_server.durable import journal_records
from tests.broker_server.crash_helpers import env
from tests.broker_server.fleet_helpers import RUN_SETTINGS, Fleet, join_command, server_cli, wait_for

DEVICES = [f"device-{i}" for i in range(1, 4)]
SECOND = ["--preset", "fedproto", "--rounds", "3", "--min-clients", "3", "--set", 'archs=["cnn"]']


def model(state: Path) -> dict[str, np.ndarray]:
    with np.load(state / "server_model.npz", allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def reference(root: Path, url: str) -> list[subprocess.Popen[bytes]]:
    """The second run uninterrupted, as a plain `start` with the same settings and device ids."""
    root.mkdir()
    server = [sys.executable, "-m", "broker_server.cli", "start", "--broker", url, "--fed", "ref"]
    server += ["--state-dir", str(root / "state"), *SECOND, *RUN_SETTINGS]
    with (root / "server.log").open("ab") as out:
        procs = [subprocess.Popen(server, stdout=out, stderr=subprocess.STDOUT, env=env())]
    for i, device in enumerate(DEVICES):
        cmd = join_command(url, i, len(DEVICES), ["--fed", "ref", "--client-id", device])
        with (root / f"{device}.log").open("ab") as out:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env()))
    return procs


def run_server_pid(fleet_pid: int) -> int:
    """The fleet server's child that serves the current run (0 if none)."""
    try:
        kids = Path(f"/proc/{fleet_pid}/task/{fleet_pid}/children").read_text().split()
    except OSError:
        return 0
    for pid in map(int, kids):
        try:
            if b"--fleet-run" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    return 0


@pytest.mark.slow
@pytest.mark.mosquitto
def test_two_runs_back_to_back_on_one_fleet_and_a_kill_during_the_second(
    tmp_path: Path, mosquitto_module: MosquittoBroker
) -> None:
    ref = reference(tmp_path / "ref", mosquitto_module.url)
    fleet = Fleet(tmp_path, free_port(), len(DEVICES))
    try:
        fleet.start()
        agents = [fleet.join(device, i, len(DEVICES)) for i, device in enumerate(DEVICES)]
        fleet.submit("first", "--preset", "tinyproto", "--rounds", "2", "--min-clients", "3", "--set", 'archs=["mlp"]')
        fleet.submit("second", *SECOND)
        listed = server_cli("run", "list", "--fleet", str(fleet.state)).stdout
        assert "first" in listed and "second" in listed, listed
        fleet.wait_state("first", "finished", 180)
        # The second run is under way: device-3 frozen (SIGSTOP, not a restart) holds it mid-run, then the fleet
        # server and its run's server are killed with SIGKILL once the run's journal holds its inputs.
        fleet.wait_state("second", "running", 60)
        agents[2].send_signal(signal.SIGSTOP)
        journal = fleet.run_dir("second") / "aggregator"
        wait_for(lambda: len(journal_records(journal)) >= 2, 120, "the second run's journal", fleet.tail)
        assert fleet.server is not None
        child = run_server_pid(fleet.server.pid)
        fleet.server.send_signal(signal.SIGKILL)
        fleet.server.wait()
        wait_for(lambda: not Path(f"/proc/{child}/cmdline").exists() or child == 0, 30, "the run server's death")
        fleet.start()  # the same command again: the run it died under resumes
        agents[2].send_signal(signal.SIGCONT)
        fleet.wait_state("second", "finished", 180)
        for p in ref:
            assert p.wait(180) == 0, (tmp_path / "ref" / "server.log").read_text()[-3000:]
        # No device was restarted, and each served both runs and waits for the next.
        for device, agent in zip(DEVICES, agents):
            assert agent.poll() is None, fleet.tail()
            text = (fleet.logs / f"{device}.log").read_text()
            for run in ("first", "second"):
                assert f"run '{run}' finished" in text, text[-3000:]
        first, second = fleet.run_dir("first"), fleet.run_dir("second")
        for run_dir in (first, second):
            for path in ("server_model.npz", "artifacts/manifest.json", "rounds.jsonl", "report/summary.md"):
                assert (run_dir / path).exists(), path
        assert [json.loads(x)["preset"] for x in (first / "rounds.jsonl").read_text().splitlines()] == ["tinyproto"] * 2
        rows = [json.loads(x) for x in (second / "rounds.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == [1, 2, 3] and all(r["clients"] == DEVICES for r in rows), rows
        assert "resumed federation" in (second / "server.log").read_text()
        # Crash exact: the killed run ends with the uninterrupted run's model, every upload journaled once.
        uploads = [(r.client, r.round, r.kind) for r in journal_records(journal) if r.kind == "protos"]
        assert sorted(uploads) == sorted({(d, r, "protos") for d in DEVICES for r in (1, 2, 3)})
        got, want = model(second), model(tmp_path / "ref" / "state")
        assert sorted(got) == sorted(want)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
        listed = server_cli("run", "list", "--fleet", str(fleet.state)).stdout
        assert "first" in listed.split("\n")[0] and "finished" in listed, listed
    finally:
        fleet.stop()
        for p in ref:
            if p.poll() is None:
                p.kill()

"""A fleet's queue never sticks (issue 59, item 1), on one fleet and two `protofl-edge join` processes started once:
a run whose server is killed (kill -9 of the fleet's child `start`, as an OOM kill does) is failed and cleared, and
the next run is served (on main c4fa1ae the devices took the next run's config as the dead run's, and it sat at 0/2
until `run stop`); a run no device can serve fails with the devices' reasons in `run list` and `status`, and the
queue moves on; `run resume` serves the failed run again from its journal."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from broker_server.ops.broker import free_port
from tests.broker_server.fleet_helpers import Fleet, server_cli, wait_for

DEVICES = ["device-1", "device-2"]
KILLED_ROUNDS = 40
TINY = ["--preset", "tinyproto", "--min-clients", "2", "--set", 'archs=["mlp"]']


def rounds_of(fleet: Fleet, run: str) -> list[int]:
    path = fleet.run_dir(run) / "rounds.jsonl"
    return [json.loads(x)["round"] for x in path.read_text().splitlines()] if path.exists() else []


def run_server_pid(fleet: Fleet, run: str) -> int | None:
    """The pid of the fleet's child `start` serving `run` (its parent is the fleet server)."""
    assert fleet.server is not None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == fleet.server.pid and b"--fleet-run" in argv and argv[argv.index(b"--fleet-run") + 1] == run.encode():
            return int(entry.name)
    return None


@pytest.mark.slow
@pytest.mark.mosquitto
def test_a_killed_run_and_an_unservable_run_never_block_the_queue_and_a_failed_run_resumes(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, free_port(), len(DEVICES))
    try:
        fleet.start()
        for i, device in enumerate(DEVICES):
            fleet.join(device, i, len(DEVICES))
        fleet.submit("killed", *TINY, "--rounds", str(KILLED_ROUNDS))  # rounds enough to be killed in one
        fleet.submit("next", *TINY, "--rounds", "2")
        # A model no device has (tests/external_model is installed on none): every device says why it cannot serve.
        fleet.submit(
            "model", "--preset", "tinyproto", "--min-clients", "1", "--rounds", "2", "--set", 'archs=["tinynet"]'
        )
        fleet.wait_state("killed", "running", 60)
        wait_for(lambda: len(rounds_of(fleet, "killed")) >= 1, 180, "a round of run 'killed'", fleet.tail)
        pid = run_server_pid(fleet, "killed")
        assert pid is not None, fleet.tail()
        os.kill(pid, signal.SIGKILL)  # as the kernel's OOM killer does
        fleet.wait_state("killed", "failed", 30)
        # The next run is served by the same two devices (on main: 0/2 uploads until someone ran `run stop`).
        fleet.wait_state("next", "finished", 240)
        assert rounds_of(fleet, "next") == [1, 2], fleet.tail()
        # The run no device can serve fails, saying why, instead of holding the queue for ever.
        fleet.wait_state("model", "failed", 120)
        listed = server_cli("run", "list", "--fleet", str(fleet.state)).stdout
        assert "killed" in listed and "failed: its server exited with signal SIGKILL" in listed, listed
        assert "failed: no device can serve it: every enrolled device said why" in listed, listed
        assert "device-1: cannot serve run 'model'" in listed and "unknown architecture 'tinynet'" in listed, listed
        status = server_cli("status", "--state-dir", str(fleet.run_dir("model"))).stdout
        assert "refused by 2 member(s)" in status and "unknown architecture 'tinynet'" in status, status
        # The killed run, resumed: its server goes on from its journal (the round it logged is kept).
        said = server_cli("run", "resume", "killed", "--fleet", str(fleet.state)).stdout
        assert "run 'killed' queued again" in said, said
        again = server_cli("run", "resume", "next", "--fleet", str(fleet.state), check=False)
        assert again.returncode == 2 and "only a failed or stopped run can be resumed" in again.stderr, again.stderr
        fleet.wait_state("killed", "finished", 240)
        assert rounds_of(fleet, "killed") == list(range(1, KILLED_ROUNDS + 1)), fleet.tail()
        for device in DEVICES:
            text = (fleet.logs / f"{device}.log").read_text()
            assert "run 'killed' ended (failed)" in text, text[-3000:]
            assert "run 'next' finished" in text, text[-3000:]
            assert "cannot serve run 'model'" in text, text[-3000:]
        assert all(p.poll() is None for p in fleet.agents.values()), fleet.tail()
    finally:
        fleet.stop()

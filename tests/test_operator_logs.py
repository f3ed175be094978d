"""What an operator reads, through the real commands (issue 59, item 7): `protofl-server start` brings the broker and
the devices' credentials up first, then trains the shared backbone with a line an epoch (not minutes of silence
before anything exists); its broker line says this fleet's queue in real units; a device that took part in a
successful run ends it cleanly (no "lost connection ... reconnecting" when the server stops its broker)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from broker_server.ops.broker import free_port
from tests.broker_server.crash_helpers import env

DATA = "synthetic:n=600,size=12"


@pytest.mark.slow
@pytest.mark.mosquitto
def test_start_says_the_broker_then_the_backbone_epochs_and_a_device_ends_cleanly(tmp_path: Path) -> None:
    port, state = free_port(), tmp_path / "state"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker_server.cli",
            "start",
            "--preset",
            "protofl",
            "--public-data",
            DATA,
            "--set",
            "backbone_epochs=2",
            "--rounds",
            "1",
            "--min-clients",
            "1",
            "--round-timeout",
            "120",
            "--port",
            str(port),
            "--state-dir",
            str(state),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env(OMP_NUM_THREADS="1", PROTOFL_CACHE=""),
    )  # fmt: skip  (PROTOFL_CACHE empty: trained here, not taken from an earlier run's cache)
    lines: list[str] = []
    device = None
    try:
        assert server.stdout is not None
        for line in server.stdout:  # the credentials exist before the backbone is trained: the device starts now
            lines.append(line)
            if "credentials in" in line:
                device = subprocess.Popen(
                    [sys.executable, "-m", "edge_agent.cli", "join", "--broker", f"mqtt://127.0.0.1:{port}",
                     "--credentials", str(state / "security" / "devices" / "device-1.json"), "--data", DATA,
                     "--threads", "1", "--connect-timeout", "120"],
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(OMP_NUM_THREADS="1"),
                )  # fmt: skip
        assert server.wait(timeout=60) == 0, "".join(lines)
        assert device is not None, "".join(lines)
        said, _ = device.communicate(timeout=120)
    finally:
        for p in (server, device):
            if p is not None and p.poll() is None:
                p.kill()
    out = "".join(lines)
    order = [
        next(i for i, line in enumerate(lines) if what in line)
        for what in ("mosquitto listening", "credentials in", "training the shared backbone", "epoch 1/2 done")
    ]
    assert order == sorted(order), out
    assert "shared backbone: epoch 2/2 done" in out, out
    queue = next(line for line in lines if "the local broker queues" in line)
    assert "MiB" not in queue and "fleet of 1" in queue and " MB" in queue, queue
    assert device.returncode == 0, said
    assert "federation finished after 1 trained round(s)" in said, said
    assert "lost connection" not in said and "reconnecting" not in said, said


@pytest.mark.slow
@pytest.mark.mosquitto
def test_status_of_a_fleet_says_its_state(tmp_path: Path) -> None:
    from tests.broker_server.fleet_helpers import Fleet, server_cli, wait_for

    fleet = Fleet(tmp_path, free_port(), 1)
    try:
        fleet.start()
        idle = server_cli("status", "--state-dir", str(fleet.state))
        assert "idle, no run submitted yet" in idle.stdout, idle.stdout + idle.stderr
        fleet.submit("first", "--preset", "tinyproto", "--rounds", "1", "--min-clients", "1")
        fleet.wait_state("first", "running", 60)
        said = server_cli("status", "--state-dir", str(fleet.state))  # starting, or its server's own status
        assert "no server has run" not in said.stdout + said.stderr, said.stdout + said.stderr
        assert "run 'first' is starting" in said.stdout or "waiting" in said.stdout, said.stdout
        wait_for(lambda: (fleet.run_dir("first") / "status.json").is_file(), 60, "the run's status", fleet.tail)
        shown = server_cli("status", "--state-dir", str(fleet.state))
        assert "waiting" in shown.stdout, shown.stdout
    finally:
        fleet.stop()

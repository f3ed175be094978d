"""`protofl-server service install` and `protofl-edge service install` write systemd units that `systemd-analyze
verify` takes without a warning (it only warns about a bad line: any output fails the test), hardened to an exposure
of at most 4.0 by `systemd-analyze security --offline=yes` (systemd 252 and later read a unit file offline), with
absolute paths, a memory cap below the board's RAM, no restart after the memory watchdog's exit, and nothing written
for a missing credentials file or a data spec join refuses (issue 59, item 5)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from broker_server.ops.capacity import files_for_fleet

REPO = Path(__file__).resolve().parents[1]


def cli(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120
    )


def verify(unit: Path) -> None:
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stdout + done.stderr


def exposure(unit: Path) -> float:
    """`systemd-analyze security --offline=yes`'s overall exposure of a unit file (0 safest .. 10 unsafe)."""
    done = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", str(unit)], capture_output=True, text=True, timeout=60
    )
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout + done.stderr)
    assert found, done.stdout + done.stderr
    return float(found.group(1))


HARDENED = ("User=protofl", "NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes")


def device_files(where: Path) -> None:
    """What the device unit's join reads: its credentials file and an npz of its data."""
    (where / "device-1.json").write_text(json.dumps({"fed": "default", "username": "device-1", "password": "pw"}))
    np.savez(where / "local.npz", x_train=np.zeros((4, 1, 12, 12), np.uint8), y_train=np.arange(4) % 2)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze (the systemd package)")
def test_both_units_verify_and_carry_the_limits(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet"
    done = cli(
        "broker_server.cli", "service", "install", "--state-dir", str(fleet), "--out", str(tmp_path), "--max-devices",
        "5000", "--", "--listen", "0.0.0.0:1883", "--devices", "3", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    server = (tmp_path / "protofl-fleet.service").read_text()
    for line in (
        "Restart=on-failure",
        "WantedBy=multi-user.target",
        f"LimitNOFILE={files_for_fleet(5000) + 1024}",
        "--listen 0.0.0.0:1883",
        f"ReadWritePaths={fleet}",
        *HARDENED,
    ):
        assert line in server, server
    assert "chown -R protofl:" in done.stdout and "useradd --system" in done.stdout, done.stdout
    verify(tmp_path / "protofl-fleet.service")
    assert exposure(tmp_path / "protofl-fleet.service") <= 4.0
    device_files(tmp_path)
    done = cli(
        "edge_agent.cli", "service", "install", "--out", str(tmp_path), "--",
        "--credentials", "device-1.json", "--data", "npz:local.npz", "--profile", "rpi4", "--state-dir", "state",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    edge = (tmp_path / "protofl-edge.service").read_text()
    for line in (
        "Restart=on-failure",
        "RestartPreventExitStatus=3 4",  # the memory watchdog's exit (a restart would outgrow it again); revoked
        "WantedBy=multi-user.target",
        "MemoryMax=3584M",  # 7/8 of the Pi 4's 4096 MB: the rest is the OS's
        f"WorkingDirectory={tmp_path}",
        f"--credentials {tmp_path / 'device-1.json'} --data npz:{tmp_path / 'local.npz'}",
        f"--state-dir {tmp_path / 'state'}",
        f"ReadWritePaths={tmp_path / 'state'}",
        "PrivateDevices=yes",
        *HARDENED,
    ):
        assert line in edge, edge
    verify(tmp_path / "protofl-edge.service")
    assert exposure(tmp_path / "protofl-edge.service") <= 4.0


def test_a_unit_for_options_join_refuses_is_not_written(tmp_path: Path) -> None:
    done = cli("edge_agent.cli", "service", "install", "--out", str(tmp_path), "--", "--nope", "3", cwd=tmp_path)
    assert done.returncode == 2 and "No such option: --nope" in done.stderr, done.stderr
    assert not list(tmp_path.glob("*.service"))


def test_a_unit_for_missing_credentials_or_bad_data_is_not_written(tmp_path: Path) -> None:
    device_files(tmp_path)
    good = ["--credentials", "device-1.json", "--data", "npz:local.npz"]
    for args, said in (
        (["--credentials", "nope.json", "--data", "npz:local.npz"], "nope.json: No such file or directory"),
        (["--credentials", "local.npz", "--data", "npz:local.npz"], "not UTF-8 text"),
        ([*good[:2], "--data", "folder:/data/photos"], "unknown kind 'folder'"),
        ([*good[:2], "--data", "npz:missing.npz"], "missing.npz does not exist"),
    ):
        done = cli("edge_agent.cli", "service", "install", "--out", str(tmp_path), "--", *args, cwd=tmp_path)
        assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr, (args, done.stderr)
        assert not list(tmp_path.glob("*.service"))

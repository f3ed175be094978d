"""`protofl-server service install` and `protofl-edge service install` write systemd units that `systemd-analyze
verify` takes without a warning (it only warns about a bad line: any output fails the test)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

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
    ):
        assert line in server, server
    verify(tmp_path / "protofl-fleet.service")
    done = cli(
        "edge_agent.cli", "service", "install", "--out", str(tmp_path), "--",
        "--credentials", "device-1.json", "--data", "npz:/data/local.npz", "--profile", "rpi4", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    edge = (tmp_path / "protofl-edge.service").read_text()
    for line in ("Restart=on-failure", "WantedBy=multi-user.target", "MemoryMax=4096M", f"WorkingDirectory={tmp_path}"):
        assert line in edge, edge
    verify(tmp_path / "protofl-edge.service")


def test_a_unit_for_options_join_refuses_is_not_written(tmp_path: Path) -> None:
    done = cli("edge_agent.cli", "service", "install", "--out", str(tmp_path), "--", "--nope", "3", cwd=tmp_path)
    assert done.returncode == 2 and "No such option: --nope" in done.stderr, done.stderr
    assert not list(tmp_path.glob("*.service"))

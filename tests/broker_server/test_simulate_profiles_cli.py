"""`protofl-server simulate --profiles`: bad fleets are refused with the reason (exit 2), before any data loads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from broker_server.simulation import SimulationSpec, prepare
from protofl.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_an_unknown_profile_exits_2() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="250")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "broker_server.cli",
            "simulate",
            "--dataset",
            "synthetic",
            "--transport",
            "mqtt",
            "--profiles",
            "rpi9+lte:2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "profile 'rpi9' not found; known:" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_bad_fleets(tmp_path: Path) -> None:
    bad = tmp_path / "fast.toml"
    bad.write_text('kind = "link"\nuplink_kbps = 1\ndownlink_kbps = 1\nrtt_ms = 1\njitter_ms = 0\nloss = 0.1\n')
    mqtt: dict[str, Any] = dict(transport="mqtt", dataset="does-not-matter", clients=2)
    for spec, message in (
        (SimulationSpec(profiles=f"rpi4+{bad}:2", **mqtt), r"unknown key\(s\) \['loss'\]"),
        (SimulationSpec(profiles="rpi4+lte:2", clients=2), "add --transport mqtt"),
        (
            SimulationSpec(profiles="rpi4+lte:2", **{**mqtt, "clients": 3}),
            "--clients 3 but --profiles describes 2 devices",
        ),
        (SimulationSpec(profiles="rpi4+lte:2", time_scale=0, **mqtt), "--time-scale must be > 0"),
        (SimulationSpec(profiles="rpi4+lte:2", sample_cost_s=-1, **mqtt), "--sample-cost must be >= 0"),
        (SimulationSpec(sample_cost_s=0.01, **mqtt), "--sample-cost times a fleet's compute .*: add --profiles"),
    ):
        with pytest.raises(ConfigError, match=message):
            prepare(spec)

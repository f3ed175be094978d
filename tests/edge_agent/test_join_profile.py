"""`protofl-edge join --profile`: a bad profile exits 2 with what is wrong, before anything connects."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from edge_agent.join_cli import _emulation

REPO = Path(__file__).resolve().parents[2]


def join(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "edge_agent.cli",
        "join",
        "--broker",
        "mqtt://127.0.0.1:1",
        "--client-id",
        "d1",
        "--data",
        "synthetic",
        *args,
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def test_bad_profiles_exit_2_with_the_reason(tmp_path: Path) -> None:
    negative = tmp_path / "slow.toml"
    negative.write_text('kind = "link"\nuplink_kbps = -5\ndownlink_kbps = 1\nrtt_ms = 1\njitter_ms = 0\n')
    unknown = tmp_path / "odd.toml"
    unknown.write_text('kind = "device"\ncompute_factor = 1\nmemory_mb = 1\ncolour = "red"\n')
    for profile, message in (
        ("rpi9", "profile 'rpi9' not found; known: ethernet, "),
        (str(negative), "'uplink_kbps' must be > 0"),
        (str(unknown), "unknown key(s) ['colour']"),
        (str(tmp_path / "absent.toml"), "absent.toml' not found"),
    ):
        proc = join("--profile", profile)
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_profile_switches() -> None:
    em = _emulation("rpi4+nb-iot", True, 0.8, 50.0, True)
    assert em is not None and em.label == "rpi4+nb-iot" and em.adaptive and em.time_scale == 50.0
    assert _emulation("rpi4", True, 0.8, 1.0, False).adaptive is False  # type: ignore[union-attr]  # no link
    assert _emulation("", True, 0.8, 1.0, False) is None
    from protofl.errors import ConfigError

    with pytest.raises(ConfigError, match="--emulate-compute needs a device profile; 'lte' names only a link"):
        _emulation("lte", True, 0.8, 1.0, True)
    with pytest.raises(ConfigError, match="--upload-share must be in"):
        _emulation("lte", True, 1.5, 1.0, False)

"""A device profile's memory is a limit (issue 44): a simulated Raspberry Pi 3 given a model larger than its 1 GB
fails, saying the profile and the figure; the watchdog itself (edge_agent/core/memory.py) on this process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from edge_agent.core.memory import EXIT_OVER_MEMORY, MB, MemoryLimit, mark, peak_bytes, resident_bytes

REPO = Path(__file__).resolve().parents[2]


def test_a_model_too_large_for_an_rpi3_fails_in_simulation() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="250")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "broker_server.cli",
            "simulate",
            "--transport",
            "mqtt",
            "--profiles",
            "rpi3+ethernet:1",
            "--clients",
            "1",
            "--rounds",
            "1",
            "--preset",
            "fedproto",
            "--dataset",
            "synthetic",
            "--arch",
            "tests.edge_agent.huge_model:make",
            "--time-scale",
            "100",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "agent client-000 left: over the memory of device profile 'rpi3+ethernet'" in out, out
    assert "more than the profile's memory_mb 1024" in out and "Traceback" not in out, out


def test_the_watchdog_exits_once_the_peak_passes_the_limit() -> None:
    mark("test")
    assert 0 < resident_bytes() <= peak_bytes()
    exits: list[int] = []
    said: list[str] = []
    limit = MemoryLimit(peak_bytes() / MB - 1, "tiny", on_exceeded=said.append, exit=exits.append)
    assert limit.check() and exits == [EXIT_OVER_MEMORY]
    assert said and "device profile 'tiny'" in said[0] and "after 'test'" in said[0]
    assert not limit.check() and exits == [EXIT_OVER_MEMORY]  # said once
    roomy = MemoryLimit(peak_bytes() / MB + 4096, "roomy", exit=exits.append)
    assert not roomy.check() and roomy.exceeded is None
    with pytest.raises(ValueError, match="must be > 0"):
        MemoryLimit(0, "none")

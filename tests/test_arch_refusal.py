"""Issue 42, with the real commands: `start --preset fedavg --set archs=mlp` and a `join --arch cnn` - the device is
refused at its join and exits 2 saying which architecture the federation runs, and the server's log and `status`
name the drop's reason and device (on main the join was accepted and the device became a zombie)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker_server.ops.broker import free_port
from tests.test_deploy import DATA, ENV, join_process, start_process


@pytest.mark.slow
def test_a_device_of_another_arch_is_refused_at_join_and_exits_2(tmp_path: Path) -> None:
    port = free_port()
    server = start_process(
        port, "arch", tmp_path / "server", "--preset", "fedavg", "--set", "archs=mlp",
        "--rounds", "1", "--min-clients", "1", "--round-timeout", "60",
    )  # fmt: skip
    device = join_process(port, "arch", "odd", tmp_path / "odd", "--data", DATA, "--partition", "0/2", "--arch", "cnn")
    try:
        dev_out = device.communicate(timeout=180)[0]
        # status.json follows the server's state: wait until it has the drop (written after each step).
        status: subprocess.CompletedProcess[str] | None = None
        for _ in range(40):
            status = subprocess.run(
                [sys.executable, "-m", "broker_server.cli", "status", "--state-dir", str(tmp_path / "server")],
                capture_output=True,
                text=True,
                env=ENV,
                timeout=60,
            )
            if "wrong_arch" in status.stdout:
                break
            time.sleep(0.5)
    finally:
        server.terminate()
        server_out = server.communicate(timeout=60)[0]
        for p in (server, device):
            if p.poll() is None:
                p.kill()
    assert device.returncode == 2, dev_out
    assert "refused this device's join" in dev_out and "architecture 'mlp'" in dev_out, dev_out
    line = next((x for x in server_out.splitlines() if "wrong_arch" in x), "")
    assert "from odd" in line and "'mlp'" in line and "--arch cnn" in line, server_out
    assert status is not None
    assert "wrong_arch from odd" in status.stdout, (status.stdout, status.stderr)

"""`protofl-server start`'s own lifecycle (issue 24): a state dir that is a file, and a SIGTERM that reaches the
server and its spawned broker together (Ctrl-C, `kill` of the process group, a service manager)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from broker_server.broker import free_port

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")


def test_a_state_dir_that_is_a_file_is_a_clear_error(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.write_text("not a directory")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "broker_server.cli",
            "start",
            "--preset",
            "fedproto",
            "--port",
            "0",
            "--fed",
            "f",
            "--state-dir",
            str(state),
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert f"--state-dir {state} is a file; it takes a directory" in out.stderr
    assert "Traceback" not in out.stderr and state.read_text() == "not a directory"


def test_sigterm_to_the_process_group_stops_server_and_broker_without_a_restart(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker_server.cli",
            "start",
            "--preset",
            "fedproto",
            "--port",
            str(free_port()),
            "--fed",
            "term",
            "--state-dir",
            str(tmp_path / "state"),
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
    )
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:  # an event: the server says it is serving
        seen.append(line)
        if "aggregator for federation 'term'" in line:
            break
    else:
        raise AssertionError("".join(seen))
    os.killpg(proc.pid, signal.SIGTERM)  # the server and its mosquitto get it at once
    rest = proc.stderr.read()
    assert proc.wait(30) == 0, rest
    log = "".join(seen) + rest
    assert "stopping (signal 15)" in log
    assert "restarting it" not in log and "broker restarted" not in log, log

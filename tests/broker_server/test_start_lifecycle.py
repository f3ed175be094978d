"""`protofl-server start`'s own lifecycle (issue 24): a state dir that is a file, and a SIGTERM that reaches the
server and its spawned broker together (Ctrl-C, `kill` of the process group, a service manager); the modes of
the state files that name devices (issue 43)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker_server.ops.broker import free_port
from tests.conftest import EVENT_WAIT_S

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
# As a service unit runs it: buffered standard streams (a SIGTERM that lands while a log line is being written made
# the handler's own line raise "reentrant call" and lost the stop: protofl/signals.py).
BUFFERED = {k: v for k, v in ENV.items() if k != "PYTHONUNBUFFERED"}


def start_command(port: int, fed: str, state: Path) -> list[str]:
    """`protofl-server start` of the fedproto preset with a state dir, as an operator runs it."""
    return [
        sys.executable,
        "-m",
        "broker_server.cli",
        "start",
        "--preset",
        "fedproto",
        "--port",
        str(port),
        "--fed",
        fed,
        "--state-dir",
        str(state),
    ]


def test_a_state_dir_that_is_a_file_is_a_clear_error(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.write_text("not a directory")
    out = subprocess.run(
        start_command(0, "f", state),
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert f"--state-dir {state} is a file; it takes a directory" in out.stderr
    assert "Traceback" not in out.stderr and state.read_text() == "not a directory"


@pytest.mark.parametrize("streams", ["unbuffered", "buffered-1", "buffered-2", "buffered-3"])
def test_sigterm_to_the_process_group_stops_server_and_broker_without_a_restart(tmp_path: Path, streams: str) -> None:
    # The signal lands right after the server's line, while it may still be writing: buffered (3 tries: the race
    # was lost about one time in three before the fix) and unbuffered.
    proc = subprocess.Popen(
        start_command(free_port(), "term", tmp_path / "state"),
        stderr=subprocess.PIPE,
        text=True,
        env=ENV if streams == "unbuffered" else BUFFERED,
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
    assert proc.wait(EVENT_WAIT_S) == 0, rest
    log = "".join(seen) + rest
    assert "stopping (signal 15)" in log
    assert "restarting it" not in log and "broker restarted" not in log, log


def test_status_and_rounds_are_0600_in_a_0700_state_dir(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    state.chmod(0o755)  # made by hand, readable by all: start narrows it
    (state / "rounds.jsonl").touch(mode=0o644)
    (state / "rounds.jsonl").chmod(0o644)
    proc = subprocess.Popen(
        start_command(free_port(), "modes", state), stderr=subprocess.DEVNULL, env=ENV, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60
        while not (state / "status.json").exists():
            assert proc.poll() is None, "start exited"
            assert time.monotonic() < deadline, "no status.json in 60 s"
            time.sleep(0.2)
        modes = {p: stat.S_IMODE((state / p).stat().st_mode) for p in ("", "status.json", "rounds.jsonl")}
        assert modes == {"": 0o700, "status.json": 0o600, "rounds.jsonl": 0o600}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(EVENT_WAIT_S) == 0

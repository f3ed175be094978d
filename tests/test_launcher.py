"""The test launcher (tests/launcher.py) starts this project's commands as real processes that behave as a fresh
interpreter's would: their own pid, environment, working directory, streams, exit status and signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import launcher

PROBE = [sys.executable, "-m", "tests.launcher_probe"]
ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(os.environ.get(launcher.DISABLE) == "1", reason=f"{launcher.DISABLE}=1")


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def test_a_command_gets_its_own_process_environment_directory_and_streams(tmp_path: Path) -> None:
    assert subprocess.Popen is launcher.LaunchingPopen  # installed by tests/conftest.py
    cpu_before = launcher.launched_cpu_s()
    proc = subprocess.run(
        [*PROBE, "7"], input="from stdin", capture_output=True, text=True, cwd=tmp_path, env=_env(PROBE="yes")
    )
    assert proc.returncode == 7, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["ppid"] != os.getpid()  # forked by the launcher, not by this worker
    assert seen["cwd"] == str(tmp_path) == seen["path0"]
    assert seen["argv"][1:] == ["7"] and seen["argv"][0].endswith("launcher_probe.py")
    assert seen["probe"] == "yes" and seen["stdin"] == "from stdin" and seen["extra_path"]
    assert seen["torch"]  # what it saves: torch was imported before the fork
    assert proc.stderr == "thread done\n"  # the exit waited for the non-daemon thread, as an interpreter's does
    assert launcher.launched_cpu_s() > cpu_before  # its CPU counted for bench/suite_profile.py


def test_signals_reach_the_command_itself(tmp_path: Path) -> None:
    proc = subprocess.Popen([*PROBE, "wait"], stdout=subprocess.PIPE, text=True, cwd=tmp_path, env=_env())
    assert proc.stdout is not None and proc.stdout.readline() == "waiting\n"
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.1)
    os.kill(proc.pid, signal.SIGKILL)  # the pid is the command's own
    assert proc.wait(timeout=60) == -signal.SIGKILL
    other = subprocess.Popen([*PROBE, "wait"], stdout=subprocess.PIPE, text=True, cwd=tmp_path, env=_env())
    assert other.stdout is not None and other.stdout.readline() == "waiting\n"
    other.send_signal(signal.SIGINT)  # KeyboardInterrupt, then killed by SIGINT, as an interpreter exits
    assert other.wait(timeout=60) == -signal.SIGINT


def test_what_the_launcher_cannot_reproduce_starts_the_ordinary_way(tmp_path: Path) -> None:
    proc = subprocess.run([*PROBE, "0"], capture_output=True, text=True, cwd=tmp_path, env=_env(PROTOFL_CRASH_X="1"))
    seen = json.loads(proc.stdout)
    assert proc.returncode == 0 and seen["ppid"] == os.getpid() and not seen["torch"]
    # a folder the launcher did not import from (it may hide torch, or hold a plugin's entry points)
    other = _env(PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    proc = subprocess.run([*PROBE, "0"], capture_output=True, text=True, cwd=tmp_path, env=other)
    assert json.loads(proc.stdout)["ppid"] == os.getpid()
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getppid())"], capture_output=True, text=True)
    assert int(proc.stdout) == os.getpid()  # not one of this project's modules

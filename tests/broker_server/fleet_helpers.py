"""A fleet as real processes for the fleet tests: one `protofl-server fleet` (its own secured Mosquitto), `run
submit` through the command line, and `protofl-edge join` processes with the credentials the fleet wrote."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.broker_server.crash_helpers import DATA, REPO, SMALL_MODEL, env
from tests.pipelines import NO_FLOOR, as_cli_sets

# Small runs on the crash tests' synthetic data: 12x12 images, a 20-d prototype.
# the step floor off (tests/pipelines.py NO_FLOOR): the fleet's operations are the point, not how much a device trains
RUN_SETTINGS = ["--round-timeout", "120", *as_cli_sets(NO_FLOOR), *SMALL_MODEL]


def server_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "broker_server.cli", *args], capture_output=True, text=True, env=env(), timeout=120
    )
    if check and done.returncode != 0:
        raise AssertionError(f"protofl-server {' '.join(args)}: exit {done.returncode}\n{done.stdout}\n{done.stderr}")
    return done


def join_command(url: str, i: int, clients: int, who: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "edge_agent.cli",
        "join",
        "--broker",
        url,
        *who,
        "--data",
        DATA,
        "--partition",
        f"{i}/{clients}",
        "--alpha",
        "1.0",
        "--seed",
        "4",
        "--threads",
        "1",
        "--device",
        "cpu",
        "--connect-timeout",
        "60",
    ]


def wait_for(pred: Callable[[], object], timeout: float, what: str, logs: Callable[[], str] = lambda: "") -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{logs()}")
        time.sleep(0.05)


def env_with(paths: tuple[Path, ...]) -> dict[str, str]:
    """The processes' environment with these packages on the path too, as if pip-installed there."""
    return env(PYTHONPATH=os.pathsep.join([str(REPO), *map(str, paths)]))


class Fleet:
    def __init__(
        self, root: Path, port: int, devices: int, extra: list[str] | None = None, paths: tuple[Path, ...] = ()
    ) -> None:
        self.extra = extra or []
        self.paths = paths  # packages installed on the server (the runs' servers inherit them)
        self.state, self.logs, self.port, self.devices = root / "fleet", root / "logs", port, devices
        self.logs.mkdir(parents=True, exist_ok=True)
        self.server: subprocess.Popen[bytes] | None = None
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.url = f"mqtt://127.0.0.1:{port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "broker_server.cli", "fleet", "--state-dir", str(self.state)]
        cmd += ["--port", str(self.port), "--devices", str(self.devices), *self.extra]
        with (self.logs / "fleet.log").open("ab") as out:
            self.server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env_with(self.paths))
        wait_for(lambda: self.credentials("device-1").exists(), 60, "the fleet's credentials", self.tail)

    def credentials(self, device: str) -> Path:
        return self.state / "security" / "devices" / f"{device}.json"

    def join(self, device: str, i: int, clients: int, paths: tuple[Path, ...] = ()) -> subprocess.Popen[bytes]:
        """`protofl-edge join` as `device`, with the packages in `paths` installed on it."""
        cmd = join_command(
            self.url, i, clients, ["--credentials", str(self.credentials(device)), "--ship-logs", "info"]
        )
        with (self.logs / f"{device}.log").open("ab") as out:
            self.agents[device] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env_with(paths))
        return self.agents[device]

    def submit(self, name: str, *args: str) -> None:
        server_cli("run", "submit", name, "--fleet", str(self.state), *args, *RUN_SETTINGS)

    def run_dir(self, name: str) -> Path:
        return self.state / "runs" / name

    def state_of(self, name: str) -> str:
        try:
            return (self.run_dir(name) / "state").read_text().strip()
        except OSError:
            return ""

    def wait_state(self, name: str, state: str, timeout: float) -> None:
        wait_for(lambda: self.state_of(name) == state, timeout, f"run {name} {state}", self.tail)

    def tail(self) -> str:
        parts = [f"== {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in sorted(self.logs.glob("*.log"))]
        parts += [
            f"== {p.parent.name}/server.log\n{p.read_text(errors='replace')[-2500:]}"
            for p in sorted((self.state / "runs").glob("*/server.log"))
        ]
        return "\n".join(parts)

    def stop(self) -> None:
        for p in [*self.agents.values(), self.server]:
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

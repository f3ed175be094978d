"""A whole federation as real processes for the crash tests: one `protofl-server start` process (killed
and restarted by the test) and N `protofl-edge join` processes, all small enough for a 2-core CI box."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tests.pipelines import ADAPTER_PIPELINE, as_cli_sets

REPO = Path(__file__).resolve().parents[2]
DATA = "synthetic:n=400,n_test=20,size=12"
# Small models on DATA's 12x12 images: a 20-d prototype, rank-2 adapters (the fleet tests' runs too).
SMALL_MODEL = [
    "--set",
    "in_shape=[1,12,12]",
    "--set",
    "proto_dim=20",
    "--set",
    "adapter_rank=2",
    "--set",
    "batch_size=50",
    "--seed",
    "4",
]
# APUD sparse adapters and CPS-scaled prototypes (tests/pipelines.py), every upload kind of a round.
SETTINGS = [*as_cli_sets(ADAPTER_PIPELINE), "--set", 'archs=["mlp"]', *SMALL_MODEL]


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("PROTOFL_CRASH")}
    return {**e, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **extra}


class Federation:
    def __init__(
        self,
        fed: str,
        clients: int,
        rounds: int,
        state: Path,
        logs: Path,
        *,
        broker_url: str | None = None,
        port: int | None = None,
        device_state: Path | None = None,
        secured: bool = False,
        offline_grace: float | None = 300.0,
    ) -> None:
        self.fed, self.clients, self.rounds, self.state, self.logs = fed, clients, rounds, state, logs
        self.broker_url = broker_url
        self.port = port
        self.url = broker_url or f"mqtt://127.0.0.1:{port}"
        self.server: subprocess.Popen[bytes] | None = None
        self.agents: list[subprocess.Popen[bytes]] = []
        self.device_state = device_state  # --state-dir of the devices (their local checkpoints)
        self.starts = 0
        # secured: the default `start` a user runs (its own Mosquitto, generated credentials, devices join
        # with their devices/<id>.json); else --insecure on `port`, or an external broker.
        self.secured = secured
        # A killed device keeps its place until it is back (the device test restarts one); None: the default.
        self.offline_grace = offline_grace
        logs.mkdir(parents=True, exist_ok=True)

    def server_args(self) -> list[str]:
        if self.broker_url:
            where = ["--broker", self.broker_url]
        else:
            where = ["--port", str(self.port)] if self.secured else ["--insecure", "--port", str(self.port)]
        grace = [] if self.offline_grace is None else ["--offline-grace", str(self.offline_grace)]
        return [
            sys.executable,
            "-m",
            "broker_server.cli",
            "start",
            *where,
            "--fed",
            self.fed,
            "--preset",
            "protofl",
            "--rounds",
            str(self.rounds),
            "--min-clients",
            str(self.clients),
            "--round-timeout",
            "300",
            *grace,
            "--state-dir",
            str(self.state),
            "--connect-timeout",
            "30",
            "--verbose",
            *SETTINGS,
        ]

    def client_id(self, i: int) -> str:
        return f"device-{i + 1}" if self.secured else f"dev-{i:02d}"

    def start_server(self, **extra_env: str) -> subprocess.Popen[bytes]:
        self.starts += 1
        with (self.logs / "server.log").open("ab") as out:
            out.write(f"\n==== start {self.starts} {extra_env} ====\n".encode())
            out.flush()
            self.server = subprocess.Popen(
                self.server_args(), stdout=out, stderr=subprocess.STDOUT, env=env(**extra_env)
            )
        return self.server

    def kill_server(self) -> None:
        assert self.server is not None
        self.server.send_signal(signal.SIGKILL)
        self.server.wait()

    def start_agents(self) -> None:
        self.agents = [self.start_agent(i) for i in range(self.clients)]

    def start_agent(self, i: int) -> subprocess.Popen[bytes]:
        who = (
            ["--credentials", str(self.state / "security" / "devices" / f"{self.client_id(i)}.json")]
            if self.secured
            else ["--fed", self.fed, "--client-id", self.client_id(i)]
        )
        cmd = [
            sys.executable,
            "-m",
            "edge_agent.cli",
            "join",
            "--broker",
            self.url,
            *who,
            "--data",
            DATA,
            "--partition",
            f"{i}/{self.clients}",
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
        if self.device_state is not None:
            cmd += ["--state-dir", str(self.device_state)]
        with (self.logs / f"{self.client_id(i)}.log").open("ab") as out:
            return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env())

    def wait_finished(self, timeout: float) -> None:
        """The server and every device exit 0 (the federation finished), or AssertionError with logs."""
        end = time.monotonic() + timeout
        for p in [self.server, *self.agents]:
            assert p is not None
            try:
                rc = p.wait(max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = None
            if rc != 0:
                raise AssertionError(
                    f"{' '.join(p.args[2:5])} ended with {rc}; server log tail:\n"  # type: ignore
                    f"{self.log_tail()}"
                )

    def log_tail(self, n: int = 4000) -> str:
        return (self.logs / "server.log").read_text(errors="replace")[-n:]

    def stop(self) -> None:
        for p in [self.server, *self.agents]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()

    def model(self) -> dict[str, np.ndarray]:
        with np.load(self.state / "server_model.npz", allow_pickle=False) as z:
            return {k: z[k] for k in z.files}

"""Helpers for the broker tests: a watcher of a federation's retained topics, a service in a thread, `start` and
one `join` as processes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from broker_server.service import AggregatorService
from protofl import topics
from protofl.transport.mqtt import Backoff, MqttTransport
from protofl.wire import RoundStart, Status, decode_message


def fast_backoff() -> Backoff:
    return Backoff(initial=0.1, maximum=1.0)


class Watcher:
    """Follows `round`, `presence/+` and `server/status` of one federation from its own connection."""

    def __init__(self, url: str, fed: str) -> None:
        self.rounds: list[tuple[int, str]] = []
        self.presence: dict[str, list[str]] = {}
        self.server: list[str] = []
        self._lock = threading.Lock()
        self.transport = MqttTransport(url, f"watcher-{fed}", backoff=fast_backoff()).connect(10)
        self.transport.subscribe(topics.round_(fed), self._on)
        self.transport.subscribe(f"{topics.ROOT}/{fed}/presence/+", self._on)
        self.transport.subscribe(topics.server_status(fed), self._on)

    def _on(self, topic: str, payload: bytes) -> None:
        env, msg = decode_message(payload)
        with self._lock:
            if isinstance(msg, RoundStart):
                self.rounds.append((env.round, env.phase))
            elif isinstance(msg, Status) and topic.endswith("server/status"):
                self.server.append(msg.state)
            elif isinstance(msg, Status):
                self.presence.setdefault(topics.client_of(topic), []).append(msg.state)

    def wait(self, pred: Callable[[Watcher], bool], timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                if pred(self):
                    return
            time.sleep(0.01)
        raise AssertionError(
            f"timed out after {timeout} s waiting for {what}; rounds {self.rounds}, "
            f"presence {self.presence}, server {self.server}"
        )

    def close(self) -> None:
        self.transport.close()


class ServiceThread:
    """`AggregatorService.run()` on a background thread; `join()` re-raises what it raised."""

    def __init__(self, service: AggregatorService, timeout: float) -> None:
        self.service = service
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(timeout,), daemon=True)

    def _run(self, timeout: float) -> None:
        try:
            self.service.run(timeout=timeout)
        except BaseException as exc:  # noqa: BLE001 - re-raised in join()
            self.error = exc

    def start(self) -> ServiceThread:
        self.service.start(connect_timeout=10)
        self.thread.start()
        return self

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.service.stop()
            self.thread.join(5)
            raise AssertionError(
                f"the service did not finish within {timeout} s (round {self.service.aggregator.round})"
            )
        if self.error is not None:
            raise self.error


def start_and_join(
    tmp_path: Path,
    fed: str,
    data: str,
    *,
    classes: int = 3,
    shape: str = "3,16,16",
    timeout: float = 120,
    rounds: int = 1,
    server_extra: Sequence[str] = (),
) -> tuple[int | None, str, int | None, str]:
    """`protofl-server start` (its own mosquitto, `rounds` rounds of fedproto, 1 client; `server_extra`: more of its
    options) and one `protofl-edge join --data DATA` as processes: (device exit code, its output, server exit code,
    its output); a device still running after `timeout` is killed (code None), and then so is the server."""
    from broker_server.ops.broker import free_port

    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    server_args = ["start", "--local-broker", "mosquitto", "--insecure", "--port", str(port), "--fed", fed]
    server_args += ["--preset", "fedproto", "--rounds", str(rounds), "--min-clients", "1", "--round-timeout", "60"]
    server_args += ["--set", f"num_classes={classes}", "--set", f"in_shape={shape}"]
    server_args += ["--state-dir", str(tmp_path / "state"), *server_extra]

    def command(module: str, args: list[str]) -> subprocess.Popen[str]:
        run = [sys.executable, "-m", module, *args]
        return subprocess.Popen(run, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)

    server = command("broker_server.cli", server_args)
    join_args = ["join", "--broker", f"mqtt://127.0.0.1:{port}", "--fed", fed, "--client-id", "cam-1"]
    join_args += ["--data", data, "--arch", "mlp", "--threads", "1", "--connect-timeout", "60"]
    device = command("edge_agent.cli", join_args)
    try:
        try:
            dev_out, _ = device.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            device.kill()
            return None, device.communicate()[0], None, ""
        if device.returncode != 0:  # the server would wait for it: not worth waiting for
            server.kill()
        out, _ = server.communicate(timeout=60)
    finally:
        for p in (server, device):
            if p.poll() is None:
                p.kill()
    return device.returncode, dev_out, server.returncode, out

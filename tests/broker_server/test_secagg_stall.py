"""No member stalls secure aggregation (issue 58), through real `protofl-server start` and `protofl-edge join`
processes on Mosquitto, with a hostile member that is a small client in this test speaking the wire itself (honest
keys, then what it likes).

- A member whose share boxes (right count, right length) decrypt at no neighbour: every honest neighbour names it
  in its masked input and stays in; the server leaves it out of the sum, says so at WARNING, and both rounds
  complete at their quorums (on main the honest devices dropped out and the masked step waited for ever).
- A device SIGKILLed mid-phase (after its shares) and restarted, with --min-clients the whole fleet, and the server
  SIGKILLed and restarted in the same phase (its journal replays into the masked step): the step closes at its
  deadline, the round folds nothing and says so, and the next round completes with the restarted device.
- A member's right-length garbage masked vector: the unmasked sum is refused with a WARNING naming the round, the
  global prototypes kept (on main it was folded, logged at INFO)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from broker_server.ops.broker import MosquittoBroker
from edge_agent.core.secagg_device import DeviceSecAgg
from protofl import topics
from protofl.config import FederationConfig
from protofl.plan import RoundPlan
from protofl.transport.mqtt import MqttTransport
from protofl.wire import Config, Join, Message, RoundStart, SaMasked, SaShares, decode_message, encode_message
from tests.broker_server.mqtt_helpers import Watcher, fast_backoff

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
HOSTILE = "device-4"
WAIT_S = 300  # the whole federation's, on a loaded machine (each phase's deadline is far shorter)

pytestmark = [pytest.mark.slow, pytest.mark.mosquitto]


def _start(
    url: str, fed: str, state: Path, log: Path, *, rounds: int, min_clients: int, timeout: int
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "broker_server.cli", "start", "--broker", url, "--fed", fed, "--preset", "tinyproto"]
    cmd += ["--rounds", str(rounds), "--min-clients", str(min_clients), "--round-timeout", str(timeout)]
    cmd += [
        "--clip",
        "off",
        "--set",
        "secagg=true",
        "--set",
        'archs=["mlp"]',
        "--set",
        "in_shape=1,12,12",
        "--state-dir",
        str(state),
        "--verbose",
    ]
    with log.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=ENV)


def _join(url: str, fed: str, client: str, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "edge_agent.cli", "join", "--broker", url, "--fed", fed, "--client-id", client]
    cmd += ["--data", "synthetic:n=120,size=12", "--threads", "1", "--connect-timeout", "60"]
    with log.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=ENV)


class Hostile:
    """A member speaking the wire with its own connection: honest keys each round; `garble`: share boxes of the
    right count and length that decrypt at no neighbour; `garbage_round`: in that round, a right-length random
    masked vector (every other answer the honest device half's, `DeviceSecAgg`, masking an empty table)."""

    def __init__(self, url: str, fed: str, *, garble: bool = False, garbage_round: int = 0) -> None:
        self.fed, self.garble, self.garbage_round = fed, garble, garbage_round
        self.plan: RoundPlan | None = None
        self.runs: dict[int, DeviceSecAgg] = {}
        self.t = MqttTransport(url, "hostile", backoff=fast_backoff()).connect(30)
        self.t.subscribe(topics.config(fed), self._config)
        self.t.subscribe(topics.round_(fed), self._round)
        self.t.subscribe(topics.down(fed, HOSTILE), self._down)

    def send(self, msg: Message, round_: int = 0, phase: str = "") -> None:
        self.t.publish(
            topics.up(self.fed, HOSTILE), encode_message(msg, fed=self.fed, sender=HOSTILE, round=round_, phase=phase)
        )

    def _config(self, topic: str, payload: bytes) -> None:
        msg = decode_message(payload)[1]
        assert isinstance(msg, Config)
        self.plan = RoundPlan.from_config(FederationConfig.from_dict(dict(msg.params)))
        self.send(Join(arch="", n_samples=20, profile="", agent_version="hostile"))

    def _round(self, topic: str, payload: bytes) -> None:
        env, msg = decode_message(payload)
        if not isinstance(msg, RoundStart) or msg.final or env.phase != "train" or env.round in self.runs:
            return
        self.runs[env.round] = run = DeviceSecAgg(HOSTILE, self.fed, env.round, env.phase, None)
        # (its keys a second after the round opened: the honest devices, which train first, are in by then)
        threading.Timer(1.0, self.send, (run.keys(), env.round, env.phase)).start()

    def _down(self, topic: str, payload: bytes) -> None:
        env, msg = decode_message(payload)
        run, plan = self.runs.get(env.round), self.plan
        if run is None or plan is None:
            return
        out = run.answer(msg, plan.num_classes, plan.proto_width)
        if isinstance(out, SaShares) and self.garble:
            out = SaShares([os.urandom(len(b)) for b in out.boxes])
        if isinstance(out, SaMasked) and env.round == self.garbage_round:
            out = SaMasked(
                np.asarray(np.random.default_rng(env.round).integers(0, 2**32, out.y.shape[0], dtype=np.uint32))
            )
        if out is not None:
            self.send(out, env.round, env.phase)


def _wait(proc: subprocess.Popen[bytes], log: Path) -> None:
    try:
        rc = proc.wait(WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the federation did not finish in {WAIT_S}s (a stall):\n{log.read_text()[-4000:]}")
    assert rc == 0, log.read_text()[-4000:]


def _stop(*procs: subprocess.Popen[bytes]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(30)


def _fleet(url: str, fed: str, tmp: Path, names: list[str]) -> dict[str, subprocess.Popen[bytes]]:
    """`protofl-edge join` processes, started before the server and waited for (their presence online), so that
    every one of them is a member when round 1 opens."""
    watch = Watcher(url, fed)
    devices = {c: _join(url, fed, c, tmp / f"{c}.log") for c in names}
    try:
        watch.wait(lambda w: all(c in w.presence for c in names), WAIT_S, "the devices online")
    finally:
        watch.close()
    return devices


def test_a_member_whose_boxes_do_not_decrypt_is_named_and_left_out(mosquitto: MosquittoBroker, tmp_path: Path) -> None:
    fed, log = "stall-boxes", tmp_path / "server.log"
    devices = _fleet(mosquitto.url, fed, tmp_path, ["device-1", "device-2", "device-3"])
    hostile = Hostile(mosquitto.url, fed, garble=True)
    server = _start(mosquitto.url, fed, tmp_path / "state", log, rounds=2, min_clients=2, timeout=30)
    try:
        _wait(server, log)
    finally:
        hostile.t.close()
        _stop(server, *devices.values())
    said = log.read_text()
    for r in (1, 2):  # every member is in both rounds: the three honest devices name device-4 and it is left out
        assert f"round {r} secure aggregation: {HOSTILE} is left out of the sum: its shares do not decrypt at 3" in said
        assert f"round {r} secure aggregation: unmasked the sum of 3 device(s)" in said, said[-4000:]
    assert "waiting another" not in said, said[-4000:]
    for c in devices:
        dev = (tmp_path / f"{c}.log").read_text()
        assert f"the share from {HOSTILE} does not decrypt; naming it to the server" in dev, dev[-3000:]


def test_a_device_and_the_server_restarted_mid_phase_do_not_stall_it(
    mosquitto: MosquittoBroker, tmp_path: Path
) -> None:
    # --min-clients the whole fleet; device-3 SIGKILLed as its shares go out (before its masked input), the server
    # SIGKILLed at the same moment, both restarted: the server's journal replays into the open step, which waits
    # for a device that lost its keys; at its deadline the phase closes, and round 2 runs with all three.
    fed, state, log = "stall-restart", tmp_path / "state", tmp_path / "server.log"
    start = {"rounds": 2, "min_clients": 3, "timeout": 20}
    devices = _fleet(mosquitto.url, fed, tmp_path, ["device-1", "device-2", "device-3"])
    server = _start(mosquitto.url, fed, state, log, **start)
    killed = threading.Event()

    def on_up(topic: str, payload: bytes) -> None:
        if decode_message(payload)[0].kind == "sa_shares2" and not killed.is_set():
            devices["device-3"].send_signal(signal.SIGKILL)
            server.send_signal(signal.SIGKILL)
            killed.set()

    spy = MqttTransport(mosquitto.url, "spy", backoff=fast_backoff()).connect(30)
    spy.subscribe(topics.up(fed, "device-3"), on_up)
    try:
        assert killed.wait(WAIT_S), log.read_text()[-4000:]
        devices["device-3"].wait(30)
        server.wait(30)
        devices["device-3"] = _join(mosquitto.url, fed, "device-3", tmp_path / "device-3.log")
        server = _start(mosquitto.url, fed, state, log, **start)
        _wait(server, log)
    finally:
        spy.close()
        _stop(server, *devices.values())
    said = log.read_text()
    assert re.search(r"round 1 secure aggregation: .*; the phase closes without folding", said), said[-4000:]
    assert "round 2 secure aggregation: unmasked the sum of 3 device(s)" in said, said[-4000:]
    assert "waiting another" not in said, said[-4000:]


def test_a_garbage_masked_vector_is_refused_and_the_round_named(mosquitto: MosquittoBroker, tmp_path: Path) -> None:
    fed, log = "stall-garbage", tmp_path / "server.log"
    devices = _fleet(mosquitto.url, fed, tmp_path, ["device-1", "device-2"])
    hostile = Hostile(mosquitto.url, fed, garbage_round=2)
    server = _start(mosquitto.url, fed, tmp_path / "state", log, rounds=2, min_clients=3, timeout=30)
    try:
        _wait(server, log)
    finally:
        hostile.t.close()
        _stop(server, *devices.values())
    said = log.read_text()
    assert "round 1 secure aggregation: unmasked the sum of 3 device(s)" in said, said[-4000:]
    want = "round 2 secure aggregation: the unmasked sum of 3 device(s) is not one their clipped inputs can give"
    assert want in said and "round 2 secure aggregation: unmasked" not in said, said[-4000:]
    with np.load(tmp_path / "state" / "server_model.npz", allow_pickle=False) as z:
        kept = z["prototypes"]
    assert np.isfinite(kept).all() and np.abs(kept).max() < 100, np.abs(kept).max()  # round 1's, not garbage

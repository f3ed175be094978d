"""The threshold of secure aggregation through real processes (issue 58): Mosquitto, real `protofl-edge join` devices.

1. A server that sends a minority threshold: the aggregator as `start` runs it, whose rosters a lying transport
   rewrites to t = 1 with the real wire encoder before they leave (the server's own client on the broker). Every
   device refuses the roster with the reason in its log, sends no shares, and tells the server on its presence,
   which logs the refusal and stops waiting for it in that phase.
2. A `start --set secagg=true --set secagg_dropout=0.25` federation of 4 `join` devices, one of them (25 %) killed
   when its roster arrives, before it answers: the server derives k and t from the stated dropout
   (protofl/secagg_params.py), says them and the completion probability at start and in the round, and the round
   unmasks the sum of the 3 others."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from broker_server.core.secagg_run import parameters_line
from broker_server.ops.broker import MosquittoBroker
from broker_server.service import AggregatorService, server_transport
from broker_server.settings import Broker, Federation
from broker_server.simulation import SimulationSpec, prepare
from protofl import secagg, secagg_params, topics
from protofl.algorithms.robust import ClipPolicy
from protofl.presets import make_config
from protofl.transport.broker_url import parse_broker_url
from protofl.transport.mqtt import MqttTransport
from protofl.wire import SaRoster, decode_message, encode_message
from tests.broker_server.mqtt_helpers import ServiceThread, fast_backoff

REPO = Path(__file__).resolve().parents[2]
DATA = "synthetic:n=400,n_test=40"


def _join(url: str, fed: str, i: int, n: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "edge_agent.cli", "join", "--broker", url, "--fed", fed, "--client-id", f"dev-{i}"]
    cmd += ["--data", DATA, "--partition", f"{i}/{n}", "--seed", "4", "--threads", "1", "--device", "cpu"]
    with log.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})


class LyingTransport(MqttTransport):
    """The server's connection, except that every secure-aggregation roster leaves with t = 1 (re-encoded with the
    wire encoder, under the server's own envelope): a server taking a device's threshold into its own hands."""

    def publish(self, topic: str, payload: bytes, *, retain: bool = False, qos: int = 1) -> None:
        try:
            env, msg = decode_message(payload)
        except Exception:  # noqa: BLE001 - not a message of the wire (nothing the server sends): as it is
            env, msg = None, None
        if env is not None and isinstance(msg, SaRoster):
            lie = SaRoster(msg.keys, t=1, frac_bits=msg.frac_bits, bound=msg.bound, weighted=msg.weighted)
            payload = encode_message(lie, fed=env.fed, sender=env.sender, round=env.round, phase=env.phase)
        super().publish(topic, payload, retain=retain, qos=qos)


@pytest.mark.slow
@pytest.mark.mosquitto
def test_devices_refuse_a_minority_threshold_and_the_server_hears_why(
    mosquitto: MosquittoBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fed, n = "minority", 3
    cfg = prepare(SimulationSpec(preset="fedproto", dataset=DATA, clients=n, rounds=1, seed=4)).cfg
    cfg = cfg.replace(min_clients=n, round_timeout=60.0, secagg=True)
    transport = server_transport(Broker(parse_broker_url(mosquitto.url)), fed)
    transport.__class__ = LyingTransport
    service = AggregatorService(Federation(cfg, fed, policy=ClipPolicy(enabled=False)), transport)
    shares: list[str] = []  # who sent a share box (nobody should)
    spy = MqttTransport(mosquitto.url, "spy", backoff=fast_backoff()).connect(10)
    spy.subscribe(
        topics.up(fed, "+"), lambda t, p: shares.append(t) if decode_message(p)[1].KIND == "sa_shares2" else None
    )
    caplog.set_level(logging.INFO)
    runner = ServiceThread(service, timeout=120).start()
    devices = [_join(mosquitto.url, fed, i, n, tmp_path / f"dev{i}.log") for i in range(n)]
    try:
        end = time.monotonic() + 90
        while time.monotonic() < end and caplog.text.count("refused the secure-aggregation roster") < n:
            time.sleep(0.2)
        said = caplog.text
        assert said.count("refused the secure-aggregation roster") >= n, said[-3000:]
    finally:
        service.stop()
        runner.thread.join(10)
        for p in devices:
            if p.poll() is None:
                p.kill()
        service.close()
        spy.close()
    reason = "the roster's threshold t=1 is not a strict majority of its 2 neighbours (at least 2)"
    for i in range(n):
        log = (tmp_path / f"dev{i}.log").read_text()
        assert reason in log and "drops out of the phase's secure aggregation" in log, log[-2000:]
        # the server heard each one: its presence (gave_up), logged with the reason, out of the phase
        assert f"device dev-{i}: round 1: refused the secure-aggregation roster: {reason}" in said, said[-3000:]
        assert f"client dev-{i} gave up on round 1 train" in said, said[-3000:]
    assert shares == []  # no share of any secret left any device


def _start(url: str, fed: str, state: Path, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "broker_server.cli", "start", "--broker", url, "--fed", fed, "--preset", "fedproto"]
    cmd += ["--rounds", "1", "--min-clients", "3", "--round-timeout", "60", "--clip", "off", "--set", "secagg=true"]
    cmd += ["--set", "secagg_dropout=0.25", "--state-dir", str(state), "--verbose"]
    with log.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.slow
@pytest.mark.mosquitto
def test_a_federation_at_its_stated_dropout_completes_with_the_derived_k_and_t(
    mosquitto: MosquittoBroker, tmp_path: Path
) -> None:
    # 4 devices, --min-clients 3 (a phase closes without the one that drops); the devices wait on the broker first,
    # so that the server's config reaches them together and all 4 are in round 1 (a late joiner is added to it).
    fed, n = "dropouts", 4
    params = secagg_params.derive(n, secagg_params.Threat(0.25))
    assert (params.k, params.t) == (3, 2)  # the complete graph of 4 and a strict majority of its 3 neighbours
    devices = [_join(mosquitto.url, fed, i, n, tmp_path / f"dev{i}.log") for i in range(n)]
    end = time.monotonic() + 120
    while time.monotonic() < end and not all(
        "connected to" in (tmp_path / f"dev{i}.log").read_text() for i in range(n)
    ):
        time.sleep(0.2)
    log = tmp_path / "server.log"
    server = _start(mosquitto.url, fed, tmp_path / "state", log)
    killed: list[str] = []

    def kill_on_roster(topic: str, payload: bytes) -> None:  # the first device asked for its shares drops (1 in 4)
        if not killed and decode_message(payload)[1].KIND == "sa_roster2":
            who = topic.rsplit("/", 1)[1]
            devices[int(who.rsplit("-", 1)[1])].send_signal(signal.SIGKILL)
            killed.append(who)

    spy = MqttTransport(mosquitto.url, "spy", backoff=fast_backoff()).connect(10)
    spy.subscribe(topics.down(fed, "+"), kill_on_roster)
    try:
        assert server.wait(240) == 0, log.read_text()[-3000:]
    finally:
        for p in [server, *devices]:
            if p.poll() is None:
                p.kill()
        spy.close()
    said = log.read_text()
    assert killed, said[-3000:]
    cfg = make_config("fedproto", secagg=True, secagg_dropout=0.25, min_clients=3)
    # start's line, for --min-clients 3 devices; the round's, for the 4 that sent keys: k and t as derived
    assert f"secure aggregation, at --min-clients: {parameters_line(cfg)}" in said, said[-3000:]
    assert f"round 1 secure aggregation: {parameters_line(cfg, n)}" in said, said[-3000:]
    assert "4 devices -> k=3 neighbours, threshold t=2 (from secagg_dropout=0.25, secagg_corrupt=0)" in said
    assert "round 1 secure aggregation: unmasked the sum of 3 device(s)" in said, said[-3000:]


def test_the_server_sends_the_derived_k_and_t_and_a_phase_state_keeps_t() -> None:
    """In process (tests/broker_server/test_secagg_rounds.py's 6 devices): with `secagg_dropout=0` stated the graph
    is the ring the model asks for (k = 2, t = 2; today's fixed k, t for 6 are 5, 3), the rosters say so, and the
    round unmasks the plain sum; with 1 of 6 dropping before its keys (`secagg_dropout=0.2`) the 5 others get the
    complete graph of 5 and t = 3 (no k under 4 meets 2^-20)."""
    from tests.broker_server.test_secagg_rounds import CLIENTS, _cfg, _plain, _protos, _run

    agg, devices, _ = _run({}, cfg=_cfg(secagg_dropout=0.0))
    rosters = {c: devices.runs[c].roster for c in CLIENTS}
    assert {(len(r.keys), r.t) for r in rosters.values() if r is not None} == {(2, 2)} and None not in rosters.values()
    got, want = _protos(agg), _plain(CLIENTS)
    assert got.keys() == want.keys() and all(np.allclose(got[c], want[c], atol=1e-3) for c in want)
    agg, devices, _ = _run({"d5": "keys"}, cfg=_cfg(secagg_dropout=0.2))
    assert {(len(r.keys), r.t) for c in CLIENTS[:5] if (r := devices.runs[c].roster) is not None} == {(4, 3)}
    assert agg.records[0].clients == CLIENTS[:5]
    # What a journal or checkpoint keeps of a phase: the derived t travels with it; without one, as before.
    s = secagg.Server(b"ctx", k=2, t=2)
    assert s.state()["t"] == 2 and secagg.Server.restore(s.state()).t == 2
    assert "t" not in secagg.Server(b"ctx").state() and secagg.Server.restore(secagg.Server(b"ctx").state()).t is None

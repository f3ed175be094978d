"""Secure aggregation over the real broker: a `protofl-server start --set secagg=true` process on Mosquitto, killed
with SIGKILL in the middle of the unmask step (the journal's own crash point, broker_server/core/journal.py), restarted;
the devices (the agent's secure-aggregation half, tests/broker_server/test_secagg_rounds.py) answer the server's
steps over MQTT, two of six dropping mid-phase. The restarted server ends with the prototypes of the uninterrupted
run bit for bit (the unmasked sum is an integer sum on the ring: the masks do not enter it), each device's answer
journaled once. The whole agent (`protofl-edge`'s runner, training) is test_secagg_e2e in tests/broker_server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from broker_server.cli import app
from broker_server.core.durable import journal_records
from broker_server.ops.broker import MosquittoBroker
from protofl import topics
from protofl.transport.mqtt import MqttTransport
from tests.broker_server.mqtt_helpers import fast_backoff
from tests.broker_server.test_secagg_rounds import CLIENTS, FED, SMALL, Devices, _cfg, _protos, _run

REPO = Path(__file__).resolve().parents[2]
DROP = {"d1": "masked", "d4": "unmask"}
# The journal's records: 6 joins, 6 keys, 6 shares, 5 masked inputs (d1 sends none), the masked step's deadline;
# the kill comes within the unmasking answers (four of them), after the first.
KILL_AT = 6 + 6 + 6 + 5 + 1 + 3


def _start(url: str, state: Path, log: Path, **env: str) -> subprocess.Popen[bytes]:
    sets = [a for k, v in SMALL.items() if k not in ("rounds", "round_timeout") for a in ("--set", f"{k}={v}")]
    options = f"--fed {FED} --preset fedproto --rounds 1 --min-clients 3 --round-timeout 4 --clip off --set secagg=true"
    cmd = [sys.executable, "-m", "broker_server.cli", "start", "--broker", url, *options.split(), *sets]
    cmd += ["--state-dir", str(state), "--verbose"]
    with log.open("ab") as out:
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO), **env}
        )


@pytest.mark.mosquitto
def test_a_server_killed_mid_unmask_resumes_and_ends_as_the_uninterrupted_run(
    mosquitto: MosquittoBroker, tmp_path: Path
) -> None:
    want = _protos(_run(DROP)[0])  # the uninterrupted run (in process: the same tables, the same drops)
    state, log = tmp_path / "state", tmp_path / "server.log"
    server = _start(mosquitto.url, state, log, PROTOFL_CRASH_AFTER_APPEND=str(KILL_AT))
    devices = Devices(MqttTransport(mosquitto.url, "devices", backoff=fast_backoff()).connect(10), _cfg(), DROP)
    up = threading.Event()  # the server's retained status: it is subscribed to the devices' topics
    devices.t.subscribe(topics.server_status(FED), lambda t, p: up.set())
    try:
        assert up.wait(60), log.read_text()
        devices.join()
        assert server.wait(120) == -9, log.read_text()[-3000:]  # killed itself right after that append
        kinds = [r.kind for r in journal_records(state / "aggregator")]
        assert 1 <= kinds.count("sa_unmask2") < 4 and kinds.count("sa_masked") == 5, kinds
        assert not (state / "rounds.jsonl").read_text(), "the round closed before the kill"
        server = _start(mosquitto.url, state, log)
        assert server.wait(120) == 0, log.read_text()[-3000:]
    finally:
        if server.poll() is None:
            server.kill()
        devices.t.close()
    said = log.read_text()
    assert "secure aggregation: unmasked the sum of 5 device(s)" in said, said[-3000:]
    with np.load(state / "server_model.npz", allow_pickle=False) as z:
        got = {int(c): z["prototypes"][i] for i, c in enumerate(z["proto_classes"])}
    assert got.keys() == want.keys()
    for c in want:
        np.testing.assert_array_equal(got[c], want[c])
    keys = [(r.client, r.kind) for r in journal_records(state / "aggregator") if r.kind.startswith("sa_")]
    assert len(keys) == len(set(keys)) == 6 + 6 + 5 + 4  # every answer once; d4 never answered the unmasking
    assert sorted(c for c, k in keys if k == "sa_unmask2") == [c for c in CLIENTS if c not in DROP]


@pytest.mark.slow
@pytest.mark.mosquitto
def test_simulate_over_mqtt_with_secagg_folds_what_the_plain_run_folds(tmp_path: Path) -> None:
    # What a user types: `simulate --set secagg=true --clip off`, one `join`-like process per device on its own
    # Mosquitto (the runner's down/ topic carries the steps), against the plain in-process run of the same seed.
    args = [
        "simulate", "--preset", "tinyproto", "--dataset", "synthetic:n=300,n_test=60", "--clients", "3",
        "--rounds", "1", "--seed", "5", "--clip", "off", "-q",
    ]  # fmt: skip
    runner = CliRunner()
    r = runner.invoke(app, [*args, "--json", str(tmp_path / "plain.json")])
    assert r.exit_code == 0, r.output
    secure = [*args, "--transport", "mqtt", "--set", "secagg=true", "--json", str(tmp_path / "secure.json")]
    r = runner.invoke(app, secure)
    assert r.exit_code == 0, r.output
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("plain.json", "secure.json"))
    assert b["config"]["secagg"] is True and b["dropped"] == {}
    assert [x["clients"] for x in b["rounds"]] == [x["clients"] for x in a["rounds"]] == [3]
    # The global prototypes (to the ring's tolerance) classify the test set as the plain run's do; a 1-thread
    # agent may flip one argmax.
    assert b["rounds"][0]["global_proto_acc"] == pytest.approx(a["rounds"][0]["global_proto_acc"], abs=0.021)
    assert b["rounds"][0]["uplink_bytes"] > a["rounds"][0]["uplink_bytes"]  # keys, shares, answers on top

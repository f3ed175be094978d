"""The command lines of the networked runtime: `protofl-server start`, `protofl-edge join`, and
`protofl-server simulate --transport mqtt` (the README's first command, over a local broker)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from broker_server.cli import app
from broker_server.ops.broker import free_port
from tests.pipelines import NO_FLOOR, as_cli_sets

REPO = Path(__file__).resolve().parents[2]
DATA = "synthetic:n=600,n_test=100"
ENV = dict(os.environ, PYTHONPATH=str(REPO))


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", *args]


@pytest.mark.slow
def test_start_and_join_over_the_embedded_broker(tmp_path: Path) -> None:
    # The embedded amqtt broker (the fallback when mosquitto is missing) hosts a whole CLI federation:
    # one server process, two device processes. It enforces no credentials, so start needs --insecure.
    port = free_port()
    state = tmp_path / "state"
    server = subprocess.Popen(
        cli(
            "broker_server.cli",
            "start",
            "--local-broker",
            "amqtt",
            "--insecure",
            "--port",
            str(port),
            "--fed",
            "clitest",
            "--preset",
            "fedproto",
            "--rounds",
            "2",
            "--min-clients",
            "2",
            "--round-timeout",
            "60",
            "--state-dir",
            str(state),
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=ENV,
        text=True,
    )
    devices = [
        subprocess.Popen(
            cli(
                "edge_agent.cli",
                "join",
                "--broker",
                f"mqtt://127.0.0.1:{port}",
                "--fed",
                "clitest",
                "--client-id",
                f"dev-{i}",
                "--data",
                DATA,
                "--partition",
                f"{i}/2",
                "--threads",
                "1",
                "--connect-timeout",
                "60",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=ENV,
            text=True,
        )
        for i in range(2)
    ]
    try:
        out, _ = server.communicate(timeout=180)
        dev_out = [d.communicate(timeout=60)[0] for d in devices]
    finally:
        for p in (server, *devices):
            if p.poll() is None:
                p.kill()
    assert server.returncode == 0, out
    assert "round 1/2: 2 clients (quorum), local acc" in out and "round 2/2: 2 clients" in out, out
    assert "federation 'clitest' finished: 2 rounds" in out
    for d, o in zip(devices, dev_out, strict=True):
        assert d.returncode == 0, o
        assert "federation finished after 2 trained round(s)" in o
    rows = [json.loads(line) for line in (state / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and rows[0]["clients"] == ["dev-0", "dev-1"]
    with np.load(state / "server_model.npz", allow_pickle=False) as z:
        assert z["prototypes"].shape == (len(z["proto_classes"]), 512)


def test_start_explains_what_is_missing(tmp_path: Path) -> None:
    runner = CliRunner()
    r = runner.invoke(app, ["start", "--preset", "refprotofl"])
    assert r.exit_code == 2 and "needs a public set: pass --public-data" in r.output
    port = free_port()
    r = runner.invoke(
        app, ["start", "--preset", "fedproto", "--broker", f"mqtt://127.0.0.1:{port}", "--connect-timeout", "1"]
    )
    assert r.exit_code == 2
    assert f"cannot reach broker at mqtt://127.0.0.1:{port}" in r.output and "protofl-server start" in r.output
    r = runner.invoke(app, ["simulate", "--transport", "carrier-pigeon", "-q"])
    assert r.exit_code == 2 and "unknown transport 'carrier-pigeon'; use inprocess or mqtt" in r.output


@pytest.mark.slow
@pytest.mark.mosquitto
def test_simulate_over_mqtt_reports_like_inprocess(tmp_path: Path) -> None:
    # `simulate --transport mqtt` with no --broker starts its own (mosquitto here); one process per agent.
    args = [
        "simulate",
        "--preset",
        "tinyproto",
        "--dataset",
        DATA,
        "--clients",
        "3",
        "--rounds",
        "2",
        "--seed",
        "5",
        "--test-limit",
        "50",
        *as_cli_sets(NO_FLOOR),  # the step floor off (tests/pipelines.py NO_FLOOR): the transport is the point
        "-q",
    ]
    runner = CliRunner()
    r = runner.invoke(app, [*args, "--json", str(tmp_path / "inproc.json")])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, [*args, "--transport", "mqtt", "--json", str(tmp_path / "mqtt.json")])
    assert r.exit_code == 0, r.output
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("inproc.json", "mqtt.json"))
    assert b["simulation"]["transport"] == "mqtt" and b["dropped"] == {}
    for ra, rb in zip(a["rounds"], b["rounds"], strict=True):
        for k in ("round", "clients", "uplink_bytes", "downlink_bytes"):
            assert rb[k] == ra[k], (k, ra, rb)
        for k in ("local_acc", "global_acc", "ensemble_acc"):  # a 1-thread agent may flip one argmax
            assert rb[k] == pytest.approx(ra[k], abs=0.021), (k, ra, rb)

"""Differential privacy through what a user types: `simulate --set dp_epsilon=.. --set dp_noise=..` stops when its
budget is spent and says so in the run JSON and the report; `status`, /metrics and the live page show the ledger."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from broker_server.cli import app


@pytest.mark.slow
def test_a_spent_budget_stops_simulate_and_the_report_says_so(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    # z = 2 spends 2.17 in one round and 3.19 in two (RDP, delta 1e-5): a budget of 3 allows one round of five.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "broker_server.cli",
            "simulate",
            "--preset",
            "fedproto",
            "--dataset",
            "synthetic:n=300,n_test=100",
            "--clients",
            "3",
            "--rounds",
            "5",
            "--transport",
            "inprocess",
            "--set",
            "dp_epsilon=3",
            "--set",
            "dp_noise=2",
            "--set",
            "dp_clip=2.5",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = " ".join((proc.stdout + proc.stderr).split())
    assert "privacy budget spent: epsilon 2.17 after 1 round(s); round 2 would make it 3.19 > dp_epsilon 3" in said
    run = json.loads(out.read_text())
    assert [r["round"] for r in run["rounds"]] == [1]
    assert run["rounds"][0]["epsilon"] == pytest.approx(2.17, abs=0.01)
    dp = run["privacy"]
    assert dp["epsilon_spent"] == pytest.approx(2.17, abs=0.01) and dp["epsilon_budget"] == 3
    assert dp["noise_multiplier"] == 2 and dp["clip"] == 2.5 and dp["delta"] == 1e-5
    assert dp["stopped"].startswith("privacy budget spent")
    assert run["config"]["dp_epsilon"] == 3  # the config that travelled to the devices
    result = CliRunner().invoke(app, ["report", str(out), "--out", str(tmp_path / "rep")])
    assert result.exit_code == 0, result.output
    summary = (tmp_path / "rep" / "summary.md").read_text()
    assert "privacy (local DP): epsilon 2.17 of 3 spent after 1 round(s)" in summary
    assert "Stopped before its last round: privacy budget spent" in summary


def test_status_metrics_and_page_show_the_privacy_ledger(tmp_path: Path) -> None:
    from prometheus_client import generate_latest
    from prometheus_client.core import CollectorRegistry

    from broker_server.shell import Aggregator
    from broker_server.watch.board import SnapshotBoard
    from broker_server.watch.live import LiveWatch
    from broker_server.watch.metrics import SnapshotCollector
    from broker_server.watch.ui import page_html
    from protofl.presets import make_config
    from protofl.transport import InProcessBroker

    cfg = make_config("fedproto", rounds=4, num_classes=3, proto_dim=64, dp_epsilon=6.0)
    agg = Aggregator(cfg, "w", InProcessBroker().connect("server"))
    watch = LiveWatch(agg, state_dir=tmp_path)
    snap = watch.refresh(now=100.0)
    result = CliRunner().invoke(app, ["status", "--state-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "privacy (local DP): epsilon 0 of 6 spent after 0 round(s)" in out, result.output
    doc = json.loads((tmp_path / "status.json").read_text())
    assert doc["privacy"]["epsilon_budget"] == 6.0 and doc["privacy"]["delta"] == 1e-5

    board = SnapshotBoard()
    board.publish(snap)
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(board))
    text = generate_latest(registry).decode()
    assert "protofl_dp_epsilon_budget 6.0" in text and "protofl_dp_epsilon_spent 0.0" in text
    assert "s.privacy.epsilon_spent" in page_html().decode()


@pytest.mark.slow
@pytest.mark.mosquitto
def test_start_takes_the_budget_and_stops_over_the_real_broker(tmp_path: Path) -> None:
    """`start --set dp_epsilon=3 --set dp_noise=2 --rounds 3` and one `join` over its mosquitto: the device sends
    noised prototypes, the server stops after round 1 with the reason, and rounds.jsonl says what it spent."""
    from tests.broker_server.mqtt_helpers import start_and_join
    from tests.broker_server.test_own_data_trust import image_folder
    from tests.conftest import _require_mosquitto

    _require_mosquitto()
    imgs = image_folder(tmp_path / "imgs", n=8, broken=False)
    extra = ["--set", "dp_epsilon=3", "--set", "dp_noise=2", "--set", "dp_clip=5"]
    code, dev_out, server_code, out = start_and_join(
        tmp_path, "dp46", f"imagefolder:{imgs}", rounds=3, server_extra=extra
    )
    assert code == 0, dev_out
    assert server_code == 0, out
    said = " ".join(out.split())
    assert "privacy budget spent: epsilon 2.17 after 1 round(s); round 2 would make it 3.19" in said, out
    assert "privacy (local DP): epsilon 2.17 of 3 spent after 1 round(s)" in said, out
    lines = [json.loads(line) for line in (tmp_path / "state" / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in lines] == [1] and lines[0]["epsilon"] == pytest.approx(2.17, abs=0.01)
    status = json.loads((tmp_path / "state" / "status.json").read_text())
    assert status["state"] == "finished" and status["privacy"]["epsilon_spent"] == pytest.approx(2.17, abs=0.01)

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

    from broker_server.core.shell import Aggregator
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


@pytest.mark.slow
def test_distributed_dp_under_secure_aggregation_adds_each_devices_share_of_the_noise(tmp_path: Path) -> None:
    """`simulate --clip off --set secagg=true --set dp_mode=distributed --set dp_epsilon=8`: one round, four devices
    of a skewed partition (a class held by one device only). Each device adds 1/4 of the noise variance to every
    class row it masks, those it lacks included, so every class's unmasked sum carries the whole noise: the global
    prototype of class c, times the n_c devices that hold it, minus the sum of their clipped prototypes (each
    device's own, left in --out), is N(0, noise_std^2) in every class. No noise, all of it on each device (local
    DP's), or none on the rows a device lacks would each move that spread by a factor of 2 or more somewhere."""
    import dp_accounting
    import numpy as np
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    out, art = tmp_path / "run.json", tmp_path / "art"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    cmd = [
        sys.executable, "-m", "broker_server.cli", "simulate", "--preset", "fedproto",
        "--dataset", "synthetic:n=300,n_test=60", "--clients", "4", "--alpha", "0.1", "--rounds", "1", "--seed", "5",
        "--clip", "off", "--set", "secagg=true", "--set", "dp_mode=distributed", "--set", "dp_epsilon=8",
        "-q", "--json", str(out), "--out", str(art),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = json.loads(out.read_text())
    dp = run["privacy"]
    assert run["config"]["secagg"] is True and dp["mode"] == "distributed" and run["dropped"] == {}
    assert [r["clients"] for r in run["rounds"]] == [4]
    # The accountant: the calibrated multiplier spends the budget in the run's one round, by dp-accounting's own
    # RDP figure for that Gaussian mechanism (sensitivity 2 C sqrt(R), R = 10 classes).
    acc = rdp.RdpAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(dp["noise_multiplier"]), 1)
    assert dp["epsilon_spent"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    assert dp["epsilon_spent"] == pytest.approx(8.0, rel=1e-4) and dp["rounds_accounted"] == 1
    assert dp["noise_std"] == pytest.approx(dp["noise_multiplier"] * 2 * dp["clip"] * np.sqrt(10))

    with np.load(art / "global" / "prototypes.npz") as z:
        glob = {int(c): z["prototypes"][i].astype(np.float64) for i, c in enumerate(z["classes"])}
    held: dict[int, list[np.ndarray]] = {}
    for f in sorted(art.glob("devices/*/local_prototypes.npz")):
        with np.load(f) as z:
            for c, row in zip(z["classes"].tolist(), z["prototypes"].astype(np.float64), strict=True):
                held.setdefault(c, []).append(row * min(1.0, dp["clip"] / np.linalg.norm(row)))
    assert len(list(art.glob("devices/*"))) == 4 and sorted(held) == sorted(glob) == list(range(10))
    assert min(len(rows) for rows in held.values()) < 4  # some class is not on every device
    spread = {}
    for c, rows in held.items():
        noise = glob[c] * len(rows) - np.sum(rows, axis=0)  # the class's unmasked noise sum, 512 values
        spread[c] = float(noise.std() / dp["noise_std"])
    # 512 draws a class: the sample std is within 3 % of the true one (one sigma); 0.8-1.25 is more than 6 sigma
    assert all(0.8 < s < 1.25 for s in spread.values()), spread

"""Issue 56: a federation that is not learning says so, and one that learns does not (protofl/learning.py).

Through the commands a user types: `protofl-server simulate` (its log, table and JSON report) and `protofl-server
report` (summary.md, and accuracy_uplink.png leading with the deployable model), on a run that cannot learn (lr 1e-9:
every device's model stays its seeded initial one) and on the same run at the default lr. Small: synthetic data, two
devices, the mlp, four rounds (the rule needs WINDOW + 1 = 4).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from broker_server.cli import app
from broker_server.commands.report_cli import uplink_metric

runner = CliRunner()
ARGS = ["simulate", "--dataset", "synthetic:n=400,n_test=200,noise=0.6", "--clients", "2", "--arch", "mlp"]
ARGS += ["--rounds", "4", "--test-every", "1", "--preset", "fedavg", "--seed", "1"]


def simulate(tmp: Path, name: str, *extra: str) -> tuple[str, dict]:
    out = tmp / f"{name}.json"
    res = runner.invoke(app, [*ARGS, "--json", str(out), *extra])
    assert res.exit_code == 0, res.output
    return " ".join(res.output.split()), json.loads(out.read_text())


def test_a_run_that_cannot_learn_says_so_and_one_that_learns_does_not(
    tmp_path: Path, one_torch_thread: None, caplog: pytest.LogCaptureFixture
) -> None:
    out, stuck = simulate(tmp_path, "stuck", "--set", "lr=1e-9")
    assert stuck["learning"] is not None and stuck["learning"].startswith("not learning"), stuck["learning"]
    assert "WARNING: the federation is not learning" in out, out  # the table's caption, with what to do
    assert "raise lr" in out
    assert "the federation is round 4: not learning" in caplog.text  # the log, once
    assert caplog.text.count("the federation is") == 1
    caplog.clear()
    out, learns = simulate(tmp_path, "learns")
    accs = [r["local_acc"] for r in learns["rounds"]]
    assert max(accs[1:]) >= accs[0] + 0.01, accs  # it does learn: the rule has something to tell apart
    assert learns["learning"] is None and "not learning" not in out and "not learning" not in caplog.text

    res = runner.invoke(
        app, ["report", str(tmp_path / "stuck.json"), str(tmp_path / "learns.json"), "--out", str(tmp_path / "rep")]
    )
    assert res.exit_code == 0, res.output
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "**Warning (fedavg):** the federation is not learning" in md and md.count("**Warning") == 1, md
    assert (tmp_path / "rep" / "accuracy_uplink.png").stat().st_size > 0
    # accuracy vs uplink leads with the deployable model: FedAvg's global model, scored every round here
    assert uplink_metric(learns) == "predictor_acc" and all(r["predictor_acc"] is not None for r in learns["rounds"])

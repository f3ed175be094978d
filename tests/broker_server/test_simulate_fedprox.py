"""FedProx end to end: `simulate --set prox_mu=...` on FedAvg, on FedProto with a federated adapter and on FedProto's
private models; the term acts (the global parameters or prototypes move differently), and prox_mu = 0 changes
nothing, the config included."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from broker_server.cli import app
from broker_server.core.shell import Aggregator
from broker_server.simulation import SimulationSpec, run_simulation

FED: dict[str, Any] = dict(dataset="synthetic:n=400,n_test=60", clients=3, alpha=0.5, rounds=2, seed=1, archs=("mlp",))
CLI = [
    "simulate",
    "-q",
    "--dataset",
    "synthetic:n=400,n_test=60",
    "--clients",
    "3",
    "--rounds",
    "2",
    "--seed",
    "1",
    "--arch",
    "mlp",
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _run(preset: str, **overrides: Any) -> tuple[dict[str, Any], np.ndarray]:
    """The report (without its timings) and the federated vector the server ends with."""
    box: dict[str, Any] = {}
    report = run_simulation(
        SimulationSpec(preset=preset, **FED, overrides=overrides), on_finish=lambda agg: box.setdefault("agg", agg)
    )
    model = box["agg"].model
    values = model.rules.state_values()
    vector = values["params"] if values["params"] is not None else values["adapter"]
    report["totals"].pop("wall_s")
    report.pop("machine")
    return json.loads(json.dumps(report)), np.asarray(vector).copy()


def test_fedavg_with_and_without_the_proximal_term() -> None:
    plain, theta = _run("fedavg")
    off, theta_off = _run("fedavg", prox_mu=0.0)
    prox, theta_prox = _run("fedavg", prox_mu=0.5)
    assert np.array_equal(theta_off, theta) and off == plain  # 0: FedProx off, bit for bit
    assert "fedprox" not in plain["config"]["techniques"]  # off: the config does not carry it
    assert prox["config"]["techniques"]["fedprox"] == {"prox_mu": 0.5}
    assert [r["round"] for r in prox["rounds"]] == [1, 2]
    assert not np.array_equal(theta_prox, theta)  # the term acts


def test_fedproto_with_a_federated_adapter_and_the_proximal_term() -> None:
    plain, theta = _run("fedproto", federate="adapter")
    prox, theta_prox = _run("fedproto", federate="adapter", prox_mu=0.5)
    assert not np.array_equal(theta_prox, theta)
    assert prox["rounds"][-1]["local_proto_acc"] is not None  # still FedProto: prototypes and their targets


def test_fedproto_with_the_proximal_term_on_its_private_models() -> None:
    # Nothing shared: the term pulls each private model towards its own start of the round, so it acts once the
    # round's local steps have moved it (3 epochs here); the global prototypes then differ.
    protos = []
    for mu in (0.0, 5.0):
        finished: list[Aggregator] = []
        spec = SimulationSpec(preset="fedproto", **FED, overrides=dict(prox_mu=mu, local_epochs=3))
        report = run_simulation(spec, on_finish=finished.append)
        assert ("fedprox" in report["config"]["techniques"]) is (mu > 0)
        protos.append({c: v.copy() for c, v in finished[0].model.rules.state_values()["prototypes"].items()})
    assert protos[0].keys() == protos[1].keys()
    assert any(not np.array_equal(protos[0][c], protos[1][c]) for c in protos[0])


def test_the_cli_runs_fedavg_and_fedproto_with_prox_mu(tmp_path: Path) -> None:
    out = tmp_path / "fedavg.json"
    res = CliRunner().invoke(app, [*CLI, "--preset", "fedavg", "--set", "prox_mu=0.01", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["config"]["techniques"]["fedprox"] == {"prox_mu": 0.01}
    out = tmp_path / "fedproto.json"
    res = CliRunner().invoke(app, [*CLI, "--preset", "fedproto", "--set", "prox_mu=0.01", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["config"]["techniques"]["fedprox"] == {"prox_mu": 0.01}
    res = CliRunner().invoke(app, [*CLI, "--preset", "fedproto", "--set", "prox_mu=0.01", "--set", "federate=adapter"])
    assert res.exit_code == 0, res.output

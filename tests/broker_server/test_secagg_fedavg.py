"""Secure aggregation of a parameter vector, end to end as a user types it: `simulate --preset fedavg --set
federate=adapter --set secagg=true --clip off` (the agent masks its adapter times its sample count, the server
unmasks the sum) leaves the global adapter of the plain run of the same seed, to the fixed-point ring's tolerance.
The dropped-device cases are test_secagg_rounds.py's (the round machine, the same device half)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from broker_server.cli import app


def test_simulate_fedavg_with_secagg_leaves_the_plain_runs_global_adapter(tmp_path: Path) -> None:
    args = [
        "simulate", "--preset", "fedavg", "--set", "federate=adapter", "--dataset", "synthetic:n=300,n_test=60",
        "--clients", "3", "--rounds", "1", "--seed", "5", "--clip", "off", "-q",
    ]  # fmt: skip
    runner = CliRunner()
    for name, extra in (("plain", []), ("secure", ["--set", "secagg=true"])):
        r = runner.invoke(app, [*args, *extra, "--json", str(tmp_path / f"{name}.json"), "--out", str(tmp_path / name)])
        assert r.exit_code == 0, r.output
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("plain", "secure"))
    assert b["config"]["secagg"] is True and b["dropped"] == {} and b["rounds"][0]["clients"] == 3
    assert b["rounds"][0]["uplink_bytes"] > a["rounds"][0]["uplink_bytes"]  # keys, shares, answers on top
    plain, secure = (np.load(tmp_path / n / "global" / "federated.npz") for n in ("plain", "secure"))
    assert str(plain["kind"]) == str(secure["kind"]) == "adapter"  # the adapter and head, federated
    got, want = secure["vector"], plain["vector"]
    assert got.shape == want.shape and np.abs(want).max() > 0.01
    # the ring: 3 devices within +-1e4 give f = 16; n * v is off by 2^-17, the weighted mean by far less
    np.testing.assert_allclose(got, want, atol=1e-5)

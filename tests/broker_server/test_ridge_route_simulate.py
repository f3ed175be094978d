"""The ridge predictor's route through `protofl-server simulate` as a user opts in to it (the default preset with
`--set ridge_topk=0.001`; the route is off by default, docs/algorithms.md "The route"): the devices' training reaches
the deployable predictor. After 3 rounds the predictor is not round 1's: the exported g carries a
refreshed backbone (version 3: round 1's head, then two rounds of updates), each device holds g bit for bit as the
server does, and the report scores the predictor every round."""

from __future__ import annotations

import json

import numpy as np
from typer.testing import CliRunner

from broker_server.cli import app
from protofl.artifacts import read_predictor

runner = CliRunner()


def test_the_predictor_after_3_rounds_of_a_small_opted_in_simulate_differs_from_round_1s(tmp_path) -> None:
    out, run = tmp_path / "report.json", tmp_path / "run"
    args = ["simulate", "-q", "--dataset", "synthetic:n=300,n_test=100", "--clients", "2", "--rounds", "3"]
    args += ["--set", "ridge_topk=0.001"]
    res = runner.invoke(app, [*args, "--seed", "1", "--test-every", "1", "--json", str(out), "--out", str(run)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["preset"] == "protofl" and report["predictor"]["kind"] == "head"
    acc = {r["round"]: r["predictor_acc"] for r in report["rounds"]}
    assert sorted(acc) == [1, 2, 3] and all(a is not None for a in acc.values()), acc
    # Round 1 sends statistics (548 KB a device for the cnn), rounds 2 and 3 a top-K update (and prototypes).
    up = {r["round"]: r["uplink_bytes"] for r in report["rounds"]}
    assert up[2] < up[1] / 20 and up[3] < up[1] / 20, up
    w, b, g, info = read_predictor(run / "global" / "predictor.npz")
    assert g is not None and info["backbone"] == "refreshed by the devices" and info["version"] == 3
    assert info["backbone_changed"] > 0  # values of the shipped backbone (its head aside) the devices changed
    # g is the backbone whose head is the ridge head, and it is no longer the backbone round 1 solved on.
    assert np.array_equal(g[-(w.size + b.size) :], np.concatenate([w.ravel(), b]))
    shipped = json.loads((run / "manifest.json").read_text())["predictor"]
    assert shipped["made_from"]["route"] == "topk"
    devices = sorted((run / "devices").glob("*/predictor.npz"))
    assert len(devices) == 2
    for p in devices:
        _, _, dg, _ = read_predictor(p)
        assert dg is not None and dg.tobytes() == g.tobytes(), p  # every device holds g bit for bit

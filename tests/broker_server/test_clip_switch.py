"""Upload clipping as a switch (issue 24): `--clip off` folds uploads as sent; with it on, the rows clipped
are counted per round in the simulate JSON and explained once in the server log."""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from broker_server.cli import app
from broker_server.commands import start_cli
from broker_server.core.rounds import RoundRecord
from broker_server.core.stages import PhaseRun, ServerModel, build_model
from broker_server.simulation import SimulationSpec
from broker_server.simulation.report import Report
from protofl.algorithms.robust import ClipPolicy
from protofl.plan import Phase, RoundPlan, Upload
from protofl.presets import make_config
from protofl.sparse import SparseVector
from protofl.wire import ParamsUpload, ProtoSet, ProtoUpload
from tests.pipelines import ADAPTER_PIPELINE, NO_FLOOR, as_cli_sets

runner = CliRunner()


def fedproto(policy: ClipPolicy) -> ServerModel:
    cfg = make_config("fedproto", num_classes=3, proto_dim=2, adapter_rank=1)
    return build_model(cfg, RoundPlan.from_config(cfg), policy)


def upload(rows: dict[int, list[float]]) -> ProtoUpload:
    classes = sorted(rows)
    values = np.array([rows[c] for c in classes], np.float32)
    return ProtoUpload(
        local=ProtoSet(classes=np.array(classes), values=values, counts=np.ones(len(classes), np.int64)),
        public=None,
        n_samples=1,
    )


def one_round(model: ServerModel, *uploads: ProtoUpload) -> None:
    phase = PhaseRun(model, Phase.TRAIN)  # fedproto: one phase, the round's first
    for up in uploads:
        phase.add(Upload.PROTOS, up)
    phase.finish()


def test_clip_off_folds_a_row_that_clipping_would_scale_as_it_was_sent() -> None:
    # Class 0's row (3, 4) lies at distance 5 from its centre 0 (no global yet); with radius 1 clipping
    # scales it to (0.6, 0.8). With clipping off the global is the row itself and nothing is counted.
    on, off = fedproto(ClipPolicy(first_radius=1.0)), fedproto(ClipPolicy(first_radius=1.0, enabled=False))
    for model in (on, off):
        one_round(model, upload({0: [3.0, 4.0]}))
    assert np.allclose(on.rules.state_values()["prototypes"][0], [0.6, 0.8]) and on.clipped == {"protos": 1}
    assert off.rules.state_values()["prototypes"][0].tolist() == [3.0, 4.0]
    assert off.clipped == {} and off.radii == {} and off.round_clips.checked == {} and off.radius("protos") == np.inf


def test_clip_off_folds_an_adapter_update_as_sent() -> None:
    # APUD: one update moves coordinates 0..9 by +5 (distance 5 * sqrt(10) from the global): radius 1 would
    # shrink the move to 1 / sqrt(10) per coordinate; off, the new global is the update itself.
    from protofl.adapter import adapter_layout, initial_adapter
    from protofl.algorithms.fedavg import FederatedVector

    cfg = make_config("protofl", num_classes=3, proto_dim=4, adapter_rank=1, **ADAPTER_PIPELINE)
    model = build_model(cfg, RoundPlan.from_config(cfg), ClipPolicy(first_radius=1.0, enabled=False))
    vec = model.rules.state(FederatedVector)
    vec.adapter = initial_adapter(adapter_layout(4, 1, 3), seed=0)
    before = vec.adapter.copy()
    idx = np.arange(10)
    phase = PhaseRun(model, Phase.TRAIN)
    phase.add(
        Upload.ADAPTER,
        ParamsUpload(update=SparseVector(before.shape[0], idx, before[idx] + 5.0), n_samples=10, base_round=1, dt="f4"),
    )
    phase.finish()
    assert np.allclose(vec.adapter[idx], before[idx] + 5.0) and model.clipped == {}


def _report_rows(model: ServerModel, rounds: list[tuple[ProtoUpload, ...]]) -> list[dict[str, Any]]:
    """The simulate JSON's round rows for `rounds` run through `model` (no agents: hand-made uploads)."""
    report = Report(SimulationSpec(rounds=len(rounds)), model.cfg, np.zeros(0, np.int64))
    for r, uploads in enumerate(rounds, 1):
        one_round(model, *uploads)
        # what the round machine records at the close, before the next round starts its counts again
        rec = RoundRecord(
            round=r,
            clients=["a", "b"],
            clipped=dict(model.round_clips.clipped),
            clip_checked=dict(model.round_clips.checked),
        )
        report.on_round_end(rec, model)
    return report.to_json({})["rounds"]


def test_the_simulate_json_counts_the_rows_beyond_the_radius_each_round() -> None:
    # Round 1, radius 1 around 0: norms 5 (class 0, clipped), 0.5 (class 1), 2 (class 2, clipped) from one
    # client and 0.5 (class 0) from another: 2 of 4 rows clipped. The accepted norms are 5, 0.5, 2, 0.5:
    # median 1.25, so round 2's radius is 12.5 around the new globals. Round 2: a row 13 away from class 1's
    # global (0.5, 0) clipped, two rows near the globals not: 1 of 3.
    model = fedproto(ClipPolicy(first_radius=1.0))
    r1 = (upload({0: [3.0, 4.0], 1: [0.5, 0.0], 2: [0.0, 2.0]}), upload({0: [0.3, 0.4]}))
    r2 = (upload({1: [0.5, 13.0], 0: [0.5, 0.5]}), upload({2: [0.0, 1.0]}))
    rows = _report_rows(model, [r1, r2])
    assert [(r["clipped"], r["clip_checked"]) for r in rows] == [
        ({"protos": 2}, {"protos": 4}),
        ({"protos": 1}, {"protos": 3}),
    ]
    assert model.radii["protos"] == pytest.approx(10.0)  # next: 10 x the median of round 2's norms 13.01, 0.71, 1
    assert model.clipped == {"protos": 3}  # the running total is the rows' sum
    off = _report_rows(fedproto(ClipPolicy(first_radius=1.0, enabled=False)), [r1, r2])
    assert [(r["clipped"], r["clip_checked"]) for r in off] == [({}, {}), ({}, {})]


def test_the_first_clip_is_explained_once_in_the_server_log(caplog: pytest.LogCaptureFixture) -> None:
    model = fedproto(ClipPolicy(first_radius=1.0))
    with caplog.at_level(logging.WARNING, logger="protofl.server"):
        one_round(model, upload({0: [3.0, 4.0], 1: [0.1, 0.0]}))
        one_round(model, upload({0: [300.0, 400.0]}))  # clipped again: no second explanation
    lines = [r.getMessage() for r in caplog.records if "clipping" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "1 of 2 prototype rows" in lines[0] and "10 x the median norm" in lines[0] and "--clip off" in lines[0]
    assert model.clipped == {"protos": 2}


def test_simulate_takes_clip_off_and_records_it(tmp_path) -> None:
    out = tmp_path / "r.json"
    res = runner.invoke(
        app,
        [
            "simulate",
            "--preset",
            "fedproto",
            "--dataset",
            "synthetic:n=300,n_test=50",
            "--clients",
            "2",
            "--rounds",
            "1",
            "--clip",
            "off",
            "--json",
            str(out),
            "-q",
        ],
    )
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["simulation"]["clip"] == "off"
    assert report["rounds"][0]["clipped"] == {} and report["rounds"][0]["clip_checked"] == {}


def test_start_passes_the_switch_into_the_clip_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[ClipPolicy] = []
    # `start` builds its settings once and hands `_serve` one Start: the policy is the federation group's
    monkeypatch.setattr(start_cli, "_serve", lambda s: seen.append(s.federation.policy))
    for args, enabled in ((["--clip", "off"], False), (["--clip", "ON"], True), ([], True)):
        res = runner.invoke(app, ["start", "--preset", "fedproto", *args])
        assert res.exit_code == 0, res.output
        assert seen.pop().enabled is enabled, args


@pytest.mark.parametrize("command", ["start", "simulate"])
def test_an_invalid_clip_value_is_a_clear_error(command: str) -> None:
    res = runner.invoke(app, [command, "--clip", "maybe"])
    assert res.exit_code == 2
    assert "--clip must be on or off, got 'maybe'" in " ".join(res.output.split())


def test_fedpagrs_unit_uploads_clip_nothing_so_on_and_off_make_the_same_run(tmp_path) -> None:
    # What lets the benchmark count a fedpagr row's clipped run as its unclipped one (bench/paper_table.py,
    # never_clipped): unit rows lie at most 2 apart, the radius is 10 x their median norm 1.
    reports = {}
    for clip in ("on", "off"):
        out = tmp_path / f"{clip}.json"
        res = runner.invoke(
            app,
            [
                "simulate",
                "--preset",
                "fedpagr",
                "--dataset",
                "synthetic:n=400,n_test=80",
                "--clients",
                "3",
                "--rounds",
                "3",
                "--seed",
                "1",
                "--clip",
                clip,
                *as_cli_sets(NO_FLOOR),  # the step floor off (tests/pipelines.py NO_FLOOR): clipping is the point
                "--json",
                str(out),
                "-q",
            ],
        )
        assert res.exit_code == 0, res.output
        reports[clip] = json.loads(out.read_text())
    on, off = reports["on"]["rounds"], reports["off"]["rounds"]
    assert all(r["clip_checked"].get("protos", 0) > 0 for r in on)  # clipping was on and looked at every row
    assert all(r["clipped"].get("protos", 0) == 0 for r in on)
    keys = ("local_acc", "local_proto_acc", "global_acc", "ensemble_acc", "uplink_bytes", "downlink_bytes")
    assert [[r[k] for k in keys] for r in on] == [[r[k] for k in keys] for r in off]

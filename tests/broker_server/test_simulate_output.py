"""What `protofl-server simulate` shows (issue 26): the progress bar ends on the table's figures, the table
keeps every figure when piped, and a run over shaped links has one simulated clock everywhere."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

import broker_server.simulation as simulation
from broker_server.cli import app
from broker_server.core.rounds import RoundRecord
from broker_server.simulation import Report, SimulationSpec
from broker_server.simulation.links import Arrival, expand
from broker_server.simulation.timeline import LinkReport
from protofl.presets import make_config
from protofl.profiles import parse_fleet
from protofl.wire import Metrics


def row(r: int, global_acc: float) -> dict[str, Any]:
    return {
        "round": r,
        "local_acc": 0.5,
        "local_proto_acc": None,
        "global_acc": global_acc,
        "global_proto_acc": None,
        "ensemble_acc": None,
        "uplink_bytes": 123_456,
        "downlink_bytes": 654_321,
        "clients": 10,
        "sim_time_s": 100.0 * r,
    }


@pytest.fixture
def partial_last_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run whose last row was shown before every device's metrics were in (their grace passed): the bar
    saw global 10 %, the report, with the late metrics, says 45.2 %."""

    def fake(spec: SimulationSpec, on_round: Any = None, **kwargs: Any) -> dict[str, Any]:
        rows = [row(r, 0.3) for r in (1, 2, 3)] + [row(4, 0.1)]
        if kwargs.get("on_start") is not None:
            kwargs["on_start"]()  # the inputs are checked and the data loaded: the bar starts
        for r in rows:
            on_round(dict(r))
        rows[-1] = row(4, 0.452)
        return {
            "preset": spec.preset,
            "rounds": rows,
            "simulation": {"dataset": "synthetic", "device": "cpu"},
            "totals": {"uplink_bytes": 4 * 123_456, "downlink_bytes": 4 * 654_321, "wall_s": 3.0},
        }

    monkeypatch.setattr(simulation, "run_simulation", fake)


def test_the_progress_bar_ends_on_the_reports_figures(partial_last_row: None) -> None:
    result = CliRunner().invoke(app, ["simulate", "--rounds", "4"])
    assert result.exit_code == 0, result.output
    # 80 columns: the figures fold onto a second line, beside the elapsed time
    flat = " ".join(result.stderr.replace("0:00:00", "").split())
    assert "4/4 sim 6 min 40 s local (own classes) 50.00% global 45.20% up 120.6 KB" in flat, result.stderr
    assert "global 10.00%" not in result.stderr


def test_the_table_keeps_every_figure_when_piped(partial_last_row: None) -> None:
    result = CliRunner().invoke(app, ["simulate", "--rounds", "4"])  # stdout is not a terminal: 80 columns
    assert result.exit_code == 0, result.output
    table = result.stdout
    assert "…" not in table, table
    for header in ("ensemble %", "downlink", "clients", "global proto %"):
        assert header in table, table
    assert "│     4 │                 50.00 │                           - │    45.20 │" in table, table
    assert "639.0 KB" in table, table
    # issue 41: what each accuracy measures, local on each device's own classes only
    assert "local (own classes) %" in table and "local proto (own classes) %" in table, table
    flat = " ".join(table.split())
    assert "local (own classes) = each device's model on a held-out part of its own data" in flat, table
    assert "not the federation's accuracy on every class" in flat, table


def metrics(recv: float, compute: float, release: float) -> Metrics:
    return Metrics(
        n_local=1,
        correct_local=1,
        n_test=0,
        correct_test=0,
        extra={"recv_t": recv, "compute_s": compute, "compute_cpu_s": compute, "release_t": release, "overrun_s": 0.0},
    )


class FakeLinks:
    def stats(self) -> list[dict[str, Any]]:
        return []


class FakeWatcher:
    def __init__(self, arrivals: list[Arrival]) -> None:
        self.arrivals = arrivals


def test_a_run_over_links_has_one_simulated_clock() -> None:
    # The progress bar and rounds[].sim_time_s took the wall clock x time scale, summary.md and the plots the
    # composed clock of the links section (the issue saw 657.9 s against about 129 s).
    clients = ["client-000", "client-001"]
    devices = expand(parse_fleet("rpi4+lte,rpi3+nb-iot"), 2)
    arrivals = [
        Arrival("client-000", 1, "train", "protos", 2000, 100.35, "f4"),
        Arrival("client-001", 1, "train", "protos", 2200, 100.9, "q8"),
        Arrival("client-000", 2, "train", "protos", 2000, 102.5, "f4"),
    ]
    shown: list[dict[str, Any]] = []
    cfg = make_config("fedproto", rounds=2)
    report = Report(SimulationSpec(preset="fedproto", rounds=2), cfg, np.zeros(0, np.int64), on_round=shown.append)
    report.links = LinkReport(
        devices,
        clients,
        FakeLinks(),
        FakeWatcher(arrivals),
        time_scale=10.0,
        deadline_s=60.0,
        adaptive=True,
        upload_share=0.8,
    )
    # round 2 closed at its deadline after 6 real s: 60 simulated s, though the wall clock says 80 s by then
    for rec, ms in (
        (
            RoundRecord(1, clients, 0, 0, 100.0, 101.0, "quorum"),
            {"client-000": metrics(100.1, 2.0, 100.3), "client-001": metrics(100.2, 3.0, 100.4)},
        ),
        (RoundRecord(2, ["client-000"], 0, 0, 102.0, 108.0, "deadline"), {"client-000": metrics(102.1, 2.0, 102.2)}),
    ):
        report.on_round_end(rec, None)  # type: ignore[arg-type]  # no FedAvg model to evaluate
        for cid, m in ms.items():
            report.on_metrics(cid, rec.round, m, 10)
        report.poll(rec.ended + 10.0)
    out = report.to_json({})
    composed = [r["sim_time_s"] for r in out["links"]["rounds"]]
    assert composed == pytest.approx([10.0, 70.0])
    assert [r["sim_time_s"] for r in out["rounds"]] == composed
    assert [r["sim_time_s"] for r in shown] == composed

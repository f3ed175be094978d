"""`protofl-server report`: PNGs and a markdown summary from run JSONs (a hand-made two-round run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from broker_server.commands.report_cli import run_accuracies, summary, target_round, time_to_target, write_report

REPO = Path(__file__).resolve().parents[2]


def device(rnd: int, cid: str, cls: str, made_it: bool, done: float | None, up: int, dt: str) -> dict[str, Any]:
    dev, link = cls.split("+")
    return {
        "round": rnd,
        "client": cid,
        "class": cls,
        "device": dev,
        "link": link,
        "made_it": made_it,
        "uplink_bytes": up,
        "dt": dt,
        "k": None,
        "budget_bytes": 10_000,
        "fits": True,
        "downlink_s": 1.0,
        "compute_s": 4.0,
        "compute_cpu_s": 1.0,
        "upload_s": None if done is None else done - 5.0,
        "done_s": done,
        "wall_done_s": done,
        "overrun_s": 0.0,
        "in_time": made_it,
    }


def run(preset: str, accs: list[float], round_s: list[float]) -> dict[str, Any]:
    rounds = [
        {"round": i + 1, "local_acc": a, "global_acc": a, "uplink_bytes": 1000 * (i + 1)} for i, a in enumerate(accs)
    ]
    t, lrounds = 0.0, []
    for i, s in enumerate(round_s):
        t += s
        lrounds.append(
            {"round": i + 1, "round_s": s, "wall_round_s": s, "closed_by": "quorum", "missed": [], "sim_time_s": t}
        )
    devices = [device(r, "client-000", "rpi4+lte", True, 6.0, 500, "f4") for r in (1, 2)]
    devices += [
        device(1, "client-001", "rpi3+nb-iot", False, None, 0, "q8"),
        device(2, "client-001", "rpi3+nb-iot", True, round_s[1], 300, "q8"),
    ]
    return {
        "preset": preset,
        "rounds": rounds,
        "totals": {"uplink_bytes": 3000},
        "links": {
            "time_scale": 10.0,
            "deadline_s": 60.0,
            "adaptive": True,
            "upload_share": 0.8,
            "rounds": lrounds,
            "devices": devices,
        },
    }


def test_time_to_target_reads_the_simulated_clock() -> None:
    r = run("tinyproto", [0.3, 0.6], [20.0, 30.0])
    assert time_to_target(r, 0.5) == 50.0  # reached in round 2, at 20 + 30 s
    assert time_to_target(r, 0.3) == 20.0 and time_to_target(r, 0.9) is None


def test_report_writes_the_plots_and_the_summary(tmp_path: Path) -> None:
    runs = [run("fedavg", [0.2, 0.5], [60.0, 60.0]), run("tinyproto", [0.3, 0.6], [20.0, 30.0])]
    paths = write_report(runs, tmp_path / "rep", target=0.5)
    names = sorted(p.name for p in paths)
    assert names == [
        "accuracy_time.png",
        "accuracy_uplink.png",
        "bytes_class.png",
        "summary.md",
        "timeline_fedavg.png",
        "timeline_tinyproto.png",
    ]
    assert all(p.stat().st_size > 1000 for p in paths)
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "| fedavg | 2 | global | 50.0 | 2 min 00 s | 1 min 00 s | 2.9 KB | 1 | 2 min 00 s |" in md
    assert "| tinyproto | 2 | global | 60.0 | 50.0 s | 25.0 s | 2.9 KB | 1 | 50.0 s |" in md
    assert "| rpi3+nb-iot | 1 | 1.0 | 4.0 |" in md and "1/2 |" in md  # missed one round of two


def test_default_target_is_ninety_percent_of_the_best_final_accuracy() -> None:
    assert "Target accuracy for time-to-target: 54.0 %" in summary([run("p", [0.3, 0.6], [1.0, 1.0])])


def test_report_command_exits_2_on_a_missing_run(tmp_path: Path) -> None:
    good = tmp_path / "run.json"
    good.write_text(json.dumps(run("tinyproto", [0.3, 0.6], [20.0, 30.0])))
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="250")  # rich wraps at the terminal width
    cmd = [sys.executable, "-m", "broker_server.cli", "report"]
    proc = subprocess.run(
        [*cmd, str(tmp_path / "absent.json"), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2 and "absent.json' not found" in proc.stderr, proc.stderr
    proc = subprocess.run(
        [*cmd, str(good), "--out", str(tmp_path / "o")], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "o" / "summary.md").is_file()


# -- issue 26: what a new user ran into ----------------------------------------------------------------


def test_report_reads_a_servers_rounds_jsonl(tmp_path: Path) -> None:
    # `protofl-server report STATE_DIR/rounds.jsonl` said "is not JSON: Extra data"; now it plots the real
    # federation's accuracies against its wall clock.
    lines = [
        {
            "fed": "lab",
            "preset": "tinyproto",
            "round": r,
            "clients": ["a", "b"],
            "uplink_bytes": 1000,
            "downlink_bytes": 5000,
            "started": 100.0 + 10 * r,
            "ended": 108.0 + 10 * r,
            "closed_by": "quorum",
            "local_acc": 0.2 * r,
            "global_acc": 0.1 * r,
            "local_proto_acc": None,
            "global_proto_acc": None,
        }
        for r in (1, 2, 3)
    ]
    path = tmp_path / "rounds.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"round": 4, "cli')  # torn last line
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="250")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "broker_server.cli",
            "report",
            str(path),
            "--out",
            str(tmp_path / "o"),
            "--target",
            "0.2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "o" / "summary.md").read_text()
    # 3 rounds, final global 30 %, 28 s from round 1's opening (110) to round 3's close (138); 20 % in round 2
    assert "| tinyproto | 3 | global | 30.0 | 28.0 s | 9.3 s | 2.9 KB | - | 18.0 s |" in md, md


def test_time_to_target_of_a_run_without_a_clock_is_its_round(tmp_path: Path) -> None:
    # A simulation without --profiles has no time axis: the summary said "not reached" although the
    # target was passed.
    r = run("fedproto", [0.3, 0.6], [1.0, 1.0])
    del r["links"]
    md = summary([r], target=0.5)
    assert "| fedproto | 2 | global | 60.0 | - | - | 2.9 KB | - | round 2 |" in md, md
    assert "| round 2 |" not in summary([r], target=0.9) and "not reached" in summary([r], target=0.9)


def test_round_axes_have_whole_number_ticks(tmp_path: Path, monkeypatch) -> None:
    # accuracy vs round had ticks at 1.25, 1.75 rounds.
    import matplotlib.figure

    ticks: list[list[float]] = []
    save = matplotlib.figure.Figure.savefig

    def recording(fig, *args, **kwargs):  # untyped: it stands in for Figure.savefig
        ax = fig.axes[0]
        lo, hi = ax.get_xlim()
        if ax.get_xlabel() == "round":
            ticks.append([t for t in ax.get_xticks() if lo <= t <= hi])
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", recording)
    r = run("fedproto", [0.3, 0.6], [1.0, 1.0])
    del r["links"]
    write_report(r, tmp_path / "o")
    assert ticks and all(t == int(t) for ts in ticks for t in ts), ticks


def test_an_overrun_longer_than_its_round_is_warned_in_the_summary() -> None:
    r = run("tinyproto", [0.3, 0.6], [20.0, 30.0])
    r["links"]["devices"][1]["overrun_s"] = 45.0  # round 2 lasted 30 simulated s
    md = summary([r])
    assert "**Warning (tinyproto):** this machine could not keep up with time scale 10" in md, md
    assert (
        "- round 2: client-000 (rpi4+lte) released its upload 45.0 s late, longer than the round itself (30.0 s)" in md
    )
    assert "Warning" not in summary([run("tinyproto", [0.3, 0.6], [20.0, 30.0])])


def test_an_overrun_longer_than_its_round_is_warned_in_the_log(caplog) -> None:
    from broker_server.simulation.run import warn_long_overruns

    r = run("tinyproto", [0.3, 0.6], [20.0, 30.0])
    warn_long_overruns(r)
    assert not caplog.records
    r["links"]["devices"][1]["overrun_s"] = 45.0
    warn_long_overruns(r)
    assert "could not keep up with --time-scale 10: 1 upload(s)" in caplog.text and "lower --time-scale" in caplog.text


def test_global_accuracy_never_mixes_in_local_figures_between_scored_rounds() -> None:
    # simulate's default scores the test set in the last round only: the rounds before have no global figure,
    # and their (higher) local accuracy must not reach a global target early
    rows = [{"round": 1, "local_acc": 0.9, "global_acc": None}, {"round": 2, "local_acc": 0.95, "global_acc": 0.6}]
    run = {"rounds": rows}
    assert run_accuracies(run) == [None, 0.6] and run_accuracies(run, "local") == [0.9, 0.95]
    assert target_round(run, 0.5) == 2 and target_round(run, 0.5, "local") == 1
    never = {"rounds": [{"round": 1, "local_acc": 0.9, "global_acc": None}]}  # no test set at all: local stands in
    assert run_accuracies(never) == [0.9]


# -- issue 41: say what each number is ------------------------------------------------------------------


def test_a_run_with_local_accuracy_only_says_it_is_on_each_devices_own_classes(tmp_path: Path, monkeypatch) -> None:
    # A real federation's rounds.jsonl has local figures only (its devices hold no test set): the report
    # showed them as "global accuracy". Now the row, the legend and the plots' axis say what they are.
    import matplotlib.figure

    labels: list[str] = []
    save = matplotlib.figure.Figure.savefig

    def recording(fig, *args, **kwargs):  # untyped: it stands in for Figure.savefig
        labels.append(fig.axes[0].get_ylabel())
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", recording)
    r = run("protofl", [0.7, 0.8], [1.0, 1.0])
    del r["links"]
    for row in r["rounds"]:
        row["global_acc"] = None
    md = summary([r], target=0.75)
    assert "| protofl | 2 | local (own classes) | 80.0 |" in md, md
    assert "local (own classes) = each device's model on a held-out part of its own data" in md, md
    assert "not the federation's accuracy on every class" in md and "global =" not in md, md
    write_report(r, tmp_path / "o")
    assert labels[:2] == ["local accuracy (own classes) (%)"] * 2, labels
    # mixed runs: each line names its accuracy
    labels.clear()
    write_report([r, run("fedavg", [0.2, 0.5], [60.0, 60.0])], tmp_path / "o2")
    assert labels[0] == "accuracy (%)", labels
    md = (tmp_path / "o2" / "summary.md").read_text()
    assert "| fedavg | 2 | global | 50.0 |" in md and "| protofl | 2 | local (own classes) | 80.0 |" in md, md


# -- issue 42 ------------------------------------------------------------------------------------------


def test_report_is_titled_by_what_it_read(tmp_path: Path) -> None:
    # `protofl-server report STATE/rounds.jsonl` titled a real federation's rounds "Simulation report".
    row = {"fed": "lab", "preset": "fedproto", "clients": ["a"], "uplink_bytes": 10, "downlink_bytes": 20}
    rounds = tmp_path / "rounds.jsonl"
    rounds.write_text("".join(json.dumps({**row, "round": r, "started": r, "ended": r + 0.5}) + "\n" for r in (1, 2)))
    sim = tmp_path / "run.json"
    sim.write_text(json.dumps(run("tinyproto", [0.3, 0.6], [20.0, 30.0])))
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="250")

    def title(*paths: Path) -> str:
        out = tmp_path / f"o{len(list(tmp_path.iterdir()))}"
        cmd = [sys.executable, "-m", "broker_server.cli", "report", *map(str, paths), "--out", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return (out / "summary.md").read_text().splitlines()[0]

    assert title(rounds) == "# Federation report (a server's rounds.jsonl)"
    assert title(sim) == "# Simulation report"
    assert title(sim, rounds) == "# Report: 1 simulation and 1 federation (a server's rounds.jsonl)"

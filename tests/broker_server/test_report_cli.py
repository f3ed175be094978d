"""`protofl-server report`: PNGs and a markdown summary from run JSONs (a hand-made two-round run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from broker_server.report_cli import summary, time_to_target, write_report

REPO = Path(__file__).resolve().parents[2]


def device(rnd: int, cid: str, cls: str, made_it: bool, done: float | None, up: int, dt: str) -> dict[str, Any]:
    dev, link = cls.split("+")
    return {"round": rnd, "client": cid, "class": cls, "device": dev, "link": link, "made_it": made_it,
            "uplink_bytes": up, "dt": dt, "k": None, "budget_bytes": 10_000, "fits": True, "downlink_s": 1.0,
            "compute_s": 4.0, "compute_cpu_s": 1.0, "upload_s": None if done is None else done - 5.0, "done_s": done,
            "wall_done_s": done, "overrun_s": 0.0, "in_time": made_it}


def run(preset: str, accs: list[float], round_s: list[float]) -> dict[str, Any]:
    rounds = [{"round": i + 1, "local_acc": a, "global_acc": a, "uplink_bytes": 1000 * (i + 1)} for i, a in enumerate(accs)]
    t, lrounds = 0.0, []
    for i, s in enumerate(round_s):
        t += s
        lrounds.append({"round": i + 1, "round_s": s, "wall_round_s": s, "closed_by": "quorum", "missed": [],
                        "sim_time_s": t})
    devices = [device(r, "client-000", "rpi4+lte", True, 6.0, 500, "f4") for r in (1, 2)]
    devices += [device(1, "client-001", "rpi3+nb-iot", False, None, 0, "q8"),
                device(2, "client-001", "rpi3+nb-iot", True, round_s[1], 300, "q8")]
    return {"preset": preset, "rounds": rounds, "totals": {"uplink_bytes": 3000},
            "links": {"time_scale": 10.0, "deadline_s": 60.0, "adaptive": True, "upload_share": 0.8,
                      "rounds": lrounds, "devices": devices}}


def test_time_to_target_reads_the_simulated_clock() -> None:
    r = run("tinyproto", [0.3, 0.6], [20.0, 30.0])
    assert time_to_target(r, 0.5) == 50.0  # reached in round 2, at 20 + 30 s
    assert time_to_target(r, 0.3) == 20.0 and time_to_target(r, 0.9) is None


def test_report_writes_the_plots_and_the_summary(tmp_path: Path) -> None:
    runs = [run("fedavg", [0.2, 0.5], [60.0, 60.0]), run("tinyproto", [0.3, 0.6], [20.0, 30.0])]
    paths = write_report(runs, tmp_path / "rep", target=0.5)
    names = sorted(p.name for p in paths)
    assert names == ["accuracy_time.png", "accuracy_uplink.png", "bytes_class.png", "summary.md",
                     "timeline_fedavg.png", "timeline_tinyproto.png"]
    assert all(p.stat().st_size > 1000 for p in paths)
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "| fedavg | 2 | 50.0 | 2 min 00 s | 1 min 00 s | 2.9 KB | 1 | 2 min 00 s |" in md
    assert "| tinyproto | 2 | 60.0 | 50.0 s | 25.0 s | 2.9 KB | 1 | 50.0 s |" in md
    assert "| rpi3+nb-iot | 1 | 1.0 | 4.0 |" in md and "1/2 |" in md  # missed one round of two


def test_default_target_is_ninety_percent_of_the_best_final_accuracy() -> None:
    assert "Target accuracy for time-to-target: 54.0 %" in summary([run("p", [0.3, 0.6], [1.0, 1.0])])


def test_report_command_exits_2_on_a_missing_run(tmp_path: Path) -> None:
    good = tmp_path / "run.json"
    good.write_text(json.dumps(run("tinyproto", [0.3, 0.6], [20.0, 30.0])))
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="250")  # rich wraps at the terminal width
    cmd = [sys.executable, "-m", "broker_server.cli", "report"]
    proc = subprocess.run([*cmd, str(tmp_path / "absent.json"), "--out", str(tmp_path / "o")], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 2 and "absent.json' not found" in proc.stderr, proc.stderr
    proc = subprocess.run([*cmd, str(good), "--out", str(tmp_path / "o")], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "o" / "summary.md").is_file()

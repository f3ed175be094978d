"""bench.paper_table: the quick suite end to end on tiny subsets (structure, not numbers), plus cheap units."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import paper_table, table_report
from bench.table_runs import RUN_BY_KEY, SECTIONS, suite_runs

ROOT = Path(__file__).resolve().parents[2]
FASHION = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")


def test_every_run_has_a_unique_key_and_valid_overrides():
    from protofl.presets import make_config

    keys = [r.key for r in suite_runs("full")]
    assert len(keys) == len(set(keys))
    for r in suite_runs("full"):
        make_config(r.preset, **dict(r.sets))  # every --set combination is a valid config
    for sec in SECTIONS:
        assert all(k in RUN_BY_KEY for k in sec.rows)


def test_run_args_are_the_public_cli_with_sets():
    run = RUN_BY_KEY["A/a0.5-refprotofl-no-both"]
    args = paper_table.run_args(run, "full")
    assert args[:3] == ["simulate", "--preset", "refprotofl"]
    joined = " ".join(args)
    assert "--set erpa=false --set prototypes=none --set apud=false" in joined
    assert "--clients 10 --alpha 0.5" in joined and "--dataset fashion-mnist" in joined
    # mu=auto stays a bare string, numbers are JSON
    assert "--set mu=auto" in " ".join(paper_table.run_args(RUN_BY_KEY["B/tinyproto-s51-auto"], "quick"))
    assert "--set proto_lambda=0.002" in " ".join(paper_table.run_args(RUN_BY_KEY["D/a-stages-all-lambda"], "quick"))


def test_plots_are_skipped_with_a_note_without_matplotlib(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(table_report, "_PLOT_NOTE_SHOWN", False)
    ctx = table_report.Context(suite="quick", sizing_key="tiny", run_root=tmp_path, table_path=tmp_path / "T.md",
                               command="x", git={"rev": "r", "dirty": False, "modified_tracked": 0, "untracked": 0},
                               runs=suite_runs("quick"), cached=lambda r: None)
    assert table_report.plot_section(ctx, SECTIONS[0], tmp_path / "p.png") is False
    assert "matplotlib" in capsys.readouterr().out
    table_report.write(ctx, quiet=True)  # a table with nothing run and no plots still renders
    text = (tmp_path / "T.md").read_text()
    assert "not run yet" in text and "NOT RUN" in text


@pytest.mark.slow
@pytest.mark.skipif(not FASHION.is_file(), reason="Fashion-MNIST (dataset-fashion-mnist) not installed")
def test_quick_suite_end_to_end_structure(tmp_path):
    cmd = [sys.executable, "-m", "bench.paper_table", "--suite", "quick", "--tiny", "--results", str(tmp_path)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    runs = suite_runs("quick")
    # every run cached once, with its exact command; no temporary files left behind
    for r in runs:
        rep = json.loads((tmp_path / r.setting / f"{r.name}.json").read_text())
        assert rep["bench"]["command"].startswith(f"protofl-server simulate --preset {r.preset} ")
        assert rep["rounds"] and rep["totals"]["uplink_bytes"] > 0
    assert not list(tmp_path.glob("*/.*"))

    text = (tmp_path / "TABLE.md").read_text()
    for head in ("- command: `python -m bench.paper_table --suite quick --tiny", "- written: ", "- machine: ",
                 "- git revision: ", "CPUs"):
        assert head in text
    assert re.search(r"git revision: [0-9a-f]{4,}|git revision: unknown", text)
    for setting in "ABCD":
        assert f"## Setting {setting}" in text
    header = "| " + " | ".join(table_report.COLUMNS) + " |"
    assert text.count(header) == sum(1 for s in SECTIONS if any(RUN_BY_KEY[k] in runs for k in s.rows))
    table_rows = [line for line in text.splitlines() if line.startswith("| ") and line != header]
    for r in runs:  # one row per method, with every column filled
        mine = [line for line in table_rows if line.startswith(f"| {r.label} |") or
                line.startswith(f"| *{r.label}")]
        assert mine, f"no row for {r.key}"
        cells = [c.strip() for c in mine[0].strip("|").split("|")]
        assert len(cells) == len(table_report.COLUMNS)
        assert re.fullmatch(r"\d+\.\d\d", cells[1]), cells  # local final is a number
        assert re.fullmatch(r"[\d,]+", cells[7]), cells  # uplink bytes per client per round
    goals = text.split("## Goals", 1)[1].split("\n## ", 1)[0]
    statuses = re.findall(r"^\d\. \*\*(MET|MISSED|NOT RUN)\*\*", goals, flags=re.M)
    assert len(statuses) == 4
    for sec in SECTIONS:
        if any(RUN_BY_KEY[k] in runs for k in sec.rows):
            png = tmp_path / "plots" / f"{sec.key}.png"
            assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            assert f"(plots/{sec.key}.png)" in text

    # resumable: a second call finds everything cached and redoes nothing
    mtimes = {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/*.json")}
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"{len(runs)} cached, 0 to run" in again.stdout
    assert mtimes == {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/*.json")}


def _fake_report(local: float, global_: float, uplink: int, ensemble: float | None = None) -> dict:
    return {"rounds": [{"clients": 1, "local_acc": local, "global_acc": global_, "ensemble_acc": ensemble,
                        "uplink_bytes": uplink}],
            "totals": {"uplink_bytes": uplink, "downlink_bytes": 0, "wall_s": 1.0}}


def _decision_ctx(tmp_path, reports: dict) -> table_report.Context:
    return table_report.Context(suite="full", sizing_key="full", run_root=tmp_path, table_path=tmp_path / "T.md",
                                command="x", git={"rev": "r", "dirty": False, "modified_tracked": 0, "untracked": 0},
                                runs=suite_runs("full"), cached=lambda r: reports.get(r.key))


def test_default_decision_picks_the_most_accurate_then_the_fewest_bytes(tmp_path):
    # (A global, B local, uplink per run): no-erpa is best; no-apud is 0.6 below (tied) and cheaper -> chosen;
    # no-cps is 1.2 below the best: not tied although it is the cheapest.
    numbers = {"all": (0.10, 0.30, 900), "no-erpa": (0.50, 0.86, 800), "no-apud": (0.494, 0.854, 300),
               "no-cps": (0.488, 0.848, 100), "no-scaling": (0.10, 0.30, 900)}
    reports = {}
    for suffix, (a_global, b_local, up) in numbers.items():
        reports[f"D/a-stages-{suffix}"] = _fake_report(0.8, a_global, up)
        reports[f"D/b-stages-{suffix}"] = _fake_report(b_local, 0.2, up)
    d = table_report.decide_default(_decision_ctx(tmp_path, reports))
    assert d.status == "CHOSEN"
    assert d.choice == {"erpa": True, "apud": False, "cps": True, "scaling": True, "refine": False}
    assert d.matches_preset == (table_report.preset_stages() == d.choice)
    text = "\n".join(d.lines)
    assert "| all stages w/o APUD | 49.40 | 85.40 | 67.40 | 0.001 | **chosen** |" in text
    assert "| all stages w/o ERPA | 50.00 | 86.00 | 68.00 | 0.002 | tied, more bytes |" in text
    assert "| all stages w/o CPS | 48.80 | 84.80 | 66.80 | 0.000 |  |" in text


def test_default_decision_waits_for_every_variant(tmp_path):
    d = table_report.decide_default(_decision_ctx(tmp_path, {"D/a-stages-all": _fake_report(0.5, 0.5, 1)}))
    assert d.status == "NOT RUN" and "D/b-stages-all" in d.lines[0] and d.choice is None


def test_a_cached_run_is_stale_when_its_resolved_config_changes(tmp_path, monkeypatch):
    from protofl import presets

    run = RUN_BY_KEY["D/a-protofl"]
    runner = paper_table.Runner("quick", tmp_path, None, 1, verbose=False)
    rep = {"config": paper_table.expected_config(run, "quick"),
           "bench": {"args": paper_table.run_args(run, "quick")}, "rounds": [], "totals": {}}
    path = runner.path(run)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(rep))
    assert runner.cached(run) is not None
    # the same command after the preset's default changed is another run: redo it
    flipped = {**presets.PRESETS["protofl"], "erpa": not presets.PRESETS["protofl"]["erpa"]}
    monkeypatch.setitem(presets.PRESETS, "protofl", flipped)
    assert runner.cached(run) is None
    monkeypatch.undo()
    assert runner.cached(run) is not None
    # a different command is stale too
    rep["bench"]["args"] = paper_table.run_args(run, "full")
    path.write_text(json.dumps(rep))
    assert runner.cached(run) is None


def test_goal_fedpagr_shows_the_spread_over_seeds_but_decides_on_seed_0(tmp_path):
    ens = {"fedproto": (0.52, 0.56, 0.41), "fedpagr": (0.43, 0.63, 0.68), "fedpagr-no-sep": (0.49, 0.69, 0.66),
           "fedpagr-no-ent": (0.45, 0.61, 0.65)}
    reports = {}
    for name, values in ens.items():
        for seed, v in zip((0, 1, 2), values):
            key = f"C/{name}" + ("" if seed == 0 else f"-seed{seed}")
            reports[key] = _fake_report(0.8, 0.2, 1, ensemble=v)
    goal = table_report.goal_fedpagr(_decision_ctx(tmp_path, reports))
    assert goal.status == "MISSED"  # seed 0: fedpagr 43 < fedproto 52
    text = "\n".join(goal.evidence)
    assert "fedpagr 43.00 / 63.00 / 68.00 (mean 58.00)" in text
    assert "fedpagr above fedproto in 2 of 3 seeds" in text
    assert "fedpagr +8.33 vs fedproto, w/o separation +3.33 and w/o entropy -1.00 vs fedpagr" in text
    del reports["C/fedpagr-seed2"]
    assert "not all of seeds 1, 2 are run yet" in "\n".join(table_report.goal_fedpagr(
        _decision_ctx(tmp_path, reports)).evidence)

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
    assert "--set proto_lambda=0.002" in " ".join(paper_table.run_args(RUN_BY_KEY["D/a-protofl-lambda"], "quick"))


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

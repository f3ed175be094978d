"""bench.paper_table: the quick suite end to end on tiny subsets (structure, not numbers), plus cheap units."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import paper_table, table_report
from bench.table_runs import ROW_BY_KEY, RUN_BY_KEY, SECTIONS, candidate_row, suite_runs

ROOT = Path(__file__).resolve().parents[2]
FASHION = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")


def test_every_run_has_a_unique_key_and_valid_overrides():
    from protofl.presets import make_config

    keys = [r.key for r in suite_runs("full")]
    assert len(keys) == len(set(keys))
    for r in suite_runs("full"):
        make_config(r.preset, **dict(r.sets))  # every --set combination is a valid config
    for sec in SECTIONS:
        assert all(k in ROW_BY_KEY for k in sec.rows)
    # every row of the full suite runs on at least three seeds (docs/algorithms.md, Evaluation > Statistics)
    seeds: dict[str, set[int]] = {}
    for r in suite_runs("full"):
        seeds.setdefault(r.row.key, set()).add(r.seed)
    assert seeds and all(len(v) >= 3 for v in seeds.values())


def test_run_args_are_the_public_cli_with_sets():
    run = RUN_BY_KEY["A/a0.5-refprotofl-no-both-s1"]
    args = paper_table.run_args(run, "full")
    assert args[:3] == ["simulate", "--preset", "refprotofl"]
    joined = " ".join(args)
    assert "--set erpa=false --set prototypes=none --set apud=false" in joined
    assert "--clients 10 --alpha 0.5" in joined and "--dataset fashion-mnist" in joined and "--seed 1" in joined
    # the full test set (no --test-limit), scored at the final round only
    assert "--test-limit" not in joined and "--eval-every 1 --test-every 10" in joined
    # strings stay bare, numbers are JSON
    assert "--set federate=adapter" in " ".join(paper_table.run_args(RUN_BY_KEY["D/a-all-s0"], "quick"))
    assert "--set proto_lambda=0.3" in " ".join(paper_table.run_args(RUN_BY_KEY["L/erpa-lambda0.3-s0"], "quick"))


def test_papers_rows_run_unclipped_and_old_runs_count_as_clipped():
    import dataclasses

    from bench.table_runs import with_clip

    run = RUN_BY_KEY["B/tinyproto-s0"]
    args = paper_table.run_args(run, "full")
    assert args[-3:] == ["--clip", "off", "-q"]  # a paper's row is its method: no upload clipping
    clipped = dataclasses.replace(run, row=dataclasses.replace(run.row, clip=True))
    assert paper_table.run_args(clipped, "full")[-3:] == ["--clip", "on", "-q"]
    # A run cached before --clip existed ran clipped (the simulator's default): it is the clipped row's run.
    legacy = [a for a in paper_table.run_args(clipped, "full") if a not in ("--clip", "on")]
    assert with_clip(legacy) == paper_table.run_args(clipped, "full") != args


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
    shown = [s for s in SECTIONS if any(r.row.key in s.rows for r in runs)]
    assert text.count(header) == len(shown)
    # the settings' tables (the summaries above them, papers' figures among them, have other columns)
    settings_part = text.split("\n## Setting ", 1)[1]
    table_rows = [line for line in settings_part.splitlines() if line.startswith("| ") and line != header]
    for r in runs:  # one row per method, with every column filled
        mine = [line for line in table_rows if line.startswith(f"| {r.row.label} |")]
        assert mine, f"no row for {r.key}"
        cells = [c.strip() for c in mine[0].strip("|").split("|")]
        assert len(cells) == len(table_report.COLUMNS)
        assert cells[1] == "0"  # the seeds it ran on (quick: seed 0 only)
        assert re.fullmatch(r"\d+\.\d\d", cells[2]), cells  # local accuracy is a number
        assert re.fullmatch(r"[\d,]+", cells[8]), cells  # uplink bytes per client per round
    goals = text.split("## Goals", 1)[1].split("\n## ", 1)[0]
    statuses = re.findall(r"^\d\. \*\*(MET|MISSED|NOT RUN)\*\*", goals, flags=re.M)
    assert len(statuses) == 4
    for sec in shown:
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


def _ctx(tmp_path, reports: dict) -> table_report.Context:
    return table_report.Context(suite="full", sizing_key="full", run_root=tmp_path, table_path=tmp_path / "T.md",
                                command="x", git={"rev": "r", "dirty": False, "modified_tracked": 0, "untracked": 0},
                                runs=suite_runs("full"), cached=lambda r: reports.get(r.key))


def _seeded(row: str, per_seed: list[dict]) -> dict:
    return {f"{row}-s{seed}": rep for seed, rep in enumerate(per_seed)}


def test_beats_needs_the_mean_and_every_seed(tmp_path):
    reports = {**_seeded("A/a0.5-fedproto", [_fake_report(0.8, g, 1) for g in (0.50, 0.60, 0.40)]),
               **_seeded("A/a0.5-refprotofl", [_fake_report(0.8, g, 1) for g in (0.55, 0.58, 0.50)])}
    ctx = _ctx(tmp_path, reports)
    fp, rp = table_report.row_stats(ctx, "A/a0.5-fedproto"), table_report.row_stats(ctx, "A/a0.5-refprotofl")
    # refprotofl is ahead on the mean (54.3 vs 50.0) but behind in seed 1: a tie, not a win
    assert not table_report.beats(rp, fp, "global_acc") and not table_report.beats(fp, rp, "global_acc")
    goal = table_report.goal_refprotofl(ctx)
    assert goal.status == "MET" and "a tie" in "\n".join(goal.evidence)
    assert "effect +4.33 points" in goal.evidence[0] and "ahead in 2 of 3 seeds" in goal.evidence[0]
    assert table_report.mean_std(rp, "global_acc") == "54.33 ± 4.04"
    # ahead in every seed and on the mean: fedproto beats it -> missed
    reports.update(_seeded("A/a0.5-fedproto", [_fake_report(0.8, g, 1) for g in (0.60, 0.60, 0.60)]))
    assert table_report.goal_refprotofl(_ctx(tmp_path, reports)).status == "MISSED"


def test_a_goal_waits_for_every_seed(tmp_path):
    reports = _seeded("B/fedproto", [_fake_report(0.8, 0.5, 100)] * 3)
    reports.update(_seeded("B/tinyproto", [_fake_report(0.8, 0.5, 10)] * 2))  # seed 2 missing
    goal = table_report.goal_tinyproto(_ctx(tmp_path, reports))
    assert goal.status == "NOT RUN" and "`B/tinyproto` (2 of 3 seeds)" in goal.evidence[0]


def test_default_decision_picks_the_fewest_bytes_among_those_the_best_does_not_beat(tmp_path):
    # per candidate: (A global per seed, B local per seed, uplink per run)
    numbers = {"all": ((0.60, 0.62, 0.61), (0.80, 0.82, 0.81), 900),      # best score
               "no-apud": ((0.59, 0.63, 0.60), (0.80, 0.81, 0.80), 300),  # behind on the mean, ahead in seed 1: tied
               "no-erpa": ((0.55, 0.57, 0.56), (0.78, 0.79, 0.78), 100),  # behind everywhere: beaten
               "no-cps": ((0.10, 0.10, 0.10), (0.10, 0.10, 0.10), 50),  # its rows are refprotofl's
               "spherical": ((0.50, 0.50, 0.50), (0.70, 0.70, 0.70), 10),
               "spherical-refine": ((0.50, 0.50, 0.50), (0.70, 0.70, 0.70), 20),
               "spherical-erpa": ((0.60, 0.62, 0.61), (0.80, 0.82, 0.81), 950)}  # equal to the best: tied
    reports = {}
    for suffix, (a_global, b_local, up) in numbers.items():
        reports.update(_seeded(candidate_row("a", suffix), [_fake_report(0.8, g, up) for g in a_global]))
        reports.update(_seeded(candidate_row("b", suffix), [_fake_report(b, 0.2, up) for b in b_local]))
    d = table_report.decide_default(_ctx(tmp_path, reports))
    assert d.status == "CHOSEN"
    assert d.choice == {"federate": "adapter", "prototypes": "mean", "consensus": False, "erpa": True, "apud": False,
                        "cps": True, "cps_s": None, "scaling": False, "refine": False}
    assert d.matches_preset == (table_report.preset_stages() == d.choice)
    text = "\n".join(d.lines)
    assert "**chosen**" in text and "beaten by all" in text and "within noise, more bytes" in text


def test_default_decision_waits_for_every_candidate(tmp_path):
    d = table_report.decide_default(_ctx(tmp_path, _seeded("D/a-all", [_fake_report(0.5, 0.5, 1)] * 3)))
    assert d.status == "NOT RUN" and "D/b-all" in d.lines[0] and d.choice is None


def test_a_cached_run_is_stale_when_its_resolved_config_changes(tmp_path, monkeypatch):
    from protofl import presets

    run = RUN_BY_KEY["A/a0.5-tinyproto-s0"]
    runner = paper_table.Runner("quick", tmp_path, None, 1, verbose=False)
    rep = {"config": paper_table.expected_config(run, "quick"),
           "bench": {"args": paper_table.run_args(run, "quick")}, "rounds": [], "totals": {}}
    path = runner.path(run)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(rep))
    assert runner.cached(run) is not None
    # the same command after the preset's default changed is another run: redo it
    monkeypatch.setitem(presets.PRESETS, "tinyproto", {**presets.PRESETS["tinyproto"], "mu": 1.5e-4})
    assert runner.cached(run) is None
    monkeypatch.undo()
    assert runner.cached(run) is not None
    # a different command is stale too
    rep["bench"]["args"] = paper_table.run_args(run, "full")
    path.write_text(json.dumps(rep))
    assert runner.cached(run) is None


def test_a_config_field_added_since_the_run_keeps_the_cache_while_it_holds_its_default(tmp_path):
    run = RUN_BY_KEY["A/a0.5-tinyproto-s0"]
    config = paper_table.expected_config(run, "quick")
    rep = {"config": {k: v for k, v in config.items() if k != "pagr_train_head"}}  # made before the field existed
    assert paper_table.config_matches(rep, run, "quick")
    rep["config"]["no_longer_a_field"] = 1  # a field that is gone: stale
    assert not paper_table.config_matches(rep, run, "quick")
    fedpagr = RUN_BY_KEY["C/fedpagr-train-head-s0"]  # the new field set away from its default: stale
    old = {k: v for k, v in paper_table.expected_config(fedpagr, "quick").items() if k != "pagr_train_head"}
    assert not paper_table.config_matches({"config": old}, fedpagr, "quick")


def test_a_missed_goal_4_names_the_closest_candidate_and_by_how_much(tmp_path):
    suffix = table_report.preset_variant()
    assert suffix is not None  # the preset is one of setting D's candidates
    reports = {}
    for key in ("A/a0.5-refprotofl", "A/a0.5-tinyproto", "A/a0.5-fedpagr"):
        reports.update(_seeded(key, [_fake_report(0.8, 0.40, 100)] * 3))
    for key, local in (("B/refprotofl", 0.80), ("B/tinyproto", 0.80), ("B/fedpagr", 0.86)):
        reports.update(_seeded(key, [_fake_report(local, 0.2, 100)] * 3))
    reports.update(_seeded(candidate_row("a", suffix), [_fake_report(0.8, 0.45, 150)] * 3))
    reports.update(_seeded(candidate_row("b", suffix), [_fake_report(0.85, 0.2, 150)] * 3))
    goal = table_report.goal_protofl(_ctx(tmp_path, reports))
    assert goal.status == "MISSED"
    assert any("B: beaten by fedpagr" in e for e in goal.evidence)
    closest = next(e for e in goal.evidence if e.startswith("closest within the 2x byte budget:"))
    assert "short by 1.00 points at 1.50x" in closest
    if suffix == "spherical":  # the gap to fedpagr split into the masks' part and refinement's
        assert goal.evidence[-1] == "why (B): waiting for `B/fedpagr-no-refine`, the row between the preset and fedpagr"
        reports.update(_seeded("B/fedpagr-no-refine", [_fake_report(local, 0.2, 100) for local in (0.845, 0.858, 0.857)]))
        why = table_report.goal_protofl(_ctx(tmp_path, reports)).evidence[-1]
        # w/o masks is ahead of the preset in 2 of 3 seeds (a tie); fedpagr is ahead of it in every seed
        assert "Masks: w/o masks 85.33 ± 0.72 vs preset 85.00 ± 0.00: effect +0.33 points" in why
        assert "ahead in 2 of 3 seeds" in why and "fedpagr ahead in 3 of 3 seeds" in why
        assert why.endswith("the gap comes from refinement (ahead on the mean and in every seed)")


def test_the_lambda_sweep_says_whether_the_chosen_lambda_beats_the_default(tmp_path):
    # CPS: 0.3 best on seed 0 and ahead of lambda = 1 in every seed; ERPA: 0.3 best on seed 0, tied after
    reports = {**_seeded("A/a0.5-tinyproto", [_fake_report(0.8, g, 1) for g in (0.44, 0.42, 0.42)]),
               **_seeded("A/a0.5-refprotofl", [_fake_report(0.8, g, 1) for g in (0.48, 0.46, 0.455)])}
    for lam, (cps, erpa) in {0.3: ((0.46, 0.44, 0.43), (0.482, 0.459, 0.452)), 3.0: ((0.41, 0.39, 0.40), (0.47,) * 3),
                             10.0: ((0.37, 0.32, 0.34), (0.47,) * 3)}.items():
        reports.update(_seeded(f"L/cps-lambda{lam:g}", [_fake_report(0.8, g, 1) for g in cps]))
        reports.update(_seeded(f"L/erpa-lambda{lam:g}", [_fake_report(0.8, g, 1) for g in erpa]))
    lines = table_report.sweep_lines(_ctx(tmp_path, reports))
    cps = next(line for line in lines if line.startswith("| CPS") and "chosen" in line)
    erpa = next(line for line in lines if line.startswith("| ERPA") and "chosen" in line)
    assert "| 0.3 |" in cps and "beats lambda = 1" in cps and "grid's edge" in cps
    assert "| 0.3 |" in erpa and "ties lambda = 1 (the default stays)" in erpa


def test_papers_figures_sit_beside_ours_and_refprotofls_gap_is_set_against_fedavgs(tmp_path):
    reports = {**_seeded("A/a0.5-fedavg", [_fake_report(0.8, 0.70, 1)] * 3),
               **_seeded("A/a0.5-fedproto", [_fake_report(0.8, 0.45, 1, ensemble=0.72)] * 3),
               **_seeded("A/a0.5-refprotofl", [_fake_report(0.8, g, 1, ensemble=0.73) for g in (0.46, 0.47, 0.48)])}
    lines = table_report.paper_lines(_ctx(tmp_path, reports))
    text = "\n".join(lines)
    # paper 73.82 (fedproto), 73.72 (fedavg): ours 45.00 and 70.00
    assert "| fedproto | A: 10 clients, alpha 0.5 | global | 73.82 [R05] | 45.00 ± 0.00 | -28.82 |" in lines
    assert "| refprotofl | A: 10 clients, alpha 0.5 | global | 74.21 [R05] | 47.00 ± 1.00 | -27.21 |" in lines
    assert "| fedavg | A: 10 clients, alpha 100 | global | 85.10 [R100] | not run yet | - |" in lines
    assert "Measured, ours - paper in points: FedAvg's global model -3.72; " in text
    assert "fedproto global -28.82 (-25.10 beyond FedAvg's), ensemble -1.82" in text
    assert "refprotofl global -27.21 (-23.49 beyond FedAvg's), ensemble -1.21." in text
    # no split where FedAvg has not run
    assert "Measured" not in "\n".join(table_report.paper_lines(_ctx(tmp_path, {k: v for k, v in reports.items()
                                                                                if "fedavg" not in k})))

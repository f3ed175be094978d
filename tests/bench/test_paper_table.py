"""bench.paper_table: the quick suite end to end on tiny subsets (structure, not numbers), plus cheap units."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import paper_table, table_report
from bench.table_runs import ROW_BY_KEY, RUN_BY_KEY, SECTIONS, candidate_row, decision_row, suite_runs

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
    # the rows a goal is judged on run unclipped on seeds 0-4, each beside a clipped twin on seeds 0-2
    for key in ("B/fedproto", "B/tinyproto", "A/a0.5-refprotofl", "C/fedpagr-no-ent", candidate_row("b", "spherical")):
        row, twin = ROW_BY_KEY[key], ROW_BY_KEY[f"{key}-clipped"]
        assert row.seeds == (0, 1, 2, 3, 4) and not row.clip
        assert twin.seeds == (0, 1, 2) and twin.clip and twin.label.endswith("[clipped]")
    # every federation has its local-only control, which trains on the cross-entropy alone
    for key in ("A/a0.5-local-only", "A/a100-local-only", "B/local-only", "C/local-only"):
        assert ROW_BY_KEY[key].preset == "fedproto" and dict(ROW_BY_KEY[key].sets) == {"proto_lambda": 0}


def test_run_args_are_the_public_cli_with_sets():
    run = RUN_BY_KEY["A/a0.5-refprotofl-no-both-s1"]
    args = paper_table.run_args(run, "full")
    assert args[:3] == ["simulate", "--preset", "refprotofl"]
    joined = " ".join(args)
    assert "--set erpa=false --set prototypes=none --set apud=false" in joined
    assert "--clients 10 --alpha 0.5" in joined and "--dataset fashion-mnist" in joined and "--seed 1" in joined
    # the full test set, asked for explicitly (whatever the simulator's default), scored at the final round only
    assert "--test-limit 10000 --eval-every 1 --test-every 10" in joined
    # strings stay bare, numbers are JSON
    assert "--set federate=adapter" in " ".join(paper_table.run_args(RUN_BY_KEY["D/a-all-s0"], "quick"))
    assert "--set proto_lambda=0.3" in " ".join(paper_table.run_args(RUN_BY_KEY["L/erpa-lambda0.3-s0"], "quick"))


def test_papers_rows_run_unclipped_and_old_runs_count_as_clipped():
    import dataclasses

    from bench.table_runs import as_spelled_today

    run = RUN_BY_KEY["B/tinyproto-s0"]
    args = paper_table.run_args(run, "full")
    assert args[-3:] == ["--clip", "off", "-q"]  # a paper's row is its method: no upload clipping
    clipped = dataclasses.replace(run, row=dataclasses.replace(run.row, clip=True))
    assert paper_table.run_args(clipped, "full")[-3:] == ["--clip", "on", "-q"]
    # A run cached before --clip existed ran clipped (the simulator's default): it is the clipped row's run;
    # one cached without --test-limit scored the whole test set.
    legacy = [a for a in paper_table.run_args(clipped, "full") if a not in ("--clip", "on", "--test-limit", "10000")]
    assert as_spelled_today(legacy) == paper_table.run_args(clipped, "full") != args


def test_plots_are_skipped_with_a_note_without_matplotlib(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(table_report, "_PLOT_NOTE_SHOWN", False)
    ctx = table_report.Context(
        suite="quick",
        sizing_key="tiny",
        run_root=tmp_path,
        table_path=tmp_path / "T.md",
        command="x",
        git={"rev": "r", "dirty": False, "modified_tracked": 0, "untracked": 0},
        runs=suite_runs("quick"),
        cached=lambda r: None,
    )
    assert table_report.plot_section(ctx, SECTIONS[0], tmp_path / "p.png") is False
    assert "matplotlib" in capsys.readouterr().out
    table_report.write(ctx, quiet=True)  # a table with nothing run and no plots still renders
    text = (tmp_path / "T.md").read_text()
    assert "not run yet" in text and "NOT RUN" in text


@pytest.mark.slow
@pytest.mark.skipif(not FASHION.is_file(), reason="Fashion-MNIST (dataset-fashion-mnist) not installed")
def test_quick_suite_end_to_end_structure(tmp_path):
    # One row of each setting (every preset kind of run: adapters, CPS, an architecture mix, the default's
    # ablation), two at once: the runs are independent processes (and --jobs is what a user runs the suite with).
    # The quick suite's other rows are the same command with other presets: a row per setting keeps this ~30 s.
    rows = ("A/a0.5-refprotofl", "B/tinyproto", "C/fedpagr", "D/a-spherical")
    cmd = [
        sys.executable,
        "-m",
        "bench.paper_table",
        "--suite",
        "quick",
        "--tiny",
        "--jobs",
        "2",
        "--rows",
        ",".join(rows),
        "--results",
        str(tmp_path),
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    runs = [r for r in suite_runs("quick") if r.row.key in rows]
    assert len(runs) == len(rows)
    # every run cached once, with its exact command; no temporary files left behind
    for r in runs:
        rep = json.loads((tmp_path / r.setting / f"{r.name}.json").read_text())
        assert rep["bench"]["command"].startswith(f"protofl-server simulate --preset {r.preset} ")
        assert rep["rounds"] and rep["totals"]["uplink_bytes"] > 0
    assert not list(tmp_path.glob("*/.*"))

    text = (tmp_path / "TABLE.md").read_text()
    for head in (
        "- command: `python -m bench.paper_table --suite quick --tiny",
        "- written: ",
        "- machine: ",
        "- git revision: ",
        "CPUs",
    ):
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
        assert re.fullmatch(r"\d+\.\d\d( \(cos\))?", cells[2]), cells  # local accuracy is a number
        assert re.fullmatch(r"[\d,]+", cells[10]), cells  # uplink bytes per client per round
    goals = text.split("## Goals", 1)[1].split("\n## ", 1)[0]
    statuses = re.findall(r"^\d\. \*\*(MET|MISSED|UNDECIDED|NOT RUN)\*\*", goals, flags=re.M)
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
    return {
        "rounds": [
            {"clients": 1, "local_acc": local, "global_acc": global_, "ensemble_acc": ensemble, "uplink_bytes": uplink}
        ],
        "totals": {"uplink_bytes": uplink, "downlink_bytes": 0, "wall_s": 1.0},
    }


def _ctx(tmp_path, reports: dict) -> table_report.Context:
    return table_report.Context(
        suite="full",
        sizing_key="full",
        run_root=tmp_path,
        table_path=tmp_path / "T.md",
        command="x",
        git={"rev": "r", "dirty": False, "modified_tracked": 0, "untracked": 0},
        runs=suite_runs("full"),
        cached=lambda r: reports.get(r.key),
    )


def _seeded(row: str, per_seed: list[dict]) -> dict:
    return {f"{row}-s{seed}": rep for seed, rep in enumerate(per_seed)}


def _five(row: str, values: list[float], metric: str = "global_acc", up: int = 1) -> dict:
    """Fake runs of a row on seeds 0..n-1, one value each for `metric` (the others fixed)."""
    out = {}
    for seed, v in enumerate(values):
        rep = _fake_report(0.8, 0.5, up)
        rep["rounds"][0][metric] = v
        out[f"{row}-s{seed}"] = rep
    return out


def test_goal_2_is_judged_paired_by_seed_with_an_interval(tmp_path):
    # refprotofl - fedproto per seed, in points: +5, -2, +10, +3, +4 -> mean 4.0, s = 4.3012, t(4) = 2.7764,
    # half width 5.3406: [-1.34, +9.34]: neither beats, not within 1 -> undecided, though ahead on the mean
    # (the old rule said "a tie", and counted it as met).
    reports = {
        **_five("A/a0.5-fedproto", [0.50, 0.60, 0.40, 0.50, 0.50]),
        **_five("A/a0.5-refprotofl", [0.55, 0.58, 0.50, 0.53, 0.54]),
    }
    goal = table_report.goal_refprotofl(_ctx(tmp_path, reports))
    assert goal.status == "UNDECIDED"
    text = "\n".join(goal.evidence)
    assert "judged on the rows run unclipped, 5 seeds" in text
    assert "refprotofl - fedproto = +4.00 [-1.34, +9.34] (+-+++, 5 seeds) -> undecided (5 seeds)" in text
    assert (
        table_report.mean_std(table_report.row_stats(_ctx(tmp_path, reports), "A/a0.5-refprotofl"), "global_acc")
        == "54.00 ± 2.92"
    )
    # fedproto ahead by 2 points in every seed, give or take 0.5: fedproto beats it by more than 1 -> missed
    reports.update(_five("A/a0.5-refprotofl", [0.48, 0.585, 0.38, 0.475, 0.48]))
    assert table_report.goal_refprotofl(_ctx(tmp_path, reports)).status == "MISSED"
    # within 1 point (differences -0.2, +0.1, 0, -0.1, +0.2): met
    reports.update(_five("A/a0.5-refprotofl", [0.498, 0.601, 0.40, 0.499, 0.502]))
    goal = table_report.goal_refprotofl(_ctx(tmp_path, reports))
    assert goal.status == "MET" and "refprotofl is within 1 of fedproto (5 seeds)" in goal.evidence[1]


def test_a_goal_uses_the_clipped_twins_until_its_five_seeds_are_in(tmp_path):
    reports = _five("B/fedproto", [0.8] * 5, "local_acc", up=100)
    reports.update(_five("B/tinyproto", [0.8] * 2, "local_acc", up=10))  # seeds 2-4 missing
    goal = table_report.goal_tinyproto_at(_ctx(tmp_path, reports))
    assert goal.status == "NOT RUN" and "`B/tinyproto` seeds 2,3,4" in goal.evidence[1]
    assert "`B/fedproto-clipped` seeds 0,1,2" in goal.evidence[1]
    # the clipped twins (seeds 0-2) are complete: provisional verdicts on them, the missing runs listed
    reports.update(_five("B/fedproto-clipped", [0.80, 0.82, 0.81], "local_acc", up=100))
    reports.update(_five("B/tinyproto-clipped", [0.79, 0.83, 0.80], "local_acc", up=10))
    goal = table_report.goal_tinyproto_at(_ctx(tmp_path, reports))
    text = "\n".join(goal.evidence)
    assert goal.evidence[0].startswith("judged PROVISIONAL, on the clipped twins")
    assert "missing runs: `B/tinyproto` seeds 2,3,4" in text
    # the goal's metric (TinyProto's eq. 12) is not in these runs: not run on it; the head's verdict beside it
    assert goal.status == "NOT RUN" and "not in these runs" in text
    # tinyproto - fedproto: -1, +1, -1 -> mean -0.33, s = 1.1547, half width 4.3027 * 1.1547 / sqrt(3) = 2.868
    assert "tinyproto - fedproto = -0.33 [-3.20, +2.54] (-+-, 3 seeds) -> undecided (3 seeds)" in text
    # the cost of clipping, twin - row on common seeds: fedproto 0, +2, +1 -> [-1.48, +3.48]
    assert (
        "clipped - unclipped (head, local split, final round): `B/fedproto` +1.00 [-1.48, +3.48] (0++, 3 seeds)" in text
    )
    # three unclipped seeds in common: the goal reads them (the papers' methods as written) before the twins
    reports.update(_five("B/tinyproto", [0.8] * 3, "local_acc", up=10))
    goal = table_report.goal_tinyproto_at(_ctx(tmp_path, reports))
    assert goal.evidence[0] == (
        "judged PROVISIONAL, on the rows run unclipped, on their 3 common seeds (0,1,2; a goal's rows run on 5)"
    )
    assert "missing runs: `B/tinyproto` seeds 3,4" in goal.evidence[1]


def test_goal_1_reads_tinyprotos_own_metric_at_its_best_round(tmp_path):
    def run(own_by_round: list[float], up: int) -> dict:
        rep = _fake_report(0.8, 0.5, up)
        rep["rounds"] = [
            {**rep["rounds"][0], "round": i + 1, "local_own_proto_acc": v} for i, v in enumerate(own_by_round)
        ]
        return rep

    # fedproto: best 0.80 in every seed; tinyproto: best 0.805, 0.797, 0.80, 0.802, 0.798 (its final rounds lower)
    reports = {f"B/fedproto-s{s}": run([0.70, 0.80, 0.75], 1000) for s in range(5)}
    for s, best in enumerate((0.805, 0.797, 0.80, 0.802, 0.798)):
        reports[f"B/tinyproto-s{s}"] = run([0.60, best, 0.50], 100)
    goal = table_report.goal_tinyproto_at(_ctx(tmp_path, reports))
    assert goal.status == "MET", goal.evidence
    assert "tinyproto is within 1 of fedproto (5 seeds)" in goal.evidence[1]
    assert "10.00x fewer (>= 8x)" in goal.evidence[2]
    assert table_report.summary(reports["B/tinyproto-s0"])["local_own_proto_acc@best"] == 0.805
    # at 5x fewer bytes the same accuracies miss
    for s in range(5):
        reports[f"B/tinyproto-s{s}"]["totals"]["uplink_bytes"] = 200
    assert table_report.goal_tinyproto_at(_ctx(tmp_path, reports)).status == "MISSED"


def test_goal_1_is_judged_at_the_papers_lambda_first_then_at_the_presets(tmp_path):
    def run(own: float, up: int) -> dict:
        rep = _fake_report(0.8, 0.5, up)
        rep["rounds"][0]["local_own_proto_acc"] = own
        return rep

    # fedproto 0.80 everywhere; tinyproto at lambda = 1 ahead by 1-2 points, at the preset's 0.1 behind by 2-3
    reports = {f"B/fedproto-s{s}": run(0.80, 1000) for s in range(5)}
    for s, (one, preset) in enumerate(((0.81, 0.78), (0.82, 0.77), (0.815, 0.775), (0.81, 0.78), (0.82, 0.77))):
        reports[f"B/tinyproto-lambda1-s{s}"] = run(one, 100)
        reports[f"B/tinyproto-s{s}"] = run(preset, 100)
    goal = table_report.goal_tinyproto(_ctx(tmp_path, reports))
    assert [p.status for p in goal.parts] == ["MET", "MISSED"] and goal.status == "MET"
    assert goal.parts[0].condition == "at the paper's lambda = 1 (`B/tinyproto-lambda1`)"
    assert goal.parts[1].condition.startswith("at the preset's lambda = ")
    assert "tinyproto beats fedproto (5 seeds)" in goal.parts[0].evidence[1]
    assert "fedproto beats tinyproto (5 seeds)" in goal.parts[1].evidence[1]
    # the table's line names both verdicts, the paper's lambda first
    text = "\n".join(table_report.goal_lines([goal]))
    line = text.splitlines()[0]
    assert line.startswith("1. **MET** at the paper's lambda = 1 (`B/tinyproto-lambda1`); **MISSED** at the preset's")
    assert "   - at the paper's lambda = 1 (`B/tinyproto-lambda1`): **MET**" in text


def test_a_rows_runs_made_while_the_preset_had_its_value_are_its_cached_runs(tmp_path):
    """`B/tinyproto-lambda1` spells proto_lambda=1 out; its runs were made while the preset's default was 1,
    without the --set: they count when their resolved config is today's, and the table shows both commands."""
    import dataclasses

    runner = paper_table.Runner("full", tmp_path, None, 1, verbose=False)
    run = RUN_BY_KEY["B/tinyproto-lambda1-s3"]
    assert "--set proto_lambda=1.0" in " ".join(paper_table.run_args(run, "full"))
    then = paper_table.run_args(run, "full", as_made=True)
    assert "proto_lambda" not in " ".join(then)
    rep: dict[str, Any] = {
        "config": paper_table.expected_config(run, "full"),
        "bench": {"args": then, "command": "protofl-server " + " ".join(then)},
        "rounds": [],
        "totals": {},
    }
    runner.path(run).parent.mkdir(parents=True)
    runner.path(run).write_text(json.dumps(rep))
    assert runner.cached(run) is not None
    # the same spelling with the preset's lambda now (0.1) is another config: stale
    rep["config"] = paper_table.expected_config(RUN_BY_KEY["B/tinyproto-s3"], "full")
    runner.path(run).write_text(json.dumps(rep))
    assert runner.cached(run) is None
    # a row without made_as takes today's spelling only
    plain = dataclasses.replace(run, row=dataclasses.replace(run.row, made_as=None))
    assert paper_table.run_args(plain, "full", as_made=True) == paper_table.run_args(plain, "full")


def test_cosine_classifiers_and_cells_on_fewer_seeds_are_marked(tmp_path):
    assert table_report.classifier("B/fedpagr") == table_report.COSINE
    assert table_report.classifier(candidate_row("b", "spherical")) == table_report.COSINE
    assert table_report.classifier("B/tinyproto") == table_report.HEAD
    assert table_report.classifier("D/a-all") == table_report.HEAD  # mean prototypes: the head predicts
    assert table_report.metric_name("local_acc", a="B/fedproto") == "head, local split, final round"
    assert table_report.metric_name("local_acc", a="B/fedpagr").startswith("cosine classifier")
    assert table_report.metric_name("local_acc", x="B/fedpagr", y="B/fedproto") == (
        "own classifier (x: cosine to P; y: head), local split, final round"
    )
    # fedpagr's eq. 12 figure on seeds 3-4 of 0-4: a dagger, and a footnote naming the seeds
    reports: dict[str, dict] = {}
    for s in range(5):
        rep = _fake_report(0.8, 0.5, 1)
        if s >= 3:
            rep["rounds"][0]["local_own_proto_acc"] = 0.7
        reports[f"B/fedpagr-s{s}"] = rep
    sec = next(s for s in SECTIONS if s.key == "B")
    fewer: list[str] = []
    line = table_report._row_line(_ctx(tmp_path, reports), "B/fedpagr", sec, fewer)
    assert line is not None
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2] == "80.00 ± 0.00 (cos)" and cells[4] == "70.00 ± 0.00 †" and cells[3] == "-"
    assert fewer == [
        "fedpagr (single arch), *nearest own proto local, best rnd*: seeds 3,4 only; the runs of seeds 0,1,2 do not "
        "report it"
    ]


def test_default_decision_picks_the_fewest_bytes_among_those_the_best_does_not_beat(tmp_path):
    # per candidate: (A global per seed, B local per seed, uplink per run)
    numbers = {
        "all": ((0.60, 0.62, 0.61), (0.80, 0.82, 0.81), 900),  # best score
        "no-apud": ((0.59, 0.63, 0.60), (0.80, 0.81, 0.80), 300),  # behind on the mean, ahead in seed 1: tied
        "no-erpa": ((0.55, 0.57, 0.56), (0.78, 0.79, 0.78), 100),  # behind everywhere: beaten
        "no-cps": ((0.10, 0.10, 0.10), (0.10, 0.10, 0.10), 50),  # its rows are refprotofl's
        "spherical": ((0.50, 0.50, 0.50), (0.70, 0.70, 0.70), 10),
        "spherical-refine": ((0.50, 0.50, 0.50), (0.70, 0.70, 0.70), 20),
        "spherical-erpa": ((0.60, 0.62, 0.61), (0.80, 0.82, 0.81), 950),
    }  # equal to the best: tied
    reports = {}
    for suffix, (a_global, b_local, up) in numbers.items():
        reports.update(_seeded(decision_row("a", suffix), [_fake_report(0.8, g, up) for g in a_global]))
        reports.update(_seeded(decision_row("b", suffix), [_fake_report(b, 0.2, up) for b in b_local]))
    d = table_report.decide_default(_ctx(tmp_path, reports))
    assert d.status == "CHOSEN"
    assert d.choice == {
        "federate": "adapter",
        "prototypes": "mean",
        "consensus": False,
        "erpa": True,
        "apud": False,
        "cps": True,
        "cps_s": None,
        "scaling": False,
        "refine": False,
    }
    assert d.matches_preset == (table_report.preset_stages() == d.choice)
    text = "\n".join(d.lines)
    assert "**chosen**" in text and "beaten by all" in text and "within noise, more bytes" in text


def test_default_decision_waits_for_every_candidate(tmp_path):
    d = table_report.decide_default(_ctx(tmp_path, _seeded("D/a-all", [_fake_report(0.5, 0.5, 1)] * 3)))
    assert d.status == "NOT RUN" and "D/b-all" in d.lines[0] and d.choice is None
    assert "D/b-spherical-clipped" in d.lines[0]  # the decision reads the candidates' clipped runs


def test_a_cached_run_is_stale_when_its_resolved_config_changes(tmp_path, monkeypatch):
    from protofl import presets

    run = RUN_BY_KEY["A/a0.5-tinyproto-s0"]
    runner = paper_table.Runner("quick", tmp_path, None, 1, verbose=False)
    rep: dict[str, Any] = {
        "config": paper_table.expected_config(run, "quick"),
        "bench": {"args": paper_table.run_args(run, "quick")},
        "rounds": [],
        "totals": {},
    }
    path = runner.path(run)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(rep))
    assert runner.cached(run) is not None
    # the same command after the preset's default changed is another run: redo it
    monkeypatch.setitem(presets.PRESETS, "tinyproto", {**presets.PRESETS["tinyproto"], "mu": 1.5e-4})
    assert runner.cached(run) is None
    monkeypatch.undo()
    assert runner.cached(run) is not None
    # a run that scored another part of the test set than the quick sizing's 500 images is stale
    rep["simulation"] = {"test_samples": 100}
    path.write_text(json.dumps(rep))
    assert runner.cached(run) is None
    rep["simulation"] = {"test_samples": 500}
    path.write_text(json.dumps(rep))
    assert runner.cached(run) is not None
    # a different command is stale too
    rep["bench"]["args"] = paper_table.run_args(run, "full")
    path.write_text(json.dumps(rep))
    assert runner.cached(run) is None


def test_an_unclipped_run_that_cannot_clip_is_its_clipped_twins_run(tmp_path):
    runner = paper_table.Runner("full", tmp_path, None, 1, verbose=False)

    def cache(key: str) -> dict:
        run = RUN_BY_KEY[key]
        rep = {
            "config": paper_table.expected_config(run, "full"),
            "bench": {"args": paper_table.run_args(run, "full")},
            "rounds": [],
            "totals": {},
        }
        runner.path(run).parent.mkdir(parents=True, exist_ok=True)
        runner.path(run).write_text(json.dumps(rep))
        return rep

    # fedpagr uploads only full-width unit prototypes: its clipped seed-1 run is its unclipped seed-1 run
    cache("A/a0.5-fedpagr-clipped-s1")
    rep = runner.cached(RUN_BY_KEY["A/a0.5-fedpagr-s1"])
    assert rep is not None and rep["same_as"] == "A/a0.5-fedpagr-clipped-s1"
    assert runner.cached(RUN_BY_KEY["A/a0.5-fedpagr-s0"]) is None  # no twin run for seed 0 in the cache
    assert runner.cached(RUN_BY_KEY["A/a0.5-fedpagr-s3"]) is None  # the twin has no seed 3: it must run
    twin = runner.cached(RUN_BY_KEY["A/a0.5-fedpagr-clipped-s1"])
    assert twin is not None and "same_as" not in twin
    own = cache("A/a0.5-fedpagr-s1")  # a run of its own wins
    assert runner.cached(RUN_BY_KEY["A/a0.5-fedpagr-s1"]) == own
    # tinyproto's scaled prototypes and the CPS-masked spherical rows can clip: never their twin's run
    for key in ("A/a0.5-tinyproto", "D/a-spherical", "B/refprotofl"):
        cache(f"{key}-clipped-s1")
        assert runner.cached(RUN_BY_KEY[f"{key}-s1"]) is None, key
    assert paper_table.never_clipped({"federate": "none", "prototypes": "unit", "cps": False, "erpa": False})
    assert not paper_table.never_clipped({"federate": "adapter", "prototypes": "unit", "cps": False, "erpa": False})
    # the table says the runs are the same instead of showing a clipped - unclipped difference of 0
    reports = {
        **_seeded("A/a0.5-fedpagr-clipped", [_fake_report(0.8, 0.5, 1)] * 3),
        **{f"A/a0.5-fedpagr-s{i}": {**_fake_report(0.8, 0.5, 1), "same_as": "x"} for i in range(3)},
    }
    line = table_report.clip_cost(_ctx(tmp_path, reports), ("A/a0.5-fedpagr",), "global_acc")
    assert "`A/a0.5-fedpagr` seeds 0,1,2 are the twin's runs" in line and "+0.00" not in line


def test_a_config_field_added_since_the_run_keeps_the_cache_while_it_holds_its_default(tmp_path):
    run = RUN_BY_KEY["A/a0.5-tinyproto-s0"]
    assert paper_table.config_matches({"config": paper_table.expected_config(run, "quick")}, run, "quick")
    # reports made before the scoped config hold it flat, every installed option beside the core fields
    config = paper_table.config_values(paper_table.expected_config(run, "quick"))
    assert config is not None and "techniques" not in config
    rep = {"config": {k: v for k, v in config.items() if k != "pagr_train_head"}}  # made before the field existed
    assert paper_table.config_matches(rep, run, "quick")
    rep["config"]["no_longer_a_field"] = 1  # a field that is gone: stale
    assert not paper_table.config_matches(rep, run, "quick")
    fedpagr = RUN_BY_KEY["C/fedpagr-train-head-s0"]  # the new field set away from its default: stale
    values = paper_table.config_values(paper_table.expected_config(fedpagr, "quick"))
    assert values is not None and values["pagr_train_head"] is True
    old = {k: v for k, v in values.items() if k != "pagr_train_head"}
    assert not paper_table.config_matches({"config": old}, fedpagr, "quick")


def test_goal_4_is_missed_when_a_preset_beats_it_by_more_than_a_point(tmp_path):
    suffix = table_report.preset_variant()
    assert suffix is not None  # the preset is one of setting D's candidates
    reports = {}
    for key in ("A/a0.5-refprotofl", "A/a0.5-tinyproto", "A/a0.5-fedpagr"):
        reports.update(_five(key, [0.40] * 5, up=100))
    for key, local in (("B/refprotofl", 0.80), ("B/tinyproto", 0.80), ("B/fedpagr", 0.86)):
        reports.update(_five(key, [local] * 5, "local_acc", up=100))
    reports.update(_five(candidate_row("a", suffix), [0.45] * 5, up=150))
    reports.update(_five(candidate_row("b", suffix), [0.85] * 5, "local_acc", up=150))
    goal = table_report.goal_protofl(_ctx(tmp_path, reports))
    text = "\n".join(goal.evidence)
    assert goal.status == "MISSED"
    # 1 point behind in every seed: the interval [-1, -1] is not inside +-1
    assert "protofl - fedpagr = -1.00 [-1.00, -1.00] (-----, 5 seeds) -> fedpagr beats protofl (5 seeds)" in text
    assert "protofl - tinyproto = +5.00 [+5.00, +5.00] (+++++, 5 seeds) -> protofl beats tinyproto (5 seeds)" in text
    assert "B: uplink protofl 150 B = 1.50x tinyproto's (<= 2x)" in text
    if suffix == "spherical":  # the gap to fedpagr split into the masks' part and refinement's (clipped rows)
        assert "why (B): waiting for `B/fedpagr-no-refine`" in text
        reports.update(_five("D/b-spherical-clipped", [0.85] * 3, "local_acc"))
        reports.update(_five("B/fedpagr-clipped", [0.86] * 3, "local_acc"))
        reports.update(_five("B/fedpagr-no-refine", [0.845, 0.858, 0.857], "local_acc"))
        why = next(
            e
            for e in table_report.goal_protofl(_ctx(tmp_path, reports)).evidence
            if e.startswith("why (B, cosine classifier (cosine to P), local split")
        )
        # w/o masks - preset: -0.5, +0.8, +0.7 -> mean +0.33, s 0.7234, half width 4.3027 * 0.7234 / sqrt(3) = 1.797
        assert "w/o masks - preset = +0.33 [-1.46, +2.13] (-++, 3 seeds) -> undecided (3 seeds)" in why
        assert "fedpagr - w/o refinement = +0.67 [-1.13, +2.46] (+++, 3 seeds) -> undecided (3 seeds)" in why


def test_the_lambda_sweep_moves_a_default_only_when_the_chosen_lambda_beats_it(tmp_path):
    # CPS: 0.1 best on seed 0; minus lambda = 1 per seed +3, +3, +2 -> [+1.23, +4.10]: beats, the default moves.
    # ERPA: 0.3 best on seed 0 (+0.2), then -0.1, -0.3: undecided, the default stays 1.
    # CPS's lambda = 1 is a sweep row of its own (the tinyproto preset now has the 0.1 this sweep chose); ERPA's
    # is refprotofl's row of A.
    reports = {**_five("A/a0.5-refprotofl-clipped", [0.48, 0.46, 0.455])}
    cps = {
        0.03: (0.45, 0.44, 0.43),
        0.1: (0.47, 0.45, 0.44),
        0.3: (0.46, 0.44, 0.43),
        1.0: (0.44, 0.42, 0.42),
        3.0: (0.41, 0.39, 0.40),
        10.0: (0.37, 0.32, 0.34),
    }
    erpa = {0.3: (0.482, 0.459, 0.452), 3.0: (0.47,) * 3, 10.0: (0.47,) * 3}
    for what, grid in (("cps", cps), ("erpa", erpa)):
        for lam, vals in grid.items():
            reports.update(_five(f"L/{what}-lambda{lam:g}", list(vals)))
    lines = table_report.sweep_lines(_ctx(tmp_path, reports))
    chosen_cps = next(line for line in lines if line.startswith("| CPS") and "chosen" in line)
    chosen_erpa = next(line for line in lines if line.startswith("| ERPA") and "chosen" in line)
    assert "| 0.1 |" in chosen_cps and "+2.67 [+1.23, +4.10] (+++, 3 seeds) -> lambda 0.1 beats lambda 1" in chosen_cps
    assert "grid's edge" not in chosen_cps  # 0.1 is inside the extended grid
    assert "| 0.3 |" in chosen_erpa and "undecided (3 seeds)" in chosen_erpa and "grid's edge" in chosen_erpa
    assert "- default: tinyproto: proto_lambda is 0.1, moved from 1 by this sweep (0.1 beats 1)" in lines
    assert "- default: refprotofl: proto_lambda stays 1 (0.3 does not beat it)" in lines


def test_papers_figures_sit_beside_ours_and_refprotofls_gap_is_set_against_fedavgs(tmp_path):
    # fedavg's row ran clipped; fedproto's and refprotofl's unclipped rows have not run: their clipped twins stand in
    reports = {
        **_seeded("A/a0.5-fedavg", [_fake_report(0.8, 0.70, 1)] * 3),
        **_seeded("A/a0.5-fedproto-clipped", [_fake_report(0.8, 0.45, 1, ensemble=0.72)] * 3),
        **_seeded("A/a0.5-refprotofl-clipped", [_fake_report(0.8, g, 1, ensemble=0.73) for g in (0.46, 0.47, 0.48)]),
    }
    lines = table_report.paper_lines(_ctx(tmp_path, reports))
    text = "\n".join(lines)
    # paper 73.82 (fedproto), 73.72 (fedavg): ours 45.00 and 70.00
    row = (
        "| fedproto [clipped] | A: 10 clients, alpha 0.5 | global (per client) | 73.82 [R05] | 45.00 ± 0.00 | -28.82 |"
    )
    assert row in lines
    row = "| refprotofl [clipped] | A: 10 clients, alpha 0.5 | global (per client) | 74.21 [R05] | 47.00 ± 1.00 | "
    row += "-27.21 |"
    assert row in lines
    assert (
        "| fedavg [clipped] | A: 10 clients, alpha 100 | global model (one model) | 85.10 [R100] | not run yet | - |"
        in lines
    )
    # the paper's FedAvg figure beside the prototype rows' per-client metric: not in the runs, and why
    row = "| fedavg [clipped] | A: 10 clients, alpha 100 | global (per client) | 85.10 [R100] | "
    row += "not in the cached runs [F] | - |"
    assert row in lines
    assert "- [F] FedAvg's per-client global accuracy" in text and "`_metrics`" in text
    assert "Measured, ours - paper in points: FedAvg's global model -3.72; " in text
    assert "fedproto global -28.82 (-25.10 beyond FedAvg's), ensemble -1.82" in text
    assert "refprotofl global -27.21 (-23.49 beyond FedAvg's), ensemble -1.21." in text
    # no split where FedAvg has not run
    assert "Measured" not in "\n".join(
        table_report.paper_lines(_ctx(tmp_path, {k: v for k, v in reports.items() if "fedavg" not in k}))
    )


def test_a_lambda_decision_is_said_against_the_default_the_preset_has_now():
    # refprotofl has lambda 1, tinyproto 0.1 (moved there by the sweep): each outcome named against that
    decide = table_report._lambda_decision
    assert decide("refprotofl", 0.3, True) == "refprotofl: proto_lambda should move to 0.3 (the preset has 1)"
    assert decide("refprotofl", 0.3, False) == "refprotofl: proto_lambda stays 1 (0.3 does not beat it)"
    assert decide("tinyproto", 0.1, True) == "tinyproto: proto_lambda is 0.1, moved from 1 by this sweep (0.1 beats 1)"
    assert decide("tinyproto", 0.03, True) == "tinyproto: proto_lambda should move to 0.03 (the preset has 0.1)"
    assert decide("tinyproto", 0.1, False) == (
        "tinyproto: proto_lambda should go back to 1 (0.1 does not beat it; the preset has 0.1)"
    )

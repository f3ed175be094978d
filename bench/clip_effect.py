"""What upload clipping does to the benchmark's rows: each row run with `--clip on` and `--clip off`.

    python -m bench.clip_effect --data-dir /usr/share/datasets/fashion-mnist        # runs what is missing
    python -m bench.clip_effect --table-only                                        # rewrite CLIPPING.md

A run is the benchmark's own command (`bench.table_runs.run_args`, full sizing) with the clip switch set;
each report is kept as `bench/results/clip/<setting>/<row>-clip<on|off>-s<seed>.json` (a file that exists
is not run again) and the summary goes to `bench/results/CLIPPING.md`: per row and seed the final
accuracies, the uplink bytes and the rows clipped per round, then on - off paired by seed (mean, 95 %
interval over seeds, docs/algorithms.md "Statistics").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.paper_table import RESULTS, cli_prefix, git_info
from bench.table_runs import ROW_BY_KEY, Run, run_args

ROWS = ("B/tinyproto", "A/a0.5-tinyproto", "B/fedproto", "B/refprotofl")
SEEDS = (0, 1, 2)
METRICS = (
    ("local_acc", "local"),
    ("local_proto_acc", "local proto"),
    ("global_acc", "global"),
    ("global_proto_acc", "global proto"),
    ("ensemble_acc", "ens."),
)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776}  # Student t, 97.5 %, by degrees of freedom
ROOT = RESULTS / "clip"
INTRO = (
    "The benchmark's full sizing (bench/table_runs.py), each run with `--clip on` and `--clip off`; final-round "
    "accuracies in %. A clipped row is one class's prototype (or anchor) from one client, or one client's "
    "parameter vector; round 1 clips nothing (its radius, 1e4, waits for statistics). Wall seconds were "
    "measured on a 2-core machine shared with other jobs: they do not compare. What the numbers mean: "
    "docs/algorithms.md, section 8."
)


def clip_run(key: str, seed: int, clip: bool) -> Run:
    row = ROW_BY_KEY[key]
    return Run(dataclasses.replace(row, clip=clip), seed)


def path(run: Run) -> Path:
    return ROOT / run.setting / f"{run.row.name}-clip{'on' if run.row.clip else 'off'}-s{run.seed}.json"


def execute(run: Run, data_dir: str | None) -> None:
    """One simulation through the public CLI; its report (plus the command) written when it succeeded."""
    args = run_args(run, "full", data_dir)
    out = path(run)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial.json")
    print(f"protofl-server {shlex.join(args)}", flush=True)
    started = time.time()
    subprocess.run(cli_prefix() + args + ["--json", str(tmp)], check=True)
    rep = json.loads(tmp.read_text())
    rep["bench"] = {
        "command": "protofl-server " + shlex.join(args),
        "cli_wall_s": round(time.time() - started, 1),
        "git_rev": git_info()["rev"],
    }
    out.write_text(json.dumps(rep, indent=1))
    tmp.unlink()


def run_pair(key: str, seed: int, data_dir: str | None) -> None:
    """The row with clipping on, then off unless on clipped nothing (off then folds the very same rows)."""
    on = clip_run(key, seed, True)
    if not path(on).is_file():
        execute(on, data_dir)
    if json.loads(path(on).read_text())["totals"]["clipped"] and not path(clip_run(key, seed, False)).is_file():
        execute(clip_run(key, seed, False), data_dir)


def clip_share(rep: dict[str, Any]) -> str:
    """Rows clipped of rows checked, per round after the first (round 1 has no statistics yet)."""
    rounds = rep["rounds"]
    if rep["simulation"].get("clip") == "off":
        return "off"
    per = [f"{sum(r['clipped'].values())}/{sum(r['clip_checked'].values())}" for r in rounds]
    tot_c = sum(sum(r["clipped"].values()) for r in rounds)
    tot_n = sum(sum(r["clip_checked"].values()) for r in rounds)
    return f"{' '.join(per)} ({100 * tot_c / tot_n:.1f} % of {tot_n})" if tot_n else "none checked"


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f}"


def paired(on: list[float], off: list[float]) -> str:
    """on - off in points: mean [95 % interval] and the signs seed by seed."""
    d = [100 * (a - b) for a, b in zip(on, off, strict=True)]
    signs = "".join("+" if x > 0 else "-" if x < 0 else "0" for x in d)
    if len(d) < 2:
        return f"{_pts(d[0])} ({signs})" if d else "-"
    half = T975[len(d) - 1] * statistics.stdev(d) / len(d) ** 0.5
    m = statistics.fmean(d)
    return f"{_pts(m)} [{_pts(m - half)}, {_pts(m + half)}] ({signs})"


def _pts(x: float) -> str:
    """Signed, two decimals, and no '-0.00' (a mean of differences that cancel is not negative)."""
    return f"{round(x, 2) + 0.0:+.2f}"


def table(keys: tuple[str, ...], seeds: tuple[int, ...]) -> list[str]:
    lines = [
        "| row | seed | clip | " + " | ".join(label for _, label in METRICS) + " | uplink B | rows clipped "
        "per round (total) | wall s |",
        "|---|--:|---|" + "--:|" * len(METRICS) + "--:|---|--:|",
    ]
    diffs = [
        "| row | seeds | " + " | ".join(f"{label}: on - off" for _, label in METRICS) + " |",
        "|---|--:|" + "---|" * len(METRICS),
    ]
    for key in keys:
        got: dict[bool, dict[int, dict[str, Any]]] = {True: {}, False: {}}
        for seed in seeds:
            for clip in (True, False):
                p = path(clip_run(key, seed, clip))
                if not p.is_file():
                    continue
                rep = got[clip][seed] = json.loads(p.read_text())
                last = rep["rounds"][-1]
                lines.append(
                    f"| {key} | {seed} | {'on' if clip else 'off'} | "
                    + " | ".join(pct(last.get(m)) for m, _ in METRICS)
                    + f" | {rep['totals']['uplink_bytes']:,} | {clip_share(rep)} | "
                    f"{rep['bench']['cli_wall_s']:.0f} |"
                )
        both = sorted(set(got[True]) & set(got[False]))
        if both:
            cells = []
            for m, _ in METRICS:
                on = [got[True][s]["rounds"][-1].get(m) for s in both]
                off = [got[False][s]["rounds"][-1].get(m) for s in both]
                cells.append("-" if None in on or None in off else paired(on, off))
            diffs.append(f"| {key} | {','.join(map(str, both))} | " + " | ".join(cells) + " |")
    commands = [
        f"- `{json.loads(p.read_text())['bench']['command']}`"
        for key in keys
        for p in [path(clip_run(key, seeds[0], True))]
        if p.is_file()
    ]
    return (
        lines
        + [
            "",
            "Paired by seed, in points (a row whose clipped runs clipped nothing has no off run: off "
            "folds the very same rows, tests/broker_server/test_clip_switch.py):",
            "",
        ]
        + diffs
        + ["", f"Commands (seed {seeds[0]}, clip on; the other runs change --seed and --clip):", ""]
        + commands
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.clip_effect", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS), help="row keys of bench.table_runs")
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--table-only", action="store_true")
    ns = ap.parse_args(argv)
    keys = tuple(k.strip() for k in ns.rows.split(",") if k.strip())
    seeds = tuple(int(s) for s in ns.seeds.split(","))
    if not ns.table_only:
        for key in keys:
            for seed in seeds:
                run_pair(key, seed, ns.data_dir)
    out = RESULTS / "CLIPPING.md"
    title = "# Upload clipping on and off (bench/clip_effect.py)"
    out.write_text("\n".join([title, "", INTRO, "", *table(keys, seeds), ""]))
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

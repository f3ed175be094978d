"""Our FedProto against PFLlib's: each difference between the two switched on singly and all together.

    nice -n 10 python -m bench.fedproto_gap                       # runs what is missing, in priority order
    nice -n 10 python -m bench.fedproto_gap --reuse /work/main/bench/results/full/A   # baseline from the suite
    python -m bench.fedproto_gap --table-only                     # rewrite FEDPROTO_GAP.md from the cache

An outside audit (issue 29) ran PFLlib's FedProto (TsingZ0/PFLlib, system/flcore/clients/clientproto.py and
servers/serverproto.py) on setting A's work -- same partition, model, initial weights and optimiser -- and
found its head accuracy on the clients' held-out splits 2.5 points above ours. This benchmark runs setting A's
command (bench/table_runs.py, full sizing) with the config switches that give our training PFLlib's behaviour
(`drop_last`, `keep_optimizer`, `proto_source`, `aggregation`; docs/algorithms.md, FedProto), on seeds 0-2.

Each run is cached as `bench/results/fedproto_gap/<variant>-s<seed>.json` (the CLI's report and the command);
a cached run is reused when its command (less the flags that only choose what the official test set scores:
this benchmark scores none of it) and its resolved config are today's. `--reuse DIR` takes the baseline from
the suite's cached setting-A runs (`a0.5-fedproto-s<seed>.json`) under the same check. The summary,
bench/results/FEDPROTO_GAP.md, is rewritten after every run: per variant the head accuracy (final round,
best round, PFLlib's convention) and the nearest-global-prototype accuracy, mean +- std over seeds, and each
variant minus the baseline paired by seed (bench/paired.py).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.paired import paired
from bench.paper_table import DATASET_SHAPE, RESULTS, cli_prefix, git_info, sim_env

ROOT = RESULTS / "fedproto_gap"
REPORT = RESULTS / "FEDPROTO_GAP.md"
SEEDS = (0, 1, 2)
ROUNDS = 10
# Setting A's sizing (bench/table_runs.py, full suite): 10 clients, Dirichlet 0.5, 6,000 training images.
WORK = [
    "simulate",
    "--preset",
    "fedproto",
    "--dataset",
    "fashion-mnist",
    "--clients",
    "10",
    "--alpha",
    "0.5",
    "--rounds",
    str(ROUNDS),
    "--arch",
    "cnn",
    "--train-limit",
    "6000",
    "--eval-every",
    "1",
    "--clip",
    "off",
]
# Only what the official test set scores (global and ensemble accuracy, unused here): not part of the work.
SCORING_FLAGS = {"--test-limit": 1, "--test-every": 1, "--json": 1, "-q": 0, "--data-dir": 1}
SCORING = ["--test-limit", "200"]


@dataclass(frozen=True)
class Variant:
    name: str
    sets: dict[str, Any]
    what: str


PFLLIB = dict(drop_last=True, keep_optimizer=True, proto_source="during", aggregation="mean")
VARIANTS = (
    Variant("baseline", {}, "ours as benchmarked (setting A's fedproto row)"),
    Variant("all", PFLLIB, "every PFLlib behaviour below at once"),
    Variant(
        "during",
        dict(proto_source="during"),
        "prototypes = mean of the features training saw (train mode, before each step), not re-embedded after",
    ),
    Variant("keep-opt", dict(keep_optimizer=True), "one optimiser per client for the run: momentum kept across rounds"),
    Variant("drop-last", dict(drop_last=True), "each epoch's last incomplete batch skipped (DataLoader drop_last)"),
    Variant("mean", dict(aggregation="mean"), "global prototype = plain mean over clients, not n_kc-weighted"),
)
BY_NAME = {v.name: v for v in VARIANTS}
# Priority: everything at once on seeds 0-2, then the singles seed by seed (every single on seed 0, then on
# seed 1, ...: a budget cut short still measures each of them); the baseline last (the suite runs it too:
# `--reuse` takes its runs, looked for again before every run).
ORDER = (
    [("all", s) for s in SEEDS] + [(v.name, s) for s in SEEDS for v in VARIANTS[2:]] + [("baseline", s) for s in SEEDS]
)


def args_for(variant: Variant, seed: int, data_dir: str | None) -> list[str]:
    sets = [a for k, v in variant.sets.items() for a in ("--set", f"{k}={json.dumps(v).strip(chr(34))}")]
    return [
        *WORK[:11],
        "--seed",
        str(seed),
        *WORK[11:],
        *sets,
        *SCORING,
        *(["--data-dir", data_dir] if data_dir else []),
    ]


def work_of(args: list[str]) -> list[str]:
    """The command less the flags that only decide what the official test set scores; --set in sorted order."""
    out, sets, i = [], [], 0
    while i < len(args):
        a = args[i]
        if a in SCORING_FLAGS:
            i += 1 + SCORING_FLAGS[a]
            continue
        if a == "--set":
            sets.append(args[i + 1])
            i += 2
            continue
        out.append(a)
        i += 1
    return out + sorted(sets)


def expected_config(variant: Variant, seed: int) -> dict[str, Any]:
    from broker_server.simulation import SimulationSpec, resolve_config

    spec = SimulationSpec(
        preset="fedproto", clients=10, rounds=ROUNDS, seed=seed, archs=("cnn",), overrides=dict(variant.sets)
    )
    return json.loads(json.dumps(resolve_config(spec, **DATASET_SHAPE).to_dict()))


def usable(rep: dict[str, Any], variant: Variant, seed: int, data_dir: str | None) -> bool:
    """The report is this run's: same work, and the config resolves the same today (a field added since
    counts as the same when the run's value for it is the default, as bench/paper_table.py's cache does)."""
    from bench.paper_table import config_values

    args = rep.get("bench", {}).get("args") or []
    if work_of(args) != work_of(args_for(variant, seed, data_dir)):
        return False
    cached = config_values(rep.get("config"))
    return cached is not None and cached == config_values(expected_config(variant, seed))


def path(name: str, seed: int) -> Path:
    return ROOT / f"{name}-s{seed}.json"


def load(name: str, seed: int, data_dir: str | None) -> dict[str, Any] | None:
    p = path(name, seed)
    if not p.is_file():
        return None
    rep = json.loads(p.read_text())
    return rep if usable(rep, BY_NAME[name], seed, data_dir) else None


def reuse_baseline(src: Path, data_dir: str | None) -> None:
    for seed in SEEDS:
        p = src / f"a0.5-fedproto-s{seed}.json"
        if load("baseline", seed, data_dir) is None and p.is_file():
            rep = json.loads(p.read_text())
            if usable(rep, BY_NAME["baseline"], seed, data_dir):
                ROOT.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(p, path("baseline", seed))
                print(f"baseline s{seed}: reused {p}", flush=True)


def execute(name: str, seed: int, data_dir: str | None) -> None:
    args = args_for(BY_NAME[name], seed, data_dir)
    out = path(name, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial.json")
    shown = "protofl-server " + shlex.join(args)
    print(shown, flush=True)
    started = time.time()
    subprocess.run(cli_prefix() + args + ["-q", "--json", str(tmp)], check=True, env=sim_env())
    rep = json.loads(tmp.read_text())
    rep["bench"] = {
        "args": args,
        "command": shown,
        "cli_wall_s": round(time.time() - started, 1),
        "git_rev": git_info()["rev"],
        "git_dirty": git_info()["dirty"],
    }
    tmp.write_text(json.dumps(rep, indent=1))
    tmp.replace(out)


# -- the summary --------------------------------------------------------------------------------------
def pct(rounds: list[dict[str, Any]], key: str) -> list[float]:
    return [100 * r[key] for r in rounds if r.get(key) is not None]


def metrics(rep: dict[str, Any]) -> dict[str, float]:
    """The head accuracy three ways and the nearest global prototype's, in %, from the per-round report.

    PFLlib evaluates at the start of each of its gr + 1 rounds, before training, and prints the max over
    them: its evaluation at round i is of the models after i trainings, our round i's after i trainings too
    (its round 0 scores the untrained models, never the max), so with gr = 10 its printed best is our best
    over rounds 1-10; with gr = 9 (ten trainings, the last never evaluated) it is our best over rounds 1-9."""
    rounds = rep["rounds"]
    head = pct(rounds, "local_acc")
    proto = pct(rounds, "local_proto_acc")
    return {"final": head[-1], "best": max(head), "pfl9": max(head[:-1]), "proto": proto[-1], "proto_best": max(proto)}


COLUMNS = (
    ("final", "head, final round"),
    ("best", "head, best round (= PFLlib's printed best, gr = 10)"),
    ("pfl9", "head, best of rounds 1-9 (PFLlib gr = 9)"),
    ("proto", "nearest global prototype, final"),
    ("proto_best", "nearest global prototype, best round"),
)


def summary(data_dir: str | None) -> str:
    got = {(v.name, s): rep for v in VARIANTS for s in SEEDS if (rep := load(v.name, s, data_dir)) is not None}
    m = {k: metrics(rep) for k, rep in got.items()}
    lines = [
        "# FedProto: ours against PFLlib's, difference by difference",
        "",
        "Written by `bench/fedproto_gap.py` (rerun it to refresh; `--table-only` rewrites this file). Setting A's "
        "work (`" + "protofl-server " + shlex.join(WORK) + " --seed S`), seeds 0-2, each PFLlib behaviour switched on "
        "by a config field (the notes at the end: the conclusion, every difference found, and why the others need no "
        "switch). Head = the head's accuracy on the clients' held-out splits, pooled over clients (as PFLlib's "
        "`evaluate` pools them); nearest global prototype = the same splits classified by the nearest round target. "
        "All in %. The machine (2 cores) was shared with the benchmark suite's two simulations and other helpers "
        "throughout: wall seconds do not compare, accuracies do (one torch thread count, 2, for every run here).",
        "",
        "| variant | what it switches on | " + " | ".join(label for _, label in COLUMNS) + " | seeds |",
        "|---|---|" + "---|" * len(COLUMNS) + "---|",
    ]
    for v in VARIANTS:
        seeds = [s for s in SEEDS if (v.name, s) in m]
        cells = []
        for key, _ in COLUMNS:
            vals = [m[(v.name, s)][key] for s in seeds]
            if not vals:
                cells.append("-")
            elif len(vals) == 1:
                cells.append(f"{vals[0]:.2f}")
            else:
                cells.append(f"{statistics.fmean(vals):.2f} ± {statistics.stdev(vals):.2f}")
        sets = ", ".join(f"`{k}={json.dumps(v2).strip(chr(34))}`" for k, v2 in v.sets.items()) or "-"
        lines.append(f"| {v.name} | {v.what} ({sets}) | " + " | ".join(cells) + f" | {','.join(map(str, seeds))} |")
    lines += [
        "",
        "Each variant minus the baseline, paired by seed: mean [95 % t interval] (signs seed by seed, "
        "seeds). Points of accuracy.",
        "",
        "| variant | " + " | ".join(label for _, label in COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    for v in VARIANTS[1:]:
        cells = []
        for key, _ in COLUMNS:
            a = {s: m[(v.name, s)][key] for s in SEEDS if (v.name, s) in m}
            b = {s: m[("baseline", s)][key] for s in SEEDS if ("baseline", s) in m}
            cells.append(paired(a, b).text())
        lines.append(f"| {v.name} | " + " | ".join(cells) + " |")
    # What the other three add on top of the optimiser: all four against keep_optimizer alone.
    cells = []
    for key, _ in COLUMNS:
        a = {s: m[("all", s)][key] for s in SEEDS if ("all", s) in m}
        b = {s: m[("keep-opt", s)][key] for s in SEEDS if ("keep-opt", s) in m}
        cells.append(paired(a, b).text())
    lines.append("| all minus keep-opt | " + " | ".join(cells) + " |")
    lines += ["", "Per seed (head final / best; nearest global prototype final):", ""]
    for (name, s), x in sorted(m.items(), key=lambda kv: ORDER.index(kv[0])):
        rep = got[(name, s)]
        wall = rep.get("bench", {}).get("cli_wall_s")
        lines.append(
            f"- {name} s{s}: {x['final']:.2f} / {x['best']:.2f}; {x['proto']:.2f} "
            f"(rounds: {', '.join(f'{a:.1f}' for a in pct(rep['rounds'], 'local_acc'))}; "
            f"{wall} s wall, shared machine)"
        )
    missing = [f"{n} s{s}" for n, s in ORDER if (n, s) not in m]
    if missing:
        lines += ["", f"Not run (yet): {', '.join(missing)}."]
    notes = ROOT / "NOTES.md"
    if notes.is_file():
        lines += ["", notes.read_text().strip()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--reuse", type=Path, default=None, help="the suite's setting-A results folder (baseline)")
    ap.add_argument("--runs", default=None, help="only these, e.g. all-s0,during-s1 (default: all, in order)")
    ns = ap.parse_args(argv)
    if ns.reuse is not None:
        reuse_baseline(ns.reuse, ns.data_dir)
    if not ns.table_only:
        wanted = (
            ORDER
            if ns.runs is None
            else [(r.rsplit("-s", 1)[0], int(r.rsplit("-s", 1)[1])) for r in ns.runs.split(",")]
        )
        for name, seed in wanted:
            if ns.reuse is not None:
                reuse_baseline(ns.reuse, ns.data_dir)
            if name not in BY_NAME:
                ap.error(f"--runs: unknown variant {name!r}; known: {', '.join(BY_NAME)}")
            if load(name, seed, ns.data_dir) is None:
                execute(name, seed, ns.data_dir)
                REPORT.write_text(summary(ns.data_dir))
    REPORT.write_text(summary(ns.data_dir))
    print(f"wrote {REPORT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

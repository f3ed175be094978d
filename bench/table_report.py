"""Rendering for `bench.paper_table`: TABLE.md (mean ± std over seeds), the goals judged by the written
rule (paired by seed, `bench.paired`), the local-only control, the global predictor against FedAvg, the
default's decision, the lambda sweep and one PNG per section."""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import shlex
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.paired import Paired, paired, verdict
from bench.table_runs import (
    CANDIDATES,
    FEDERATIONS,
    GPU_NOTE,
    LAMBDAS,
    PAPER_GAP_NOTES,
    PAPER_REFS,
    REFUSED,
    ROW_BY_KEY,
    ROWS,
    SECTIONS,
    SEEDS,
    SIZING,
    SIZING_NOTE,
    SWEEP,
    Row,
    Run,
    Section,
    as_spelled_today,
    candidate_row,
    clipped,
    decision_row,
    preset_stages,
    preset_variant,
    run_args,
)

# The accuracies, named for what they compute: which predictor (the model's own classifier: the head, or the
# cosine classifier, see `classifier`; the nearest *global* prototype, FedProto's inference; the nearest of the
# client's *own* prototypes, TinyProto's eq. 12; the clients' ensemble; the federation's global predictor) on
# which data (each client's held-out split: local; the official test set), at the final round or the best round
# (local split only: it is scored every round). "{clf}" is the classifier of the rows compared (`metric_name`).
METRIC_NAMES: dict[str, str] = {
    "local_acc": "{clf}, local split, final round",
    "local_acc@best": "{clf}, local split, best round",
    "local_proto_acc": "nearest global prototype, local split, final round",
    "local_own_proto_acc": "nearest own (local) prototype, local split, final round",
    "local_own_proto_acc@best": "nearest own (local) prototype, local split, best round (TinyProto's eq. 12 metric)",
    "global_acc": "{clf}, test set, final round (FedAvg: its global model)",
    "global_proto_acc": "nearest global prototype, test set, final round",
    "ensemble_acc": "clients' ensemble, test set, final round",
    "predictor_acc": "global predictor, test set, final round",
}
HEAD, COSINE = "head", "cosine to P"


@functools.cache
def classifier(key: str) -> str:
    """What a row's own classifier computes, the one its *classifier* columns score (edge_agent/core/agent.py
    `_metrics`, the round objective's `probabilities`): HEAD, the model's linear head; or COSINE, FedPAGR's
    cosine classifier where the consensus projection trains on unit prototypes (fedpagr, the protofl preset,
    setting D's spherical candidates; edge_agent/techniques/fedpagr.py `CosineClassifier`): softmax(z_hat . P^T /
    beta), the unit feature against the anchored global class vectors P (the head's rows are set to P), so its
    prediction is the nearest global prototype by cosine."""
    from protofl.presets import make_config

    row = ROW_BY_KEY[key]
    cfg = make_config(row.preset, **dict(row.sets))
    return COSINE if cfg.consensus and cfg.prototypes == "unit" else HEAD


def metric_name(metric: str, **rows: str) -> str:
    """METRIC_NAMES[metric] with its classifier named for the rows compared (name -> row key): "head" or "cosine
    classifier (...)" when they share one, else each row's."""
    name = METRIC_NAMES[metric]
    if "{clf}" not in name:
        return name
    kinds = {n: classifier(k) for n, k in rows.items()}
    if not kinds:
        clf = "own classifier (the head, or cosine to P for the cosine classifiers)"
    elif set(kinds.values()) == {HEAD}:
        clf = "head"
    elif set(kinds.values()) == {COSINE}:
        clf = "cosine classifier (cosine to P)"
    else:
        clf = "own classifier (" + "; ".join(f"{n}: {k}" for n, k in kinds.items()) + ")"
    return name.format(clf=clf)


COLUMNS = (
    "method",
    "seeds",
    "classifier local",
    "nearest global proto local",
    "nearest own proto local, best rnd",
    "classifier global",
    "nearest global proto global",
    "ens.",
    "global predictor",
    "off-mask energy",
    "up B/client/rnd",
    "up total MB",
    "wall s",
    "paper (their setting)",
)
# Final-round metrics of a run, as the report's last row holds them; those scored every round also at their best.
METRICS = (
    "local_acc",
    "local_proto_acc",
    "local_own_proto_acc",
    "global_acc",
    "global_proto_acc",
    "ensemble_acc",
    "predictor_acc",
    "off_mask_energy",
)
BEST_OF = ("local_acc", "local_proto_acc", "local_own_proto_acc")

RULE = (
    "Two rows compare paired by seed (same seed: same partition, initialisation and batch order): the mean of "
    "the per-seed differences with its 95 % Student-t interval over the seeds, and the seed-by-seed signs "
    '(+: the first row ahead). "X beats Y" when the interval lies above 0; "X is within d of Y" when it lies '
    'inside ±d; otherwise "undecided" (not "equal"). Every verdict says how many seeds it rests on '
    "(docs/algorithms.md, Evaluation > Statistics; `bench/paired.py`). A goal is judged on its rows run "
    "unclipped on seeds 0-4; until those are in, provisionally on the unclipped rows' common seeds where there "
    "are at least 3, else on their clipped twins (seeds 0-2, the runs cached before clipping could be switched "
    "off), and it says so and lists the missing runs. A row whose only uploads are full-width unit prototypes "
    "(fedpagr's) clips nothing with clipping on (radius 10 x median norm 1 = 10 > 2, the widest gap between unit "
    "vectors; `bench/paper_table.py`, `never_clipped`): its unclipped seeds 0-2 are its clipped twin's runs, "
    "and its clipped - unclipped line says so instead of showing a 0. Checked: `A/a0.5-fedpagr` seed 0 run with "
    "`--clip off` at 0ce0223 equals its twin (made at ee94744) in every round's accuracies and bytes "
    "(`bench/results/clip/A/a0.5-fedpagr-clipoff-s0.json`)."
)


@dataclass
class Context:
    suite: str
    sizing_key: str
    run_root: Path
    table_path: Path
    command: str
    git: dict[str, Any]
    runs: list[Run]  # the suite's runs (rows not in the suite are left out of its tables)
    cached: Callable[[Run], dict[str, Any] | None]


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f}"


# -- per-run and per-row numbers -----------------------------------------------------------------------
def summary(rep: dict[str, Any]) -> dict[str, Any]:
    rows = rep["rounds"]
    last = rows[-1] if rows else {}
    out: dict[str, Any] = {k: last.get(k) for k in METRICS}  # final: the last round is always evaluated
    for k in BEST_OF:  # best round: the highest value over the rounds that scored it
        vals = [r[k] for r in rows if r.get(k) is not None]
        out[f"{k}@best"] = max(vals) if vals else None
    slots = sum(r["clients"] for r in rows) or 1  # client-rounds
    tot = rep["totals"]
    out["up_per"] = tot["uplink_bytes"] / slots
    out["down_per"] = tot["downlink_bytes"] / slots
    out["up_total"] = tot["uplink_bytes"]
    out["wall_s"] = tot["wall_s"]
    out["same_as"] = rep.get("same_as")  # an unclipped run that is its clipped twin's (paper_table.never_clipped)
    return out


@dataclass
class RowStats:
    row: Row
    by_seed: dict[int, dict[str, Any]]  # seed -> summary, for the seeds that have run (in the suite)
    expected: tuple[int, ...]  # the row's seeds in this suite

    @property
    def complete(self) -> bool:
        return bool(self.expected) and set(self.by_seed) == set(self.expected)

    @property
    def missing(self) -> list[int]:
        return [s for s in self.expected if s not in self.by_seed]

    def same_as_twin(self) -> list[int]:
        """The seeds whose run is the clipped twin's (it clipped nothing by construction)."""
        return sorted(s for s, v in self.by_seed.items() if v.get("same_as"))

    def values(self, metric: str) -> dict[int, float]:
        return {s: v[metric] for s, v in self.by_seed.items() if v.get(metric) is not None}

    def mean(self, metric: str) -> float | None:
        vals = list(self.values(metric).values())
        return statistics.fmean(vals) if vals else None

    def mean_required(self, metric: str) -> float:
        """The mean of a figure every run's summary holds (bytes, wall time), for a row that has run."""
        m = self.mean(metric)
        if m is None:
            raise ValueError(f"{self.row.key}: no run of this row holds {metric!r}")
        return m

    def std(self, metric: str) -> float | None:
        vals = list(self.values(metric).values())
        return statistics.stdev(vals) if len(vals) > 1 else None


def row_stats(ctx: Context, key: str) -> RowStats:
    row = ROW_BY_KEY[key]
    in_suite = [r for r in ctx.runs if r.row.key == key]
    got = {}
    for run in in_suite:
        rep = ctx.cached(run)
        if rep is not None:
            got[run.seed] = summary(rep)
    return RowStats(row, got, tuple(r.seed for r in in_suite))


def mean_std(st: RowStats, metric: str, scale: float = 100.0, digits: int = 2) -> str:
    m, s = st.mean(metric), st.std(metric)
    if m is None:
        return "-"
    return f"{scale * m:.{digits}f}" + (f" ± {scale * s:.{digits}f}" if s is not None else "")


FEWER = " †"  # a cell averaged over fewer seeds than its row lists
COSINE_CELL = " (cos)"  # a classifier cell that is the cosine classifier's, not a head's
ROW_CELLS = (  # the accuracy columns of a setting's table, in COLUMNS' order
    ("local_acc", "classifier local"),
    ("local_proto_acc", "nearest global proto local"),
    ("local_own_proto_acc@best", "nearest own proto local, best rnd"),
    ("global_acc", "classifier global"),
    ("global_proto_acc", "nearest global proto global"),
    ("ensemble_acc", "ens."),
    ("predictor_acc", "global predictor"),
    ("off_mask_energy", "off-mask energy"),
)


def _row_line(ctx: Context, key: str, section: Section, fewer: list[str] | None = None) -> str | None:
    """A row of a setting's table. A cell averaged over fewer seeds than the row lists is marked FEWER, and
    `fewer` gets its footnote (the seeds it rests on)."""
    st = row_stats(ctx, key)
    if not st.expected:
        return None
    row = st.row
    label = row.label + (f" (from {row.setting})" if row.setting != section.setting else "")
    paper = row.paper.text() if row.paper else ""
    if not st.by_seed:
        failed = [
            r for r in ctx.runs if r.row.key == key and (ctx.run_root / r.setting / f"{r.name}.failed.txt").is_file()
        ]
        state = f"FAILED (see `{failed[0].setting}/{failed[0].name}.failed.txt`)" if failed else "not run yet"
        return "| " + " | ".join([label, state] + [""] * (len(COLUMNS) - 3) + [paper]) + " |"
    seeds = ",".join(map(str, sorted(st.by_seed))) + ("" if st.complete else f" of {len(st.expected)}")
    if same := st.same_as_twin():  # an unclipped row's seeds that are its clipped twin's runs (never clipped)
        seeds += f" ({','.join(map(str, same))}: the twin's runs)"
    cells = [label, seeds]
    for metric, column in ROW_CELLS:
        cell = mean_std(st, metric, *((1.0, 3) if metric == "off_mask_energy" else ()))
        if metric in ("local_acc", "global_acc") and cell != "-" and classifier(key) == COSINE:
            cell += COSINE_CELL
        has = sorted(st.values(metric))
        if has and len(has) < len(st.by_seed):
            cell += FEWER
            if fewer is not None:
                lacking = sorted(set(st.by_seed) - set(has))
                fewer.append(
                    f"{label}, *{column}*: seeds {','.join(map(str, has))} only; the runs of seeds "
                    f"{','.join(map(str, lacking))} do not report it"
                    + (
                        " (the twin's runs, made before the simulator reported it)"
                        if set(lacking) <= set(st.same_as_twin())
                        else ""
                    )
                )
        cells.append(cell)
    cells += [
        f"{st.mean_required('up_per'):,.0f}",
        f"{st.mean_required('up_total') / 1e6:.3f}",
        f"{st.mean_required('wall_s'):.0f}",
        paper,
    ]
    return "| " + " | ".join(cells) + " |"


# -- the rule ------------------------------------------------------------------------------------------
def compare(x: RowStats, y: RowStats, metric: str) -> Paired:
    """x - y paired by seed, in points (accuracies are fractions in the reports)."""
    return paired({s: 100 * v for s, v in x.values(metric).items()}, {s: 100 * v for s, v in y.values(metric).items()})


def beats(x: RowStats, y: RowStats, metric: str) -> bool:
    """X beats Y under the rule: the 95 % interval of the paired differences lies above 0."""
    return compare(x, y, metric).beats() > 0


def effect(x: RowStats, y: RowStats, metric: str, xname: str, yname: str, within: float | None = None) -> str:
    """Both rows' means, the paired difference with its interval and signs, and the rule's verdict."""
    if x.mean(metric) is None or y.mean(metric) is None:
        return f"{xname} vs {yname}: -"
    p = compare(x, y, metric)
    return (
        f"{xname} {mean_std(x, metric)} vs {yname} {mean_std(y, metric)}: {xname} - {yname} = {p.text()} "
        f"-> {verdict(p, xname, yname, within)}"
    )


def at_least(p: Paired, d: float) -> str:
    """ "X at least as good as Y" read under the rule: MET when X beats Y or the two are within d; MISSED when
    Y beats X by more than d can hide (Y beats X and the interval is not inside ±d); else UNDECIDED."""
    if p.beats() > 0 or p.within(d):
        return "MET"
    return "MISSED" if p.beats() < 0 else "UNDECIDED"


# -- goals -----------------------------------------------------------------------------------------------
@dataclass
class Goal:
    name: str
    status: str  # MET, MISSED, UNDECIDED, NOT RUN
    evidence: list[str]
    # a goal judged under several conditions (goal 1: per lambda): one verdict each, in order; `status` is the
    # first's
    parts: list[Goal] = field(default_factory=list)
    condition: str = ""  # what a part's verdict is judged under


@dataclass
class Judged:
    """The rows a goal is judged on: the goal rows (unclipped, seeds 0-4) when all have run; else, provisionally,
    the goal rows on their common seeds when there are at least 3; else their clipped twins (seeds 0-2) when
    those have run. `basis` says which, `waiting` lists the missing runs."""

    rows: dict[str, RowStats]  # goal row key -> the stats it is judged on
    basis: str
    waiting: list[str]
    complete: bool


def judged_rows(ctx: Context, *keys: str) -> Judged:
    main = {k: row_stats(ctx, k) for k in keys}
    waiting = [f"`{k}` seeds {','.join(map(str, st.missing))}" for k, st in main.items() if st.missing]
    if all(st.complete for st in main.values()):
        n = len(next(iter(main.values())).expected)
        return Judged(main, f"on the rows run unclipped, {n} seeds", [], True)
    common = set.intersection(*(set(st.by_seed) for st in main.values()))
    if len(common) >= len(SEEDS):  # as many paired seeds as the twins have, and the runs as the papers wrote them
        # every figure of the verdict (means, bytes) on the same seeds as the paired differences
        on_common = {k: RowStats(st.row, {s: st.by_seed[s] for s in common}, st.expected) for k, st in main.items()}
        return Judged(
            on_common,
            f"PROVISIONAL, on the rows run unclipped, on their {len(common)} common seeds "
            f"({','.join(map(str, sorted(common)))}; a goal's rows run on 5)",
            waiting,
            True,
        )
    twins = {k: row_stats(ctx, clipped(k)) for k in keys}
    if all(st.complete for st in twins.values()):
        return Judged(
            twins,
            "PROVISIONAL, on the clipped twins (seeds 0-2): the unclipped 5-seed rows are not all in yet",
            waiting,
            True,
        )
    twin_waiting = [f"`{clipped(k)}` seeds {','.join(map(str, st.missing))}" for k, st in twins.items() if st.missing]
    return Judged(main, "not run", waiting + twin_waiting, False)


def _basis_lines(j: Judged) -> list[str]:
    out = [f"judged {j.basis}"]
    if j.waiting:
        out.append("missing runs: " + "; ".join(j.waiting))
    return out


def clip_cost(ctx: Context, keys: tuple[str, ...], metric: str) -> str:
    """What the defence costs: each goal row's clipped twin minus the row, paired on their common seeds."""
    parts = []
    for k in keys:
        twin = clipped(k)
        if twin == k:
            continue
        a, b = row_stats(ctx, twin), row_stats(ctx, k)
        same = b.same_as_twin()
        if same:  # the same runs: comparing them would show a measured 0 that nothing measured
            parts.append(
                f"`{k}` seeds {','.join(map(str, same))} are the twin's runs (full-width unit prototypes: "
                "never clipped)"
            )
            continue
        p = compare(a, b, metric)
        parts.append(f"`{k}` {p.text()}" if p.n else f"`{k}` (no common seeds yet)")
    return f"clipped - unclipped ({metric_name(metric, **{k: k for k in keys})}): " + "; ".join(parts)


GOAL1_METRIC = "local_own_proto_acc@best"
# Goal 1's tinyproto rows, the paper's lambda first: lambda = 1 (the config default, FedProto's weight and the
# value the goal was written for), then the preset's (0.1 since the lambda sweep, setting L).
GOAL1_ROWS = (("B/tinyproto-lambda1", "the paper's"), ("B/tinyproto", "the preset's"))


def goal1_name() -> str:
    return (
        "tinyproto within 1 point of fedproto (or ahead) at >= 8x fewer uplink bytes, setting B. Metric: "
        f"{METRIC_NAMES[GOAL1_METRIC]}: the goal restates TinyProto's claim, so it uses the paper's metric; the "
        "head's and the nearest global prototype's are shown beside it"
    )


def goal_tinyproto(ctx: Context) -> Goal:
    """Goal 1 judged once per lambda of GOAL1_ROWS, the paper's first; the headline status is the paper's."""
    parts = [goal_tinyproto_at(ctx, key, whose) for key, whose in GOAL1_ROWS]
    return Goal(goal1_name(), parts[0].status, [], parts)


def goal_tinyproto_at(ctx: Context, tiny_key: str = "B/tinyproto", whose: str = "the preset's") -> Goal:
    """Goal 1 on one tinyproto row against B/fedproto; `condition` names the row's lambda."""
    lam = dict(ROW_BY_KEY[tiny_key].sets).get("proto_lambda")
    if lam is None:
        from protofl.presets import make_config

        lam = make_config(ROW_BY_KEY[tiny_key].preset).proto_lambda
    condition = f"at {whose} lambda = {float(lam):g} (`{tiny_key}`)"
    keys = ("B/fedproto", tiny_key)
    j = judged_rows(ctx, *keys)
    if not j.complete:
        return Goal(goal1_name(), "NOT RUN", _basis_lines(j), condition=condition)
    fp, tp = (j.rows[k] for k in keys)
    ratio = fp.mean_required("up_total") / max(tp.mean_required("up_total"), 1)
    ev = _basis_lines(j)
    if tp.mean(GOAL1_METRIC) is None or fp.mean(GOAL1_METRIC) is None:
        status = "NOT RUN"
        ev.append(f"{METRIC_NAMES[GOAL1_METRIC]}: not in these runs (runs made before the simulator reported it)")
    else:
        p = compare(tp, fp, GOAL1_METRIC)
        status = at_least(p, 1.0) if ratio >= 8 else "MISSED"
        ev.append(
            effect(tp, fp, GOAL1_METRIC, "tinyproto", "fedproto", within=1.0) + f" ({METRIC_NAMES[GOAL1_METRIC]})"
        )
    ev.append(
        f"uplink per run: fedproto {fp.mean('up_total'):,.0f} B, tinyproto {tp.mean('up_total'):,.0f} B -> "
        f"{ratio:.2f}x fewer ({'>=' if ratio >= 8 else '<'} 8x)"
    )
    for m in ("local_acc", "local_proto_acc", "local_own_proto_acc"):
        if tp.mean(m) is not None and fp.mean(m) is not None:
            ev.append(
                f"also ({metric_name(m, tinyproto=tiny_key, fedproto=keys[0])}): "
                + effect(tp, fp, m, "tinyproto", "fedproto", within=1.0)
            )
    ev.append(clip_cost(ctx, keys, "local_acc"))
    return Goal(goal1_name(), status, ev, condition=condition)


def goal_refprotofl(ctx: Context) -> Goal:
    name = (
        "refprotofl at least as accurate as fedproto (beats it, or within 1 point), setting A, alpha 0.5. Metric: "
        f"{metric_name('global_acc', refprotofl='A/a0.5-refprotofl', fedproto='A/a0.5-fedproto')}: RefProtoFL's "
        "Table 2 reports top-1 test accuracy at the end of training"
    )
    keys = ("A/a0.5-fedproto", "A/a0.5-refprotofl")
    j = judged_rows(ctx, *keys)
    if not j.complete:
        return Goal(name, "NOT RUN", _basis_lines(j))
    fp, rp = (j.rows[k] for k in keys)
    p = compare(rp, fp, "global_acc")
    ev = _basis_lines(j) + [effect(rp, fp, "global_acc", "refprotofl", "fedproto", within=1.0)]
    for m in ("global_proto_acc", "ensemble_acc", "local_acc"):
        ev.append(
            f"also ({metric_name(m, **dict(zip(('fedproto', 'refprotofl'), keys, strict=True)))}): "
            + effect(rp, fp, m, "refprotofl", "fedproto", within=1.0)
        )
    ev.append(clip_cost(ctx, keys, "global_acc"))
    return Goal(name, at_least(p, 1.0), ev)


def goal_fedpagr(ctx: Context) -> Goal:
    name = (
        "fedpagr beats fedproto in setting C, and beats each of its two ablations. Metric: "
        f"{METRIC_NAMES['ensemble_acc']}: FedPAGR's global claim and its ablation are on ensemble accuracy"
    )
    keys = ("C/fedproto", "C/fedpagr", "C/fedpagr-no-sep", "C/fedpagr-no-ent")
    j = judged_rows(ctx, *keys)
    if not j.complete:
        return Goal(name, "NOT RUN", _basis_lines(j))
    fp, pg, ns, ne = (j.rows[k] for k in keys)
    ps = [compare(pg, other, "ensemble_acc") for other in (fp, ns, ne)]
    ev = _basis_lines(j) + [
        effect(pg, fp, "ensemble_acc", "fedpagr", "fedproto"),
        effect(pg, ns, "ensemble_acc", "fedpagr", "w/o separation")
        + "; paper (CIFAR-10): separation is worth 2.7 points",
        effect(pg, ne, "ensemble_acc", "fedpagr", "w/o entropy") + "; paper (CIFAR-10): entropy is worth 3.3 points",
        f"also ({metric_name('local_acc', fedpagr='C/fedpagr', fedproto='C/fedproto')}): "
        + effect(pg, fp, "local_acc", "fedpagr", "fedproto"),
        clip_cost(ctx, keys, "ensemble_acc"),
    ]
    status = "MET" if all(p.beats() > 0 for p in ps) else "MISSED" if any(p.beats() < 0 for p in ps) else "UNDECIDED"
    return Goal(name, status, ev)


D_COMPARE = {
    # where -> (the candidate rows' tag, {single-paper preset: row}, metric)
    "A": (
        "a",
        {"refprotofl": "A/a0.5-refprotofl", "tinyproto": "A/a0.5-tinyproto", "fedpagr": "A/a0.5-fedpagr"},
        "global_acc",
    ),
    "B": ("b", {"refprotofl": "B/refprotofl", "tinyproto": "B/tinyproto", "fedpagr": "B/fedpagr"}, "local_acc"),
}


def goal_protofl(ctx: Context) -> Goal:
    suffix = preset_variant()
    compared = {} if suffix is None else {"protofl": candidate_row("b", suffix), **D_COMPARE["B"][1]}
    name = (
        "the protofl preset at least as accurate as every single-paper preset (beats it, or within 1 point) in "
        "A (alpha 0.5) and B, at no more than 2x tinyproto's uplink bytes. Metrics: A "
        f"{metric_name('global_acc', **compared)} (RefProtoFL's), B {metric_name('local_acc', **compared)} (the "
        "personalised accuracy every paper reports; each preset's own classifier, the one it predicts with)"
    )
    if suffix is None:
        return Goal(name, "NOT RUN", ["`--preset protofl` equals none of setting D's candidate rows"])
    keys = tuple(k for tag, others, _ in D_COMPARE.values() for k in (candidate_row(tag, suffix), *others.values()))
    j = judged_rows(ctx, *keys)
    if not j.complete:
        return Goal(name, "NOT RUN", _basis_lines(j))
    ev, statuses = _basis_lines(j), []
    for where, (tag, others, metric) in D_COMPARE.items():
        pf = j.rows[candidate_row(tag, suffix)]
        tp_bytes = j.rows[others["tinyproto"]].mean_required("up_total")
        ratio = pf.mean_required("up_total") / max(tp_bytes, 1)
        for n, k in others.items():
            p = compare(pf, j.rows[k], metric)
            statuses.append(at_least(p, 1.0))
            pair = {"protofl": candidate_row(tag, suffix), n: k}
            ev.append(
                f"{where} ({metric_name(metric, **pair)}): " + effect(pf, j.rows[k], metric, "protofl", n, within=1.0)
            )
        for m in ("global_acc", "ensemble_acc", "local_acc"):  # information: the gaps to fedpagr on the others
            if m != metric and pf.mean(m) is not None and j.rows[others["fedpagr"]].mean(m) is not None:
                ev.append(
                    f"{where}, also ({metric_name(m, protofl=candidate_row(tag, suffix), fedpagr=others['fedpagr'])}): "
                    + effect(pf, j.rows[others["fedpagr"]], m, "protofl", "fedpagr", within=1.0)
                )
        statuses.append("MET" if ratio <= 2.0 else "MISSED")
        ev.append(
            f"{where}: uplink protofl {pf.mean('up_total'):,.0f} B = {ratio:.2f}x tinyproto's "
            f"({'<=' if ratio <= 2 else '>'} 2x)"
        )
    if suffix == SHORTFALL_SPLIT[0]:
        ev += shortfall_parts(ctx, j)
    ev.append(clip_cost(ctx, (candidate_row("a", suffix),), "global_acc"))
    ev.append(clip_cost(ctx, (candidate_row("b", suffix),), "local_acc"))
    status = "MISSED" if "MISSED" in statuses else "UNDECIDED" if "UNDECIDED" in statuses else "MET"
    return Goal(name, status, ev)


# fedpagr and candidate (b) differ in two switches: the CPS masks and refinement. The row between them
# (fedpagr w/o refinement = (b) without the masks) says which of the two the B gap comes from. Also the
# ensemble, where the masks' cost was the table's most solid effect.
SHORTFALL_SPLIT = ("spherical", "B/fedpagr-no-refine", "B/fedpagr")


def shortfall_parts(ctx: Context, j: Judged) -> list[str]:
    """The preset against fedpagr in B, split into the masks' part and refinement's, on the head's local
    accuracy and on the ensemble. The row between them ran clipped: it is set against the clipped twins."""
    candidate, between, fedpagr = SHORTFALL_SPLIT
    pf_key, mid_st = clipped(candidate_row("b", candidate)), row_stats(ctx, between)
    pf, pg = row_stats(ctx, pf_key), row_stats(ctx, clipped(fedpagr))
    if not (mid_st.complete and pf.complete and pg.complete):
        return [f"why (B): waiting for `{between}`, `{pf_key}` and `{clipped(fedpagr)}`"]
    out = []
    for m in ("local_acc", "ensemble_acc"):
        out.append(
            f"why (B, {metric_name(m, preset=pf_key, fedpagr=fedpagr)}; clipped rows): fedpagr = the preset + full "
            "512-d prototypes (no masks) "
            f"+ refinement. Masks: {effect(mid_st, pf, m, 'w/o masks', 'preset')}. "
            f"Refinement: {effect(pg, mid_st, m, 'fedpagr', 'w/o refinement')}"
        )
    return out


def goals(ctx: Context) -> list[Goal]:
    return [goal_tinyproto(ctx), goal_refprotofl(ctx), goal_fedpagr(ctx), goal_protofl(ctx)]


def missing_lines(ctx: Context) -> list[str]:
    """Every row with runs still to make, goal rows first (the suite's order), with the seeds missing."""
    rows: dict[str, list[int]] = {}
    for run in ctx.runs:
        if ctx.cached(run) is None:
            rows.setdefault(run.row.key, []).append(run.seed)
    if not rows:
        return []
    n = sum(len(v) for v in rows.values())
    return [
        f"### Runs still missing ({n}; `python -m bench.paper_table --suite {ctx.suite}` makes them, goal rows "
        "first; `--rows`/`--seeds` choose)",
        "",
    ] + ["- " + "; ".join(f"`{k}` {','.join(map(str, v))}" for k, v in rows.items()), ""]


# -- what federation adds: the local-only control --------------------------------------------------------
CONTROLS: dict[str, tuple[str, tuple[str, ...]]] = {
    # local-only row -> the rows set against it (each unclipped goal row, else the row itself)
    "A/a0.5-local-only": (
        "A, alpha 0.5",
        ("A/a0.5-fedproto", "A/a0.5-refprotofl", "A/a0.5-tinyproto", "A/a0.5-fedpagr", "A/a0.5-fedavg"),
    ),
    "A/a100-local-only": ("A, alpha 100", ("A/a100-fedproto", "A/a100-refprotofl", "A/a100-fedavg")),
    "B/local-only": ("B", ("B/fedproto", "B/tinyproto", "B/refprotofl", "B/fedpagr")),
    "C/local-only": ("C", ("C/fedproto", "C/fedpagr")),
}


def _available(ctx: Context, key: str) -> RowStats:
    """A row's unclipped runs once complete, else its clipped twin's (the one with runs)."""
    st = row_stats(ctx, key)
    if st.complete or clipped(key) == key:
        return st
    twin = row_stats(ctx, clipped(key))
    return twin if twin.by_seed else st


def _intro_and_head(intro: str, columns: tuple[str, ...], align: tuple[str, ...]) -> list[str]:
    """A paragraph, a blank line and a markdown table's two header lines."""
    return [intro, "", "| " + " | ".join(columns) + " |", "|" + "|".join(align) + "|"]


def control_lines(ctx: Context) -> list[str]:
    out = _intro_and_head(
        "Each method minus the local-only control of its federation (every client trains alone on "
        "the same data, rounds and epochs), paired by seed, in points: what federation adds to the "
        "own classifier's local accuracy (final round; the local-only control's is its head, a method marked "
        "(cos) predicts by cosine to P, see the columns' note at the top) and to the nearest own prototype's "
        "(best round, TinyProto's eq. 12). A row marked [clipped] is a clipped twin standing in until the "
        "unclipped row has run.",
        (
            "setting",
            "method",
            "seeds",
            "classifier local: method - local only",
            "nearest own proto, best: method - local only",
        ),
        ("---", "---", "--:", "---", "---"),
    )
    for ctl_key, (where, keys) in CONTROLS.items():
        ctl = row_stats(ctx, ctl_key)
        if not ctl.by_seed:
            out.append(f"| {where} | (local-only control not run yet: `{ctl_key}`) | | | |")
            continue
        for k in keys:
            st = _available(ctx, k)
            a, b = compare(st, ctl, "local_acc"), compare(st, ctl, "local_own_proto_acc@best")
            label = st.row.label + (COSINE_CELL if classifier(st.row.key) == COSINE else "")
            out.append(
                f"| {where} | {label} | {a.n} | {a.text()} -> {verdict(a, 'it', 'local only')} | "
                f"{b.text() if b.n else '-'} |"
            )
    return out


# -- the global predictor against FedAvg's global model ------------------------------------------------
PREDICTORS: dict[str, tuple[str, str | None, tuple[str, ...]]] = {
    # setting -> (label, FedAvg's row, rows whose technique defines a global predictor)
    "A05": ("A, alpha 0.5", "A/a0.5-fedavg", ("A/a0.5-refprotofl-frozen",)),
    "A100": ("A, alpha 100", "A/a100-fedavg", ("A/a100-refprotofl-frozen",)),
    "B": ("B", "B/fedavg", ("B/refprotofl-frozen",)),
    "C": ("C", None, ()),
}


def predictor_lines(ctx: Context) -> list[str]:
    out = _intro_and_head(
        "How close a prototype federation's deployable model comes to FedAvg's global model, and at "
        "what fraction of its uplink bytes (broker_server/simulation/predictor.py: RefProtoFL's "
        "federated adapter and head on the shared backbone, which exists with `backbone=frozen` "
        "only: with the default every device trains its own backbone and there is no one model to "
        "give a new device, so these rows run RefProtoFL with `--set backbone=frozen`; FedPAGR and "
        "FedProto define none, their backbones stay private). Global predictor and FedAvg's model "
        "both scored on the full test set at the final round.",
        (
            "setting",
            "row",
            "seeds",
            "global predictor",
            "FedAvg global",
            "predictor - FedAvg (points)",
            "uplink, fraction of FedAvg's",
        ),
        ("---", "---", "--:", "--:", "--:", "---", "--:"),
    )
    for _, (where, fedavg_key, keys) in PREDICTORS.items():
        if fedavg_key is None:
            out.append(f"| {where} | FedAvg cannot run: five architectures share no parameter vector | | | | | |")
            continue
        fa = _available(ctx, fedavg_key)
        for k in keys:
            st = row_stats(ctx, k)
            if st.mean("predictor_acc") is None:
                out.append(
                    f"| {where} | {st.row.label} | - | not run yet (`{k}`) | {mean_std(fa, 'global_acc')} | - | - |"
                )
                continue
            p = paired(
                {s: 100 * v for s, v in st.values("predictor_acc").items()},
                {s: 100 * v for s, v in fa.values("global_acc").items()},
            )
            frac = st.mean_required("up_total") / max(fa.mean("up_total") or 1, 1)
            out.append(
                f"| {where} | {st.row.label} | {p.n} | {mean_std(st, 'predictor_acc')} | "
                f"{mean_std(fa, 'global_acc')} | {p.text()} | {frac:.4f} |"
            )
    return out


# -- ours beside the papers' Fashion-MNIST figures ------------------------------------------------------------
PAPER_METRICS = (
    ("local", "local_acc", "local"),
    ("global_", "global_acc", "global"),
    ("ensemble", "ensemble_acc", "ens."),
)
_LEADING_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
FEDAVG = "fedavg"
FEDAVG_PER_CLIENT_REF = "F"
FEDAVG_PER_CLIENT_NOTE = (
    "FedAvg's per-client global accuracy (each client's model after its final round's local training, on the "
    "test set, mean over clients: the metric of the prototype rows' *global*, which the paper's prototype "
    "figures most likely are) is not in the cached runs. The FedAvg reports hold only the aggregated model's "
    "test accuracy: "
    'FedAvg\'s clients skip the test set (edge_agent/core/agent.py `_metrics`, `federate != "full"`) and the '
    "report's `global_acc` is the server's evaluation of the aggregated vector (broker_server/simulation/"
    "report.py `round_row`). No command produces it today: it needs the clients of a `federate=full` run to "
    "score the test set and the report to keep their mean beside the global model's; then the FedAvg rows "
    "rerun with their cached runs moved aside (their command and config are unchanged, so the cache would keep "
    "them): `python -m bench.paper_table --suite full --rows 'A/a0.5-fedavg,A/a100-fedavg'` (~35-40 s a run "
    "here now, plus ~1 min for ten clients each scoring the 10,000 test images)."
)


def paper_lines(ctx: Context) -> list[str]:
    """Every Fashion-MNIST figure a paper reports beside ours in the same metric, the difference, and why.
    For RefProtoFL each prototype method's gap is set against FedAvg's (one global model in both metrics) and
    against its own ensemble accuracy's gap (one federation-level predictor)."""
    out = [
        "Ours: mean ± std over the seeds at our CPU sizing; the paper's: in its own setting (references under "
        "the setting's table). TinyProto's figures are CIFAR-10 (only its byte ratio carries over: goal 1) and "
        "FedPAGR's ablation is CIFAR-10 points; both stay in their sections.",
        "",
        "| method | federation | metric | paper | ours | ours - paper (points) |",
        "|---|---|---|--:|--:|--:|",
    ]
    gaps: dict[str, dict[str, tuple[float, float | None]]] = {}  # ref -> preset -> (global - paper, ensemble - paper)
    for row in ROWS:
        if row.paper is None or row.paper.ref not in PAPER_GAP_NOTES:
            continue
        st, fed = _available(ctx, row.key), FEDERATIONS[row.fed]
        for attr, metric, name in PAPER_METRICS:
            match = _LEADING_NUMBER.match(getattr(row.paper, attr) or "")
            if match is None:
                continue
            paper, ours = float(match.group()), st.mean(metric)
            gap = 100 * ours - paper if st.complete and ours is not None else None  # ours - paper, in points
            shown = (mean_std(st, metric), f"{gap:+.2f}") if gap is not None else ("not run yet", "-")
            where = f"{row.setting}: {fed.clients} clients, alpha {fed.alpha:g}"
            one_model = row.preset == FEDAVG and attr == "global_"
            cos = classifier(row.key) == COSINE
            if one_model:
                name = "global model (one model)"
            elif metric == "global_acc":
                name = "global (per client" + (", cos)" if cos else ")")
            elif metric == "local_acc" and cos:
                name += " (cos)"
            out.append(
                f"| {st.row.label} | {where} | {name} | {paper:.2f} [{row.paper.ref}] | {shown[0]} | {shown[1]} |"
            )
            if one_model:  # the paper's FedAvg figure beside the prototype rows' metric: not in the runs
                out.append(
                    f"| {st.row.label} | {where} | global (per client) | {paper:.2f} [{row.paper.ref}] | "
                    f"not in the cached runs [{FEDAVG_PER_CLIENT_REF}] | - |"
                )
            if gap is not None and attr == "global_":
                ens = st.mean("ensemble_acc")
                gaps.setdefault(row.paper.ref, {})[row.preset] = (gap, None if ens is None else 100 * ens - paper)
    out.append("")
    out.append(f"- [{FEDAVG_PER_CLIENT_REF}] {FEDAVG_PER_CLIENT_NOTE}")
    for ref, note in PAPER_GAP_NOTES.items():
        out.append(f"- [{ref}] {note}")
        by_preset = gaps.get(ref, {})
        if "fedavg" in by_preset and len(by_preset) > 1:
            fedavg = by_preset["fedavg"][0]
            parts = [
                f"{p} global {g:+.2f} ({g - fedavg:+.2f} beyond FedAvg's)"
                + (f", ensemble {e:+.2f}" if e is not None else "")
                for p, (g, e) in by_preset.items()
                if p != "fedavg"
            ]
            out.append(
                f"  Measured, ours - paper in points: FedAvg's global model {fedavg:+.2f}; " + "; ".join(parts) + "."
            )
    return out


# -- the combined preset's default, from setting D ----------------------------------------------------------
DECISION_RULE = (
    "Written before the runs: a candidate's score per seed is the mean of its final global accuracy "
    "in A and its final local accuracy in B (the metrics goal 4 is judged on). The best candidate is the "
    "one with the highest mean score; every candidate that the best does not beat under the rule is "
    "within noise of it, and among those the one with the fewest uplink bytes (A + B, mean over seeds) "
    'is the default. The rule is now the paired interval (it was "ahead on the mean AND in every '
    'seed" when the decision was first taken; both pick the same candidate on these runs). Every '
    "candidate's runs here ran clipped (the preset's candidate also runs unclipped, for goal 4)."
)


@dataclass
class Decision:
    status: str  # "CHOSEN" or "NOT RUN"
    lines: list[str]  # markdown
    choice: dict[str, Any] | None = None  # stage switches of the chosen candidate
    matches_preset: bool | None = None


def _score(a: RowStats, b: RowStats) -> RowStats:
    """A pseudo-row whose per-seed 'score' is the mean of A's global and B's local accuracy, and whose
    'up_total' is A's + B's uplink."""
    seeds = set(a.values("global_acc")) & set(b.values("local_acc"))
    by_seed = {
        s: {
            "score": (a.by_seed[s]["global_acc"] + b.by_seed[s]["local_acc"]) / 2,
            "up_total": a.by_seed[s]["up_total"] + b.by_seed[s]["up_total"],
        }
        for s in seeds
    }
    return RowStats(a.row, by_seed, a.expected)


def decide_default(ctx: Context) -> Decision:
    keys = {suffix: (decision_row("a", suffix), decision_row("b", suffix)) for suffix, _, _ in CANDIDATES}
    got = {k: row_stats(ctx, k) for pair in keys.values() for k in pair}
    missing = [k for k, st in got.items() if not st.complete]
    if missing:
        return Decision("NOT RUN", ["waiting for: " + ", ".join(f"`{m}`" for m in missing)])
    scored = {suffix: _score(got[a], got[b]) for suffix, (a, b) in keys.items()}
    best = max(scored, key=lambda s: scored[s].mean("score") or 0.0)
    tied = [s for s in scored if s == best or not beats(scored[best], scored[s], "score")]
    chosen = min(tied, key=lambda s: scored[s].mean("up_total") or 0.0)
    choice = dict(next(sw for s, _, sw in CANDIDATES if s == chosen))
    current = preset_stages()
    lines = [
        DECISION_RULE,
        "",
        "| candidate | A global | B local | score | uplink A + B (MB) | |",
        "|---|--:|--:|--:|--:|---|",
    ]
    for suffix, label, _ in CANDIDATES:
        a, b = (got[k] for k in keys[suffix])
        sc = scored[suffix]
        gap = compare(scored[suffix], scored[best], "score").text() if suffix != best else ""
        mark = (
            "**chosen**"
            if suffix == chosen
            else "best score"
            if suffix == best
            else "within noise, more bytes"
            if suffix in tied
            else f"beaten by {best}"
        )
        mark += f"; vs best {gap}" if gap else ""
        lines.append(
            f"| {label} | {mean_std(a, 'global_acc')} | {mean_std(b, 'local_acc')} | "
            f"{mean_std(sc, 'score')} | {sc.mean_required('up_total') / 1e6:.3f} | {mark} |"
        )
    switches = ", ".join(f"{k}={json.dumps(v)}" for k, v in choice.items())
    now = ", ".join(f"{k}={json.dumps(v)}" for k, v in current.items())
    lines += [
        "",
        f"Chosen: **{chosen}** ({switches}).",
        f"`--preset protofl` at this revision: {now} -> "
        + (
            "matches the rule's choice."
            if current == choice
            else "does NOT match the rule's choice: set PRESETS['protofl'] in protofl/presets.py to it."
        ),
    ]
    return Decision("CHOSEN", lines, choice, current == choice)


# -- combinations refused since they were measured -------------------------------------------------------------
def refused_lines(ctx: Context) -> list[str]:
    """Runs kept in D/refused/ (made before the config refused their switches) against the candidate they
    turned out to equal, seed by seed: the measurement behind the refusal."""
    out = [
        "Scaling with ERPA when the public set covers every class: every anchor is a public-set mean, no "
        "client sends an n-weighted prototype, so scaling acts on nothing. These runs were made before the "
        "config refused the combination (`protofl/config.py`); each is compared with its scaling-free twin, "
        "seed by seed (A: global accuracy, B: local accuracy).",
        "",
        "| refused combination | on | seeds | its accuracy, per seed | twin | twin's, per seed "
        "| max abs diff (points) |",
        "|---|---|--:|---|---|---|--:|",
    ]
    metric_of = {"a": "global_acc", "b": "local_acc"}
    for suffix, label, _, twins in REFUSED:
        for tag, twin_key in twins.items():
            twin = row_stats(ctx, twin_key)
            mine: dict[int, float] = {}
            for seed in SEEDS:
                p = ctx.run_root / "D" / "refused" / f"{tag}-{suffix}-s{seed}.json"
                if p.is_file():
                    mine[seed] = summary(json.loads(p.read_text()))[metric_of[tag]]
            theirs = twin.values(metric_of[tag])
            common = sorted(set(mine) & set(theirs))
            if not mine:
                continue
            diff = max((abs(mine[s] - theirs[s]) for s in common), default=None)
            out.append(
                f"| {label} | {'A' if tag == 'a' else 'B'} | {','.join(map(str, sorted(mine)))} | "
                f"{' / '.join(pct(mine[s]) for s in sorted(mine))} | {twin.row.label} (`{twin_key}`) | "
                f"{' / '.join(pct(theirs.get(s)) for s in sorted(mine))} | "
                f"{'-' if diff is None else f'{100 * diff:.2f}'} |"
            )
    return out


# -- lambda sweep --------------------------------------------------------------------------------------------
def sweep_lines(ctx: Context) -> list[str]:
    """Per alignment term: each lambda's global accuracy on seed 0 (the choice), on seeds 1-2, and the chosen
    lambda against lambda = 1 paired over all three seeds: the preset's default moves only when it beats 1."""
    out = [
        "Chosen on seed 0 of A (alpha 0.5, global accuracy, the head on the test set at the final round); then the "
        "chosen lambda minus lambda = 1, paired over seeds 0-2: the preset's default moves to the chosen lambda "
        "only when it beats lambda = 1 under the rule. Every sweep row, and lambda = 1 (ERPA: refprotofl's "
        "clipped twin of A's row; CPS: a sweep row of its own), ran clipped.",
        "",
        "| term | lambda | global, seed 0 | global, seeds 1, 2 | mean ± std | local, mean | |",
        "|---|--:|--:|--:|--:|--:|---|",
    ]
    decisions = []
    for what, (preset, default_key) in SWEEP.items():
        rows = {1.0: row_stats(ctx, default_key)} if default_key else {}
        rows.update({lam: row_stats(ctx, f"L/{what}-lambda{lam:g}") for lam in LAMBDAS[what]})
        seed0 = {lam: st.by_seed.get(SEEDS[0], {}).get("global_acc") for lam, st in rows.items()}
        ready = all(v is not None for v in seed0.values())
        chosen = max(seed0, key=lambda lam: seed0[lam] or 0.0) if ready else None
        if not all(st.expected for st in rows.values()):
            continue
        for lam in sorted(rows):
            st = rows[lam]
            later = " / ".join(pct(st.by_seed.get(s, {}).get("global_acc")) for s in SEEDS[1:])
            mark = ""
            if lam == chosen:
                mark = "**chosen on seed 0**"
                if lam != 1.0 and st.complete and rows[1.0].complete:
                    p = compare(st, rows[1.0], "global_acc")
                    mark += f"; minus lambda = 1: {p.text()} -> {verdict(p, f'lambda {lam:g}', 'lambda 1')}"
                    decisions.append(_lambda_decision(preset, lam, p.beats() > 0))
                elif lam != 1.0:
                    mark += ", not yet confirmed (seeds 1, 2 missing)"
                    decisions.append(f"{preset}: waiting for seeds 1, 2 of lambda {lam:g}")
                else:
                    decisions.append(f"{preset}: proto_lambda stays 1 (best on seed 0)")
                if lam in (min(rows), max(rows)):
                    mark += "; at the grid's edge: the best may lie beyond it"
            out.append(
                f"| {what.upper()} ({preset}) | {lam:g} | {pct(seed0[lam])} | {later} | "
                f"{mean_std(st, 'global_acc')} | {mean_std(st, 'local_acc')} | {mark} |"
            )
        if chosen is None:
            missing = [f"lambda {lam:g}" for lam, v in seed0.items() if v is None]
            decisions.append(f"{preset}: waiting for seed 0 of {', '.join(missing)}")
    return out + ([""] + [f"- default: {d}" for d in decisions] if decisions else [])


def _lambda_decision(preset: str, chosen: float, beats_one: bool) -> str:
    """What the sweep says of the preset's default, against the default the preset has now."""
    from protofl.presets import make_config

    now = float(make_config(preset).proto_lambda)
    if beats_one:
        return (
            f"{preset}: proto_lambda is {chosen:g}, moved from 1 by this sweep ({chosen:g} beats 1)"
            if now == chosen
            else f"{preset}: proto_lambda should move to {chosen:g} (the preset has {now:g})"
        )
    return (
        f"{preset}: proto_lambda stays 1 ({chosen:g} does not beat it)"
        if now == 1.0
        else f"{preset}: proto_lambda should go back to 1 ({chosen:g} does not beat it; the preset has {now:g})"
    )


# -- plots ---------------------------------------------------------------------------------------------------
_PLOT_NOTE_SHOWN = False


def _curves(ctx: Context, key: str) -> tuple[list[float], list[float], list[float], list[float]] | None:
    """Mean cumulative uplink and mean / min / max local accuracy per round over the row's seeds."""
    cached = [ctx.cached(r) for r in ctx.runs if r.row.key == key]
    reps = [r for r in cached if r is not None and r["rounds"]]
    if not reps:
        return None
    n = min(len(r["rounds"]) for r in reps)
    xs, mean, lo, hi = [], [], [], []
    for i in range(n):
        accs = [r["rounds"][i]["local_acc"] for r in reps if r["rounds"][i].get("local_acc") is not None]
        if len(accs) != len(reps):
            continue
        xs.append(max(statistics.fmean(sum(x["uplink_bytes"] for x in r["rounds"][: i + 1]) for r in reps), 1))
        mean.append(100 * statistics.fmean(accs))
        lo.append(100 * min(accs))
        hi.append(100 * max(accs))
    return xs, mean, lo, hi


def plot_section(ctx: Context, section: Section, path: Path) -> bool:
    """Local accuracy vs cumulative uplink (mean curve, band = min..max over seeds), and the final global
    and ensemble accuracy (mean, bars = min..max) at each row's total uplink."""
    global _PLOT_NOTE_SHOWN
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import EngFormatter, LogLocator, NullFormatter
    except ImportError:
        if not _PLOT_NOTE_SHOWN:
            print("note: matplotlib is not installed; skipping the plots (pip install -e '.[plotting]')", flush=True)
            _PLOT_NOTE_SHOWN = True
        return False
    colors = (
        [plt.get_cmap("tab20")(i) for i in range(20)]
        if len(section.rows) > 10
        else plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    )
    markers = "osD^v<>ph*X"
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.6))
    drawn = False
    for i, key in enumerate(section.rows):
        st = row_stats(ctx, key)
        if not st.by_seed:
            continue
        drawn = True
        row = st.row
        label = (
            row.label
            + (f" (from {row.setting})" if row.setting != section.setting else "")
            + f" [{len(st.by_seed)} seed{'s' if len(st.by_seed) != 1 else ''}]"
        )
        color, marker = colors[i % len(colors)], markers[i % len(markers)]
        curve = _curves(ctx, key)
        if curve is not None and curve[0]:
            xs, mean, lo, hi = curve
            axes[0].plot(xs, mean, marker=marker, markersize=3, color=color, label=label, alpha=0.9)
            axes[0].fill_between(xs, lo, hi, color=color, alpha=0.15)
        for ax, metric in ((axes[1], "global_acc"), (axes[2], "ensemble_acc")):
            vals = list(st.values(metric).values())
            if vals:
                m = 100 * statistics.fmean(vals)
                ax.errorbar(
                    [st.mean("up_total")],
                    [m],
                    yerr=[[m - 100 * min(vals)], [100 * max(vals) - m]],
                    marker=marker,
                    color=color,
                    capsize=3,
                    label=label,
                )
    if not drawn:
        plt.close(fig)
        return False
    for ax, title in zip(
        axes,
        (
            "local accuracy per round (mean, band: min-max over seeds)",
            "final global accuracy (mean, bars: min-max)",
            "final ensemble accuracy (mean, bars: min-max)",
        ),
        strict=True,
    ):
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(EngFormatter(unit="B", places=1))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("cumulative uplink bytes (all clients)")
        ax.set_ylabel("accuracy (%)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    for ax in axes[1:]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(f"{section.title} ({ctx.suite} suite)")
    fig.tight_layout(rect=(0, 0.04 + 0.035 * ((len(handles) + 2) // 3), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, path)
    return True


# -- the document --------------------------------------------------------------------------------------------
def machine() -> str:
    try:
        torch_v = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_v = "not installed"
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return (
        f"{os.cpu_count()} CPUs, {platform.platform()}, {platform.machine()}, Python "
        f"{platform.python_version()}, torch {torch_v}; load average at writing {load}"
    )


def _header(ctx: Context, done: list[tuple[Run, dict[str, Any]]]) -> list[str]:
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    g = ctx.git
    dirty = (
        f"dirty ({g['modified_tracked']} modified tracked file(s), {g['untracked']} untracked)"
        if g["dirty"]
        else "clean"
    )
    revs = sorted(
        {f"{rep['bench']['git_rev']}{' (dirty)' if rep['bench'].get('git_dirty') else ''}" for _, rep in done}
    )
    finished = sorted(rep["bench"]["finished_utc"] for _, rep in done)
    # where the runs ran (the simulate report's machine block; runs made before it existed say nothing)
    where: dict[str, int] = {}
    for _, rep in done:
        m = rep.get("machine")
        k = f"{m['cpu_model']}, {m['cpus']} CPUs, torch {m['torch_threads']} thread(s)" if m else "not recorded"
        where[k] = where.get(k, 0) + 1
    out = [f"# Paper benchmark on Fashion-MNIST ({ctx.suite} suite)", ""]
    if ctx.sizing_key != ctx.suite:
        out += [f"**Sizing `{ctx.sizing_key}` (test only): the numbers mean nothing.**", ""]
    return out + [
        f"- command: `{ctx.command}` (from the repository root; resumable: rerun it to finish missing runs)",
        f"- written: {now}; runs finished between {finished[0] + ' and ' + finished[-1] + ' UTC' if finished else '-'}",
        f"- machine: {machine()}",
        f"- git revision: {g['rev']}, tree {dirty}; runs made at: {', '.join(revs) or '-'}",
        "- runs' machines: " + ("; ".join(f"{k} ({n} runs)" for k, n in sorted(where.items())) or "-"),
        f"- runs: {len(done)} of {len(ctx.runs)} finished, {sum(rep['bench']['cli_wall_s'] for _, rep in done):,.0f} s "
        f"of wall time in all (sum of the CLI calls); cache: `{os.path.relpath(ctx.run_root, ctx.table_path.parent)}`",
        "",
        "Every run is `protofl-server simulate` on Fashion-MNIST, called as a subprocess; the exact commands are "
        "listed under each table. Within a section every method has the same data, partitions, model(s), seeds "
        "and rounds.",
        "",
        "Columns: **mean ± std over the seeds listed** (sample std), each accuracy named for what it computes. "
        "*classifier local* = the model's own classifier on each client's 25 % held-out split, sample-weighted, "
        "final round: its linear head, or, in a cell marked *(cos)*, the cosine classifier of FedPAGR's objective "
        "(the rows that train the consensus projection on unit prototypes: fedpagr, the protofl preset, setting "
        "D's spherical candidates): softmax(z_hat . P^T / beta), the unit feature against the anchored global "
        "class vectors P (the head's rows are set to P), i.e. the nearest global prototype by cosine, the same "
        "prediction as the next column's (edge_agent/techniques/fedpagr.py, `CosineClassifier`); "
        "*nearest global proto local* = the same split by the nearest *global* prototype (FedProto's inference; L2, "
        "FedPAGR: cosine to P), final round; *nearest own proto local, best rnd* = by the nearest of the client's "
        "*own* prototypes (class means of its training features), the best round's (TinyProto's eq. 12 metric; "
        "'-' for runs made before the simulator reported it); *classifier global* = each client's own classifier "
        "(head, or *(cos)* as above) on the test set, mean over clients (FedAvg: its one global model, not a mean "
        "over clients); *nearest global proto global* = the same by the nearest "
        "global prototype; *ens.* = the clients' averaged class probabilities on the test set (FedAvg has none); "
        "*global predictor* = the federation's deployable model where the technique defines one (RefProtoFL: "
        "adapter and head on the shared backbone); every test-set figure uses all 10,000 images at the final "
        "round. *off-mask energy* = the fraction of ||z||^2 outside each sample's CPS mask on the local split (CPS "
        "rows). Rows marked [clipped] ran with upload clipping (`--clip on`); the others with `--clip off`, the "
        "papers' methods as written. Bytes are counted from the real encoded messages: *B/client/rnd* = total "
        "over the run / (clients x rounds); evaluation traffic is not uplink. *wall s* = mean simulation wall "
        "time on a CPU shared with other jobs. *paper* = the figure from ALGORITHMS.md's reference list, in the "
        "paper's own setting (model, data, rounds differ). A cell marked † is averaged over fewer seeds than "
        "its row lists; the footnote under its table names the seeds.",
        "",
    ]


def _sizing(ctx: Context, done: list[tuple[Run, dict[str, Any]]]) -> list[str]:
    sz = SIZING[ctx.sizing_key]
    out = [
        "## Sizing",
        "",
        "| federation | clients, alpha, archs | rounds | --train-limit | --test-limit | --eval-every | --test-every |",
        "|---|---|---|---|---|---|---|",
    ]
    used = {r.fed for r in ctx.runs}
    for k, f in FEDERATIONS.items():
        if k in used:
            s = sz[k]
            desc = f.describe + (f" (here {s.clients} clients)" if s.clients is not None else "")
            out.append(
                f"| {k} | {desc} | {s.rounds} | {s.train_limit} | {s.test_limit or 'all 10,000'} | "
                f"{s.eval_every} | {s.test_every} |"
            )
    out += [
        "",
        SIZING_NOTE
        if ctx.sizing_key == "full"
        else f"`{ctx.sizing_key}` sizing: a smoke run (few rounds, small subsets, seed 0 only); only the runs the "
        "goals need. The `full` suite's sizing is explained in bench/results/TABLE.md.",
        "",
    ]
    out += ["### Measured wall time", "", "| setting | runs finished | sum of CLI wall times (s) |", "|---|--:|--:|"]
    for setting in ("A", "B", "C", "D", "L"):
        mine = [rep for r, rep in done if r.setting == setting]
        total = sum(1 for r in ctx.runs if r.setting == setting)
        if total:
            wall = sum(rep["bench"]["cli_wall_s"] for rep in mine)
            out.append(f"| {setting} | {len(mine)} of {total} | {wall:,.0f} |")
    return out + [""]


def _section(ctx: Context, sec: Section, plot_dir: Path) -> list[str]:
    f, s = FEDERATIONS[sec.fed], SIZING[ctx.sizing_key][sec.fed]
    out = [
        f"### {sec.title}",
        "",
        f"{f.describe}{f' (here {s.clients} clients)' if s.clients is not None else ''}; {s.rounds} rounds, "
        f"--train-limit {s.train_limit}, test set: {s.test_limit or 'all 10,000'} images.",
        "",
    ]
    out += [f"- {n}" for n in sec.notes] + [""]
    out += ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] + ["--:"] * (len(COLUMNS) - 2) + ["---"]) + "|"]
    refs: list[str] = []
    cmds: list[str] = []
    fewer: list[str] = []
    for key in sec.rows:
        line = _row_line(ctx, key, sec, fewer)
        if line is None:
            continue
        out.append(line)
        row = ROW_BY_KEY[key]
        if row.paper and row.paper.ref not in refs:
            refs.append(row.paper.ref)
        if row.setting == sec.setting:
            for run in (r for r in ctx.runs if r.row.key == key):
                rep = ctx.cached(run)
                today = run_args(run, ctx.sizing_key)
                if rep is None:
                    cmds.append(f"{run.label} (not run yet): protofl-server {shlex.join(today)}")
                    continue
                cmds.append(f"{run.label}: {rep['bench']['command']}")
                if not rep.get("same_as") and as_spelled_today(rep["bench"].get("args") or []) != today:
                    cmds.append(f"  (made as spelled then; the same run today: protofl-server {shlex.join(today)})")
    out.append("")
    out += [f"† {n}.  " for n in fewer] + ([""] if fewer else [])
    out += [f"[{r}] {PAPER_REFS[r]}  " for r in refs]
    png = plot_dir / f"{sec.key}.png"
    if plot_section(ctx, sec, png):
        out += ["", f"![{sec.title}]({os.path.relpath(png, ctx.table_path.parent)})"]
    return out + ["", "<details><summary>commands</summary>", "", "```"] + cmds + ["```", "", "</details>", ""]


def goal_lines(judged: list[Goal]) -> list[str]:
    """The goals as a numbered list: each verdict (a goal judged under several conditions: each condition's,
    the first first), then its evidence."""
    out = []
    for i, goal in enumerate(judged, 1):
        verdicts = "; ".join(f"**{part.status}** {part.condition}" for part in goal.parts)
        out.append(f"{i}. {verdicts or f'**{goal.status}**'}: {goal.name}")
        out += [f"   - {e}" for e in goal.evidence]
        for part in goal.parts:
            out.append(f"   - {part.condition}: **{part.status}**")
            out += [f"     - {e}" for e in part.evidence]
    return out


def write(ctx: Context, quiet: bool = False) -> Path:
    done = [(r, rep) for r in ctx.runs if (rep := ctx.cached(r)) is not None]
    out = _header(ctx, done) + _sizing(ctx, done)
    out += [
        "## Goals",
        "",
        RULE
        + (
            " Quick/tiny suites: one seed, too few rounds to be evidence."
            if ctx.suite != "full" or ctx.sizing_key != "full"
            else ""
        ),
        "",
    ]
    out += goal_lines(goals(ctx))
    out.append("")
    out += missing_lines(ctx)
    decision = decide_default(ctx)
    out += [
        "## Default of the `protofl` preset (decided by setting D)",
        "",
        'ALGORITHMS.md: which combination of stages is the default "is decided by the ablation benchmark, not '
        'by taste". Candidates: the rows of setting D, and (a) w/o CPS, whose switches are the refprotofl '
        "preset's (its rows are refprotofl's: same federation, sizing and seeds).",
        "",
    ]
    out += decision.lines if decision.status == "CHOSEN" else [DECISION_RULE, "", f"**NOT RUN**: {decision.lines[0]}"]
    out += ["", "### Refused since measured: scaling with ERPA on a full public set", ""] + refused_lines(ctx)
    out += ["", "## Lambda sweep (alignment term on the MSE scale)", ""] + sweep_lines(ctx) + [""]
    out += ["## What federation adds: the local-only control", ""] + control_lines(ctx) + [""]
    out += ["## The global predictor against FedAvg's global model", ""] + predictor_lines(ctx) + [""]
    out += ["## Ours beside the papers' Fashion-MNIST figures", ""] + paper_lines(ctx) + [""]
    plot_dir = ctx.run_root / "plots"
    for setting in ("A", "B", "C", "D", "L"):
        secs = [s for s in SECTIONS if s.setting == setting and any(row_stats(ctx, k).expected for k in s.rows)]
        if secs:
            out += [f"## Setting {setting}", ""]
            for sec in secs:
                out += _section(ctx, sec, plot_dir)
    if ctx.sizing_key == "full":
        out += ["## Setting A at the papers' sizing, on a GPU", "", GPU_NOTE, ""]
    ctx.table_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = ctx.table_path.with_name(f".{ctx.table_path.name}.{os.getpid()}.tmp")
    tmp.write_text("\n".join(out) + "\n")
    os.replace(tmp, ctx.table_path)
    if not quiet:
        print(f"wrote {ctx.table_path}", file=sys.stderr)
    return ctx.table_path

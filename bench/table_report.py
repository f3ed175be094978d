"""Rendering for `bench.paper_table`: TABLE.md (mean ± std over seeds), the goals judged by the written
rule, the default's decision, the lambda sweep and one PNG per section."""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import statistics
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from bench.table_runs import (CANDIDATES, FEDERATIONS, GPU_NOTE, LAMBDAS, PAPER_GAP_NOTES, PAPER_REFS, ROW_BY_KEY, ROWS,
                              SECTIONS, SEEDS, SIZING,
                              REFUSED, SIZING_NOTE, SWEEP, Row, Run, Section, candidate_row, preset_stages,
                              preset_variant, run_args)

COLUMNS = ("method", "seeds", "local", "local proto", "global", "global proto", "ens.", "off-mask energy",
           "up B/client/rnd", "up total MB", "wall s", "paper (their setting)")
# Final-round metrics of a run, as the report's last row holds them.
METRICS = ("local_acc", "local_proto_acc", "global_acc", "global_proto_acc", "ensemble_acc", "off_mask_energy")

RULE = ("A claim \"X beats Y\" holds only when X is ahead on the mean over seeds AND in every seed (paired: same "
        "seed, same partition); otherwise it is a tie (ALGORITHMS.md, Evaluation > Statistics). A goal is judged "
        "only when every seed of its rows has run.")


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
    slots = sum(r["clients"] for r in rows) or 1  # client-rounds
    tot = rep["totals"]
    out["up_per"] = tot["uplink_bytes"] / slots
    out["down_per"] = tot["downlink_bytes"] / slots
    out["up_total"] = tot["uplink_bytes"]
    out["wall_s"] = tot["wall_s"]
    return out


@dataclass
class RowStats:
    row: Row
    by_seed: dict[int, dict[str, Any]]  # seed -> summary, for the seeds that have run (in the suite)
    expected: tuple[int, ...]  # the row's seeds in this suite

    @property
    def complete(self) -> bool:
        return bool(self.expected) and set(self.by_seed) == set(self.expected)

    def values(self, metric: str) -> dict[int, float]:
        return {s: v[metric] for s, v in self.by_seed.items() if v.get(metric) is not None}

    def mean(self, metric: str) -> float | None:
        vals = list(self.values(metric).values())
        return statistics.fmean(vals) if vals else None

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


def _row_line(ctx: Context, key: str, section: Section) -> str | None:
    st = row_stats(ctx, key)
    if not st.expected:
        return None
    row = st.row
    label = row.label + (f" (from {row.setting})" if row.setting != section.setting else "")
    paper = row.paper.text() if row.paper else ""
    if not st.by_seed:
        failed = [r for r in ctx.runs if r.row.key == key and (ctx.run_root / r.setting / f"{r.name}.failed.txt").is_file()]
        state = f"FAILED (see `{failed[0].setting}/{failed[0].name}.failed.txt`)" if failed else "not run yet"
        return "| " + " | ".join([label, state] + [""] * (len(COLUMNS) - 3) + [paper]) + " |"
    seeds = ",".join(map(str, sorted(st.by_seed))) + ("" if st.complete else f" of {len(st.expected)}")
    cells = [label, seeds] + [mean_std(st, m) for m in ("local_acc", "local_proto_acc", "global_acc",
                                                        "global_proto_acc", "ensemble_acc")]
    cells += [mean_std(st, "off_mask_energy", 1.0, 3), f"{st.mean('up_per'):,.0f}", f"{st.mean('up_total') / 1e6:.3f}",
              f"{st.mean('wall_s'):.0f}", paper]
    return "| " + " | ".join(cells) + " |"


# -- the rule ------------------------------------------------------------------------------------------
def beats(x: RowStats, y: RowStats, metric: str, margin: float = 0.0) -> bool:
    """X beats Y by more than `margin`: ahead on the mean AND in every (paired) seed."""
    xv, yv = x.values(metric), y.values(metric)
    seeds = sorted(set(xv) & set(yv))
    if not seeds:
        return False
    mean_gap = statistics.fmean(xv[s] - yv[s] for s in seeds)
    return mean_gap > margin and all(xv[s] - yv[s] > margin for s in seeds)


def effect(x: RowStats, y: RowStats, metric: str, xname: str, yname: str) -> str:
    """The effect (difference of means) beside the seed spread of both rows, in points."""
    mx, my = x.mean(metric), y.mean(metric)
    if mx is None or my is None:
        return f"{xname} vs {yname}: -"
    xv, yv = x.values(metric), y.values(metric)
    paired = sorted(set(xv) & set(yv))
    ahead = sum(xv[s] > yv[s] for s in paired)
    sx, sy = x.std(metric), y.std(metric)
    spread = "/".join("-" if s is None else f"{100 * s:.2f}" for s in (sx, sy))
    per_seed = " / ".join(f"{100 * (xv[s] - yv[s]):+.2f}" for s in paired)
    return (f"{xname} {mean_std(x, metric)} vs {yname} {mean_std(y, metric)}: effect {100 * (mx - my):+.2f} points "
            f"against a seed std of {spread} points; {xname} ahead in {ahead} of {len(paired)} seeds "
            f"(seed by seed: {per_seed})")


# -- goals -----------------------------------------------------------------------------------------------
@dataclass
class Goal:
    name: str
    status: str  # MET, MISSED, NOT RUN
    evidence: list[str]


def _rows(ctx: Context, *keys: str) -> tuple[dict[str, RowStats], list[str]]:
    got = {k: row_stats(ctx, k) for k in keys}
    missing = [k for k, st in got.items() if not st.complete]
    return got, missing


def _not_run(name: str, missing: list[str], got: dict[str, RowStats]) -> Goal:
    parts = [f"`{k}` ({len(got[k].by_seed)} of {len(got[k].expected)} seeds)" for k in missing]
    return Goal(name, "NOT RUN", ["waiting for: " + ", ".join(parts)])


def goal_tinyproto(ctx: Context) -> Goal:
    name = ("tinyproto within 1 point of fedproto's local accuracy at >= 8x fewer uplink bytes (setting B): "
            "missed only if fedproto beats tinyproto by more than 1 point under the rule")
    got, missing = _rows(ctx, "B/fedproto", "B/tinyproto")
    if missing:
        return _not_run(name, missing, got)
    fp, tp = got["B/fedproto"], got["B/tinyproto"]
    worse = beats(fp, tp, "local_acc", margin=0.01)
    ratio = fp.mean("up_total") / max(tp.mean("up_total"), 1)
    ev = [effect(tp, fp, "local_acc", "tinyproto (preset, mu=auto)", "fedproto") + " (local accuracy)",
          f"uplink per run: fedproto {fp.mean('up_total'):,.0f} B, tinyproto {tp.mean('up_total'):,.0f} B -> "
          f"{ratio:.2f}x fewer ({'>=' if ratio >= 8 else '<'} 8x)",
          f"nearest-prototype local accuracy (TinyProto's metric): {effect(tp, fp, 'local_proto_acc', 'tinyproto', 'fedproto')}"]
    return Goal(name, "MET" if not worse and ratio >= 8 else "MISSED", ev)


def goal_refprotofl(ctx: Context) -> Goal:
    name = ("refprotofl global accuracy >= fedproto's at alpha 0.5 (setting A): missed only if fedproto beats "
            "refprotofl under the rule")
    got, missing = _rows(ctx, "A/a0.5-fedproto", "A/a0.5-refprotofl")
    if missing:
        return _not_run(name, missing, got)
    fp, rp = got["A/a0.5-fedproto"], got["A/a0.5-refprotofl"]
    lost = beats(fp, rp, "global_acc")
    won = beats(rp, fp, "global_acc")
    ev = [effect(rp, fp, "global_acc", "refprotofl", "fedproto") + " (global accuracy, full test set)",
          "verdict: " + ("refprotofl ahead" if won else "fedproto ahead" if lost else "a tie")]
    return Goal(name, "MISSED" if lost else "MET", ev)


def goal_fedpagr(ctx: Context) -> Goal:
    name = ("fedpagr ensemble accuracy beats fedproto's in setting C, and fedpagr beats each of its ablations "
            "(all under the rule)")
    keys = ("C/fedproto", "C/fedpagr", "C/fedpagr-no-sep", "C/fedpagr-no-ent")
    got, missing = _rows(ctx, *keys)
    if missing:
        return _not_run(name, missing, got)
    fp, pg, ns, ne = (got[k] for k in keys)
    a, b, c = beats(pg, fp, "ensemble_acc"), beats(pg, ns, "ensemble_acc"), beats(pg, ne, "ensemble_acc")
    ev = [effect(pg, fp, "ensemble_acc", "fedpagr", "fedproto") + f" -> {'beats' if a else 'does NOT beat'}",
          effect(pg, ns, "ensemble_acc", "fedpagr", "w/o separation") + f" -> {'beats' if b else 'does NOT beat'}; "
          "paper (CIFAR-10): separation is worth 2.7 points",
          effect(pg, ne, "ensemble_acc", "fedpagr", "w/o entropy") + f" -> {'beats' if c else 'does NOT beat'}; "
          "paper (CIFAR-10): entropy is worth 3.3 points",
          "local accuracy (information): " + effect(pg, fp, "local_acc", "fedpagr", "fedproto")]
    return Goal(name, "MET" if a and b and c else "MISSED", ev)


D_COMPARE = {
    # where -> (the candidate rows' tag, {single-paper preset: row}, metric, metric label)
    "A": ("a", {"refprotofl": "A/a0.5-refprotofl", "tinyproto": "A/a0.5-tinyproto", "fedpagr": "A/a0.5-fedpagr"},
          "global_acc", "global accuracy (RefProtoFL's metric)"),
    "B": ("b", {"refprotofl": "B/refprotofl", "tinyproto": "B/tinyproto", "fedpagr": "B/fedpagr"},
          "local_acc", "local accuracy (TinyProto's metric)"),
}


def goal_protofl(ctx: Context) -> Goal:
    name = ("the protofl preset is at least as accurate as every single-paper preset (no preset beats it under "
            "the rule) in A (alpha 0.5) and B, at no more than 2x tinyproto's uplink bytes")
    suffix = preset_variant()
    if suffix is None:
        return Goal(name, "NOT RUN", ["`--preset protofl` equals none of setting D's candidate rows"])
    keys = [k for tag, others, _, _ in D_COMPARE.values() for k in (candidate_row(tag, suffix), *others.values())]
    got, missing = _rows(ctx, *keys)
    if missing:
        return _not_run(name, missing, got)
    ev, all_ok = [], True
    for where, (tag, others, metric, mlabel) in D_COMPARE.items():
        pf = got[candidate_row(tag, suffix)]
        beaten_by = [n for n, k in others.items() if beats(got[k], pf, metric)]
        tp_bytes = got[others["tinyproto"]].mean("up_total")
        ratio = pf.mean("up_total") / max(tp_bytes, 1)
        ok = not beaten_by and ratio <= 2.0
        all_ok &= ok
        ev.append(f"{where}, {mlabel}: " + "; ".join(effect(pf, got[k], metric, "protofl", n) for n, k in others.items()))
        ev.append(f"{where}: beaten by {', '.join(beaten_by) if beaten_by else 'no single-paper preset'}; uplink "
                  f"protofl {pf.mean('up_total'):,.0f} B = {ratio:.2f}x tinyproto's ({'<=' if ratio <= 2 else '>'} 2x)")
    if not all_ok:
        ev += closest_candidate(ctx)
        ev += shortfall_parts(ctx, suffix)
    return Goal(name, "MET" if all_ok else "MISSED", ev)


# fedpagr and candidate (b) differ in two switches: the CPS masks and refinement. The row between them
# (fedpagr w/o refinement = (b) without the masks) says which of the two the B gap comes from.
SHORTFALL_SPLIT = ("spherical", "B/fedpagr-no-refine", "B/fedpagr")


def shortfall_parts(ctx: Context, suffix: str) -> list[str]:
    """Why the preset falls short of fedpagr in B: the gap split into the masks' part and refinement's."""
    candidate, between, fedpagr = SHORTFALL_SPLIT
    if suffix != candidate:
        return []
    pf_key = candidate_row("b", suffix)
    got, missing = _rows(ctx, pf_key, between, fedpagr)
    if missing:
        return [f"why (B): waiting for `{between}`, the row between the preset and fedpagr"]
    pf, mid, pg = got[pf_key], got[between], got[fedpagr]
    masks_cost = beats(mid, pf, "local_acc")
    refine_gain = beats(pg, mid, "local_acc")
    parts = [name for name, hit in (("the CPS masks", masks_cost), ("refinement", refine_gain)) if hit]
    verdict = (f"the gap comes from {' and '.join(parts)} (ahead on the mean and in every seed)" if parts
               else "neither step alone is ahead under the rule: the gap builds up over both")
    return [f"why (B, local accuracy): fedpagr = the preset + full 512-d prototypes (no masks) + refinement. "
            f"Masks: {effect(mid, pf, 'local_acc', 'w/o masks', 'preset')}. "
            f"Refinement: {effect(pg, mid, 'local_acc', 'fedpagr', 'w/o refinement')}. Verdict: {verdict}"]


def closest_candidate(ctx: Context) -> list[str]:
    """For a missed goal 4: each candidate's shortfall (the largest mean gap to a single-paper preset that
    beats it under the rule) and bytes against tinyproto's, and which came closest within the 2x budget."""
    rows: list[tuple[float, float, str, str]] = []  # (shortfall in points, worst bytes ratio, label, detail)
    for suffix, label, _ in CANDIDATES:
        got, missing = _rows(ctx, *(k for tag, others, _, _ in D_COMPARE.values()
                                    for k in (candidate_row(tag, suffix), *others.values())))
        if missing:
            continue
        short, ratio, detail = 0.0, 0.0, []
        for where, (tag, others, metric, _) in D_COMPARE.items():
            pf = got[candidate_row(tag, suffix)]
            ratio = max(ratio, pf.mean("up_total") / max(got[others["tinyproto"]].mean("up_total"), 1))
            for n, k in others.items():
                if beats(got[k], pf, metric):
                    gap = 100 * (got[k].mean(metric) - pf.mean(metric))
                    short = max(short, gap)
                    detail.append(f"{n} by {gap:.2f} in {where} (sends {got[k].mean('up_per'):,.0f} B/client/round "
                                  f"vs {pf.mean('up_per'):,.0f})")
        rows.append((short, ratio, label, "; ".join(detail) or "beaten by none"))
    if not rows:
        return []
    out = ["candidates (shortfall: the largest mean gap to a preset that beats it; bytes: the larger of A's and "
           "B's ratio to tinyproto's): " + "; ".join(f"{lab}: {sh:.2f} points, {r:.2f}x ({d})"
                                                    for sh, r, lab, d in sorted(rows))]
    within = [r for r in rows if r[1] <= 2.0]
    if within:
        sh, r, lab, _ = min(within)
        out.append(f"closest within the 2x byte budget: {lab}, short by {sh:.2f} points at {r:.2f}x tinyproto's bytes")
    return out


def goals(ctx: Context) -> list[Goal]:
    return [goal_tinyproto(ctx), goal_refprotofl(ctx), goal_fedpagr(ctx), goal_protofl(ctx)]


# -- ours beside the papers' Fashion-MNIST figures ------------------------------------------------------------
PAPER_METRICS = (("local", "local_acc", "local"), ("global_", "global_acc", "global"), ("ensemble", "ensemble_acc", "ens."))
_LEADING_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def paper_lines(ctx: Context) -> list[str]:
    """Every Fashion-MNIST figure a paper reports beside ours in the same metric, the difference, and why.
    For RefProtoFL each prototype method's gap is set against FedAvg's (one global model in both metrics) and
    against its own ensemble accuracy's gap (one federation-level predictor)."""
    out = ["Ours: mean ± std over the seeds at our CPU sizing; the paper's: in its own setting (references under "
           "the setting's table). TinyProto's figures are CIFAR-10 (only its byte ratio carries over: goal 1) and "
           "FedPAGR's ablation is CIFAR-10 points; both stay in their sections.", "",
           "| method | federation | metric | paper | ours | ours - paper (points) |", "|---|---|---|--:|--:|--:|"]
    gaps: dict[str, dict[str, tuple[float, float | None]]] = {}  # ref -> preset -> (global - paper, ensemble - paper)
    for row in ROWS:
        if row.paper is None or row.paper.ref not in PAPER_GAP_NOTES:
            continue
        st, fed = row_stats(ctx, row.key), FEDERATIONS[row.fed]
        for attr, metric, name in PAPER_METRICS:
            match = _LEADING_NUMBER.match(getattr(row.paper, attr) or "")
            if match is None:
                continue
            paper, ours = float(match.group()), st.mean(metric)
            done = st.complete and ours is not None
            out.append(f"| {row.label} | {row.setting}: {fed.clients} clients, alpha {fed.alpha:g} | {name} | "
                       f"{paper:.2f} [{row.paper.ref}] | {mean_std(st, metric) if done else 'not run yet'} | "
                       f"{f'{100 * ours - paper:+.2f}' if done else '-'} |")
            if done and attr == "global_":
                ens = st.mean("ensemble_acc")
                gaps.setdefault(row.paper.ref, {})[row.preset] = (100 * ours - paper,
                                                                  None if ens is None else 100 * ens - paper)
    out.append("")
    for ref, note in PAPER_GAP_NOTES.items():
        out.append(f"- [{ref}] {note}")
        by_preset = gaps.get(ref, {})
        if "fedavg" in by_preset and len(by_preset) > 1:
            fedavg = by_preset["fedavg"][0]
            parts = [f"{p} global {g:+.2f} ({g - fedavg:+.2f} beyond FedAvg's)"
                     + (f", ensemble {e:+.2f}" if e is not None else "")
                     for p, (g, e) in by_preset.items() if p != "fedavg"]
            out.append(f"  Measured, ours - paper in points: FedAvg's global model {fedavg:+.2f}; " + "; ".join(parts) + ".")
    return out


# -- the combined preset's default, from setting D ----------------------------------------------------------
DECISION_RULE = ("Written before the runs: a candidate's score per seed is the mean of its final global accuracy "
                 "in A and its final local accuracy in B (the metrics goal 4 is judged on). The best candidate is the "
                 "one with the highest mean score; every candidate that the best does not beat under the rule (ahead "
                 "on the mean AND in every seed) is within noise of it, and among those the one with the fewest "
                 "uplink bytes (A + B, mean over seeds) is the default.")


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
    by_seed = {s: {"score": (a.by_seed[s]["global_acc"] + b.by_seed[s]["local_acc"]) / 2,
                   "up_total": a.by_seed[s]["up_total"] + b.by_seed[s]["up_total"]} for s in seeds}
    return RowStats(a.row, by_seed, a.expected)


def decide_default(ctx: Context) -> Decision:
    keys = {suffix: (candidate_row("a", suffix), candidate_row("b", suffix)) for suffix, _, _ in CANDIDATES}
    got, missing = _rows(ctx, *(k for pair in keys.values() for k in pair))
    if missing:
        return Decision("NOT RUN", ["waiting for: " + ", ".join(f"`{m}`" for m in missing)])
    scored = {suffix: _score(got[a], got[b]) for suffix, (a, b) in keys.items()}
    best = max(scored, key=lambda s: scored[s].mean("score") or 0.0)
    tied = [s for s in scored if s == best or not beats(scored[best], scored[s], "score")]
    chosen = min(tied, key=lambda s: scored[s].mean("up_total") or 0.0)
    choice = dict(next(sw for s, _, sw in CANDIDATES if s == chosen))
    current = preset_stages()
    lines = [DECISION_RULE, "", "| candidate | A global | B local | score | uplink A + B (MB) | |",
             "|---|--:|--:|--:|--:|---|"]
    for suffix, label, _ in CANDIDATES:
        a, b = (got[k] for k in keys[suffix])
        sc = scored[suffix]
        mark = ("**chosen**" if suffix == chosen else "best score" if suffix == best else
                "within noise, more bytes" if suffix in tied else f"beaten by {best}")
        lines.append(f"| {label} | {mean_std(a, 'global_acc')} | {mean_std(b, 'local_acc')} | {mean_std(sc, 'score')} | "
                     f"{sc.mean('up_total') / 1e6:.3f} | {mark} |")
    switches = ", ".join(f"{k}={json.dumps(v)}" for k, v in choice.items())
    now = ", ".join(f"{k}={json.dumps(v)}" for k, v in current.items())
    lines += ["", f"Chosen: **{chosen}** ({switches}).", f"`--preset protofl` at this revision: {now} -> "
              + ("matches the rule's choice." if current == choice else
                 "does NOT match the rule's choice: set PRESETS['protofl'] in protofl/presets.py to it.")]
    return Decision("CHOSEN", lines, choice, current == choice)


# -- combinations refused since they were measured -------------------------------------------------------------
def refused_lines(ctx: Context) -> list[str]:
    """Runs kept in D/refused/ (made before the config refused their switches) against the candidate they
    turned out to equal, seed by seed: the measurement behind the refusal."""
    out = ["Scaling with ERPA when the public set covers every class: every anchor is a public-set mean, no "
           "client sends an n-weighted prototype, so scaling acts on nothing. These runs were made before the "
           "config refused the combination (`protofl/config.py`); each is compared with its scaling-free twin, "
           "seed by seed (A: global accuracy, B: local accuracy).", "",
           "| refused combination | on | seeds | its accuracy, per seed | twin | twin's, per seed | max abs diff (points) |",
           "|---|---|--:|---|---|---|--:|"]
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
            out.append(f"| {label} | {'A' if tag == 'a' else 'B'} | {','.join(map(str, sorted(mine)))} | "
                       f"{' / '.join(pct(mine[s]) for s in sorted(mine))} | {twin.row.label} (`{twin_key}`) | "
                       f"{' / '.join(pct(theirs.get(s)) for s in sorted(mine))} | "
                       f"{'-' if diff is None else f'{100 * diff:.2f}'} |")
    return out


# -- lambda sweep --------------------------------------------------------------------------------------------
def sweep_lines(ctx: Context) -> list[str]:
    """Per alignment term: each lambda's global accuracy on seed 0 (the choice) and on seeds 1-2 (confirmation)."""
    out = ["Chosen on seed 0 of A (alpha 0.5, global accuracy); confirmed when the chosen lambda is not beaten "
           "(under the rule) by lambda = 1 on seeds 1 and 2.", "",
           "| term | lambda | global, seed 0 | global, seeds 1, 2 | mean ± std | local, mean | |", "|---|--:|--:|--:|--:|--:|---|"]
    for what, (preset, default_key) in SWEEP.items():
        rows = {1.0: row_stats(ctx, default_key)}
        rows.update({lam: row_stats(ctx, f"L/{what}-lambda{lam:g}") for lam in LAMBDAS[what]})
        seed0 = {lam: st.by_seed.get(SEEDS[0], {}).get("global_acc") for lam, st in rows.items()}
        chosen = max((lam for lam in seed0 if seed0[lam] is not None), key=lambda lam: seed0[lam], default=None)
        if not all(st.expected for st in rows.values()):
            continue
        for lam in sorted(rows):
            st = rows[lam]
            later = " / ".join(pct(st.by_seed.get(s, {}).get("global_acc")) for s in SEEDS[1:])
            mark = ""
            if lam == chosen and all(v is not None for v in seed0.values()):
                confirmed = (rows[lam].complete and rows[1.0].complete
                             and not beats(rows[1.0], rows[lam], "global_acc"))
                mark = "**chosen on seed 0**" + (", confirmed" if confirmed else
                                                 ", not yet confirmed" if not rows[lam].complete else ", NOT confirmed")
                if confirmed and lam != 1.0:
                    # only a lambda that beats the default under the rule is a reason to move the default
                    mark += ("; beats lambda = 1 (mean and every seed)" if beats(rows[lam], rows[1.0], "global_acc")
                             else "; ties lambda = 1 (the default stays)")
                if lam in (min(rows), max(rows)):
                    mark += "; at the grid's edge: the best may lie beyond it"
            out.append(f"| {what.upper()} ({preset}) | {lam:g} | {pct(seed0[lam])} | {later} | "
                       f"{mean_std(st, 'global_acc')} | {mean_std(st, 'local_acc')} | {mark} |")
    return out


# -- plots ---------------------------------------------------------------------------------------------------
_PLOT_NOTE_SHOWN = False


def _curves(ctx: Context, key: str) -> tuple[list[float], list[float], list[float], list[float]] | None:
    """Mean cumulative uplink and mean / min / max local accuracy per round over the row's seeds."""
    reps = [ctx.cached(r) for r in ctx.runs if r.row.key == key]
    reps = [r for r in reps if r is not None and r["rounds"]]
    if not reps:
        return None
    n = min(len(r["rounds"]) for r in reps)
    xs, mean, lo, hi = [], [], [], []
    for i in range(n):
        accs = [r["rounds"][i]["local_acc"] for r in reps if r["rounds"][i].get("local_acc") is not None]
        if len(accs) != len(reps):
            continue
        xs.append(max(statistics.fmean(sum(x["uplink_bytes"] for x in r["rounds"][:i + 1]) for r in reps), 1))
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
    colors = [plt.get_cmap("tab20")(i) for i in range(20)] if len(section.rows) > 10 else \
        plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    markers = "osD^v<>ph*X"
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.6))
    drawn = False
    for i, key in enumerate(section.rows):
        st = row_stats(ctx, key)
        if not st.by_seed:
            continue
        drawn = True
        row = st.row
        label = row.label + (f" (from {row.setting})" if row.setting != section.setting else "") + \
            f" [{len(st.by_seed)} seed{'s' if len(st.by_seed) != 1 else ''}]"
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
                ax.errorbar([st.mean("up_total")], [m], yerr=[[m - 100 * min(vals)], [100 * max(vals) - m]],
                            marker=marker, color=color, capsize=3, label=label)
    if not drawn:
        plt.close(fig)
        return False
    for ax, title in zip(axes, ("local accuracy per round (mean, band: min-max over seeds)",
                                "final global accuracy (mean, bars: min-max)",
                                "final ensemble accuracy (mean, bars: min-max)")):
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
        for h, lab in zip(*ax.get_legend_handles_labels()):
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
    return (f"{os.cpu_count()} CPUs, {platform.platform()}, {platform.machine()}, Python "
            f"{platform.python_version()}, torch {torch_v}; load average at writing {load}")


def _header(ctx: Context, done: list[tuple[Run, dict[str, Any]]]) -> list[str]:
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    g = ctx.git
    dirty = (f"dirty ({g['modified_tracked']} modified tracked file(s), {g['untracked']} untracked)"
             if g["dirty"] else "clean")
    revs = sorted({f"{rep['bench']['git_rev']}{' (dirty)' if rep['bench'].get('git_dirty') else ''}"
                   for _, rep in done})
    finished = sorted(rep["bench"]["finished_utc"] for _, rep in done)
    out = [f"# Paper benchmark on Fashion-MNIST ({ctx.suite} suite)", ""]
    if ctx.sizing_key != ctx.suite:
        out += [f"**Sizing `{ctx.sizing_key}` (test only): the numbers mean nothing.**", ""]
    return out + [
        f"- command: `{ctx.command}` (from the repository root; resumable: rerun it to finish missing runs)",
        f"- written: {now}; runs finished between {finished[0] + ' and ' + finished[-1] + ' UTC' if finished else '-'}",
        f"- machine: {machine()}",
        f"- git revision: {g['rev']}, tree {dirty}; runs made at: {', '.join(revs) or '-'}",
        f"- runs: {len(done)} of {len(ctx.runs)} finished, {sum(rep['bench']['cli_wall_s'] for _, rep in done):,.0f} s "
        f"of wall time in all (sum of the CLI calls); cache: `{os.path.relpath(ctx.run_root, ctx.table_path.parent)}`",
        "",
        "Every run is `protofl-server simulate` on Fashion-MNIST, called as a subprocess; the exact commands are "
        "listed under each table. Within a section every method has the same data, partitions, model(s), seeds "
        "and rounds.",
        "",
        "Columns: every accuracy is the final round's, **mean ± std over the seeds listed** (sample std). *local* = "
        "each client on its own 25 % held-out split, sample-weighted; *global* = each client on the test set, "
        "mean over clients (FedAvg: the global model); *ens.* = the clients' averaged class probabilities on the "
        "test set (FedAvg has none); *proto* = the same by the nearest global prototype (L2; FedPAGR: cosine to "
        "P), the metric of FedProto and TinyProto; *off-mask energy* = the fraction of ||z||^2 outside each "
        "sample's CPS mask on the local split (CPS rows; 0 would be fully structured-sparse). Bytes are counted "
        "from the real encoded messages: *B/client/rnd* = total over the run / (clients x rounds); evaluation "
        "traffic is not uplink. *wall s* = mean simulation wall time on a CPU shared with other jobs. *paper* = "
        "the figure from ALGORITHMS.md's reference list, in the paper's own setting (model, data, rounds differ).",
        "",
    ]


def _sizing(ctx: Context, done: list[tuple[Run, dict[str, Any]]]) -> list[str]:
    sz = SIZING[ctx.sizing_key]
    out = ["## Sizing", "", "| federation | clients, alpha, archs | rounds | --train-limit | --test-limit | "
           "--eval-every | --test-every |", "|---|---|---|---|---|---|---|"]
    used = {r.fed for r in ctx.runs}
    for k, f in FEDERATIONS.items():
        if k in used:
            s = sz[k]
            desc = f.describe + (f" (here {s.clients} clients)" if s.clients is not None else "")
            out.append(f"| {k} | {desc} | {s.rounds} | {s.train_limit} | {s.test_limit or 'all 10,000'} | "
                       f"{s.eval_every} | {s.test_every} |")
    out += ["", SIZING_NOTE if ctx.sizing_key == "full" else
            f"`{ctx.sizing_key}` sizing: a smoke run (few rounds, small subsets, seed 0 only); only the runs the "
            "goals need. The `full` suite's sizing is explained in bench/results/TABLE.md.", ""]
    out += ["### Measured wall time", "", "| setting | runs finished | sum of CLI wall times (s) |", "|---|--:|--:|"]
    for setting in ("A", "B", "C", "D", "L"):
        mine = [rep for r, rep in done if r.setting == setting]
        total = sum(1 for r in ctx.runs if r.setting == setting)
        if total:
            out.append(f"| {setting} | {len(mine)} of {total} | {sum(rep['bench']['cli_wall_s'] for rep in mine):,.0f} |")
    return out + [""]


def _section(ctx: Context, sec: Section, plot_dir: Path) -> list[str]:
    f, s = FEDERATIONS[sec.fed], SIZING[ctx.sizing_key][sec.fed]
    out = [f"### {sec.title}", "",
           f"{f.describe}{f' (here {s.clients} clients)' if s.clients is not None else ''}; {s.rounds} rounds, "
           f"--train-limit {s.train_limit}, test set: {s.test_limit or 'all 10,000'} images.", ""]
    out += [f"- {n}" for n in sec.notes] + [""]
    out += ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] + ["--:"] * (len(COLUMNS) - 2) + ["---"]) + "|"]
    refs: list[str] = []
    cmds: list[str] = []
    for key in sec.rows:
        line = _row_line(ctx, key, sec)
        if line is None:
            continue
        out.append(line)
        row = ROW_BY_KEY[key]
        if row.paper and row.paper.ref not in refs:
            refs.append(row.paper.ref)
        if row.setting == sec.setting:
            for run in (r for r in ctx.runs if r.row.key == key):
                rep = ctx.cached(run)
                cmds.append(f"{run.label}: {rep['bench']['command']}" if rep is not None else
                            f"{run.label} (not run yet): protofl-server {shlex.join(run_args(run, ctx.sizing_key))}")
    out.append("")
    out += [f"[{r}] {PAPER_REFS[r]}  " for r in refs]
    png = plot_dir / f"{sec.key}.png"
    if plot_section(ctx, sec, png):
        out += ["", f"![{sec.title}]({os.path.relpath(png, ctx.table_path.parent)})"]
    return out + ["", "<details><summary>commands</summary>", "", "```"] + cmds + ["```", "", "</details>", ""]


def write(ctx: Context, quiet: bool = False) -> Path:
    done = [(r, rep) for r in ctx.runs if (rep := ctx.cached(r)) is not None]
    out = _header(ctx, done) + _sizing(ctx, done)
    out += ["## Goals", "", RULE + (" Quick/tiny suites: one seed, too few rounds to be evidence."
                                    if ctx.suite != "full" or ctx.sizing_key != "full" else ""), ""]
    for i, goal in enumerate(goals(ctx), 1):
        out.append(f"{i}. **{goal.status}**: {goal.name}")
        out += [f"   - {e}" for e in goal.evidence]
    out.append("")
    decision = decide_default(ctx)
    out += ["## Default of the `protofl` preset (decided by setting D)", "",
            "ALGORITHMS.md: which combination of stages is the default \"is decided by the ablation benchmark, not "
            "by taste\". Candidates: the rows of setting D, and (a) w/o CPS, whose switches are the refprotofl preset's "
            "(its rows are refprotofl's: same federation, sizing and seeds).", ""]
    out += decision.lines if decision.status == "CHOSEN" else [DECISION_RULE, "", f"**NOT RUN**: {decision.lines[0]}"]
    out += ["", "### Refused since measured: scaling with ERPA on a full public set", ""] + refused_lines(ctx)
    out += ["", "## Lambda sweep (alignment term on the MSE scale)", ""] + sweep_lines(ctx) + [""]
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

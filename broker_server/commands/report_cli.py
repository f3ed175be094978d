"""`protofl-server report RUN.json [MORE.json ...] --out DIR`: plots and a markdown summary of runs.

Written from the run JSON alone (simulate --json, or --report-dir at the end of a run), or from a real
federation's `STATE_DIR/rounds.jsonl` (one line a round, with its accuracies once its metrics came in):
- `accuracy_time.png`: accuracy vs simulated time (runs over shaped links), vs the wall clock (a
  rounds.jsonl), else vs round (whole-number ticks),
- `accuracy_uplink.png`: accuracy vs cumulative uplink bytes, every run on one figure; with the default metric it
  leads with the deployable model: the global predictor where a run scored one (FedAvg's: its global model),
- `timeline_<preset>.png`: per round and device class, the mean downlink, compute, upload and wait
  (until the round closed) in simulated seconds; an x where a device of the class missed the round,
- `bytes_class.png`: uplink bytes per device and round, by device class and preset,
- `summary.md`: per preset the final accuracy, time, uplink, missed deadlines and the time (or round) to
  a target accuracy; per device class the round's parts and the encodings chosen; a warning where this
  machine fell behind the time scale by more than a whole round.
Accuracy is `global_acc` (each client on the official test set; FedAvg: the global model; where a
run has none, `local_acc`), or with `--metric local` `local_acc` (each client on its own held-out
split, so on its own classes only), or with `--metric predictor` `predictor_acc` (the global predictor: a
simulation's test set, or a server's `--validation` data). The plots and the summary name which one
each run shows, local as "local (own classes)", and the summary has a legend: a real federation's
rounds.jsonl has local figures only (and, with `start --validation`, the predictor's), which are not the
federation's accuracy on every class. matplotlib comes with the `plotting` extra. No torch.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from protofl import learning, privacy
from protofl.errors import ConfigError
from protofl.humanize import accuracy_label, accuracy_legend, human_bytes, human_duration

PARTS = ("downlink_s", "compute_s", "upload_s", "wait_s")
COLOURS = {"downlink_s": "#4c72b0", "compute_s": "#55a868", "upload_s": "#c44e52", "wait_s": "#cccccc"}


def load_runs(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """Runs from simulate's JSON reports, or from a real federation's `STATE_DIR/rounds.jsonl`."""
    runs = []
    for p in paths:
        if not p.is_file():
            raise ConfigError(
                f"run file '{p}' not found (write one with protofl-server simulate --json RUN.json, "
                f"or give a server's STATE_DIR/rounds.jsonl)"
            )
        text = p.read_text()
        try:
            run = json.loads(text)
        except json.JSONDecodeError as exc:
            if p.suffix != ".jsonl" and "Extra data" not in str(exc):
                raise ConfigError(f"run file '{p}' is not JSON: {exc}") from exc
            run = rounds_log(text, p)
        if not isinstance(run, dict) or "rounds" not in run or "preset" not in run:
            raise ConfigError(f"'{p}' is not a simulate report (no 'preset' and 'rounds') nor a rounds.jsonl")
        runs.append(run)
    return runs


def rounds_log(text: str, path: Path) -> dict[str, Any]:
    """A server's rounds.jsonl (one JSON object a round) as a run: accuracies where its metrics came in,
    bytes, and the time since round 1 opened (`clock`: "wall")."""
    rows: list[dict[str, Any]] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.append(row)
            int(row["round"]), float(row["started"]), float(row["ended"])
        except (ValueError, KeyError, TypeError) as exc:
            if n == len(text.splitlines()):
                break  # a torn last line: the server died while writing it
            raise ConfigError(f"{path}, line {n}: not a rounds.jsonl line ({exc})") from None
    if not rows:
        raise ConfigError(f"{path}: no rounds yet")
    t0 = float(rows[0]["started"])
    rounds = [
        {
            "round": r["round"],
            **{
                k: r.get(k) for k in ("local_acc", "global_acc", "local_proto_acc", "global_proto_acc", "predictor_acc")
            },
            "ensemble_acc": None,
            "uplink_bytes": r["uplink_bytes"],
            "downlink_bytes": r["downlink_bytes"],
            "clients": len(r.get("clients", [])),
            "closed_by": r.get("closed_by", ""),
            "time_s": float(r["ended"]) - t0,
        }
        for r in rows
    ]
    return {
        "preset": rows[-1].get("preset") or rows[-1].get("fed", path.stem),
        "fed": rows[-1].get("fed"),
        "source": "rounds.jsonl",  # a real federation's rounds, not a simulation (the report's title says which)
        "clock": "wall",
        "rounds": rounds,
        "totals": {
            "uplink_bytes": sum(r["uplink_bytes"] for r in rounds),
            "downlink_bytes": sum(r["downlink_bytes"] for r in rounds),
            "wall_s": rounds[-1]["time_s"],
        },
    }


METRICS = ("global", "local", "predictor")


def accuracy(row: dict[str, Any], metric: str = "global") -> float | None:
    """`global_acc` (falling back to `local_acc` where a run has none), `local_acc`, or `predictor_acc`."""
    if metric == "predictor":
        return row.get("predictor_acc")
    if metric == "global" and row.get("global_acc") is not None:
        return row["global_acc"]
    return row.get("local_acc")


def run_metric(run: dict[str, Any], metric: str = "global") -> str:
    """Which accuracy `run_accuracies` gives for `run`: "global_acc", or "local_acc" (asked for, or a run
    that never scored the test set, such as a real federation's rounds.jsonl)."""
    if metric == "predictor":  # the global predictor (a simulation's test set, or start --validation)
        return "predictor_acc"
    scored = metric == "global" and any(r.get("global_acc") is not None for r in run["rounds"])
    return "global_acc" if scored else "local_acc"


def uplink_metric(run: dict[str, Any], metric: str = "global") -> str:
    """What `accuracy_uplink.png` draws for `run`: with the default metric the deployable model's accuracy, the
    global predictor's (FedAvg's: its global model's) where the run scored one, else `run_metric`'s."""
    if metric == "global" and any(r.get("predictor_acc") is not None for r in run["rounds"]):
        return "predictor_acc"
    return run_metric(run, metric)


def run_accuracies(run: dict[str, Any], metric: str = "global") -> list[float | None]:
    """Each round's accuracy. `global` falls back to `local_acc` only for a run that never scored the test
    set; one that scored it on a cadence (by default the last round only) has None in the rounds between,
    so that a curve or a time to target never mixes local figures into global ones."""
    key = run_metric(run, metric)
    return [r.get(key) for r in run["rounds"]]


def sim_times(run: dict[str, Any]) -> list[float] | None:
    """Time at the end of each round: simulated over shaped links, the wall clock of a real federation's
    rounds.jsonl; None for a simulation without links (its rounds have no time to speak of)."""
    links = run.get("links")
    if links:
        return [r["sim_time_s"] for r in links["rounds"]]
    if run.get("clock") == "wall":
        return [r["time_s"] for r in run["rounds"]]
    return None


def target_round(run: dict[str, Any], target: float, metric: str = "global") -> int | None:
    """The first round whose accuracy reached `target` (None if none did)."""
    for row, acc in zip(run["rounds"], run_accuracies(run, metric), strict=True):
        if acc is not None and acc >= target:
            return int(row["round"])
    return None


def time_to_target(run: dict[str, Any], target: float, metric: str = "global") -> float | None:
    times, reached = sim_times(run), target_round(run, target, metric)
    if times is None or reached is None:
        return None
    i = [r["round"] for r in run["rounds"]].index(reached)
    return times[i] if i < len(times) else None


def reached(run: dict[str, Any], target: float, metric: str = "global") -> str:
    """Time to target for people: a time where the run has a clock, else the round; or "not reached"."""
    when = time_to_target(run, target, metric)
    if when is not None:
        return human_duration(when)
    first = target_round(run, target, metric)
    if first is None:
        return "not reached"
    return f"round {first}" + ("" if sim_times(run) is None else " (after its last timed round)")


def long_overruns(run: dict[str, Any]) -> list[str]:
    """Devices whose upload this machine released later than the emulation asked by more than the whole
    round lasted (simulated): the round's time is then this machine's, not the device's."""
    links = run.get("links") or {}
    round_s = {r["round"]: r["round_s"] for r in links.get("rounds", [])}
    out = []
    for d in links.get("devices", []):
        over, length = d.get("overrun_s"), round_s.get(d["round"])
        if over is not None and length is not None and over > length:
            out.append(
                f"round {d['round']}: {d['client']} ({d['class']}) released its upload {human_duration(over)} "
                f"late, longer than the round itself ({human_duration(length)})"
            )
    return out


def class_rows(run: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The per-device rows of a run by device class, each with its wait until the round closed."""
    links = run.get("links") or {}
    round_s = {r["round"]: r["round_s"] for r in links.get("rounds", [])}
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for d in links.get("devices", []):
        d = dict(d)
        done = d.get("done_s")
        d["wait_s"] = max(0.0, round_s.get(d["round"], 0.0) - done) if done is not None and d["made_it"] else 0.0
        out[d["class"]].append(d)
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _plots(runs: list[dict[str, Any]], out: Path, metric: str) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(
            "protofl-server report draws with matplotlib, which is not installed: pip install 'protofl-edge[plotting]'"
        ) from None
    from matplotlib.ticker import MaxNLocator

    paths = []
    timed = all(sim_times(r) is not None for r in runs)
    clocks = {"wall" if r.get("clock") == "wall" else "simulated" for r in runs}
    time_label = {
        frozenset({"wall"}): "time since round 1 opened (s)",
        frozenset({"simulated"}): "simulated time (s)",
    }.get(frozenset(clocks), "time (s)")
    # The axis names the accuracy where every run shows the same one, else each run's line does.
    for name, xlabel in (
        ("accuracy_time", time_label if timed else "round"),
        ("accuracy_uplink", "cumulative uplink (bytes)"),
    ):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        # accuracy vs uplink leads with the deployable model (the predictor, where a run has one): what the bytes buy
        shown = {id(r): run_metric(r, metric) if name == "accuracy_time" else uplink_metric(r, metric) for r in runs}
        axis = f"{accuracy_label(next(iter(shown.values())), 'accuracy')} (%)" if len(set(shown.values())) == 1 else ""
        for run in runs:
            key = shown[id(run)]
            accs = [r.get(key) for r in run["rounds"]]
            if name == "accuracy_time":
                times = sim_times(run)
                xs: list[float] = times if timed and times is not None else [r["round"] for r in run["rounds"]]
            else:
                xs, total = [], 0
                for r in run["rounds"]:
                    total += r["uplink_bytes"]
                    xs.append(total)
            # not strict: a run's link rounds may end before its accuracy rows (see time_to_target)
            pts = [(x, 100 * a) for x, a in zip(xs, accs, strict=False) if a is not None]
            label = run["preset"] if axis else f"{run['preset']}: {accuracy_label(key)}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ends = [t[-1] for t in map(sim_times, runs) if t] if timed else []
        if name == "accuracy_uplink" or (ends and min(ends) > 0 and max(ends) / min(ends) > 30):
            ax.set_xscale("log")  # FedAvg over NB-IoT and a prototype preset differ by orders of magnitude
        if xlabel == "round":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole: no tick at 1.25
        ax.set_xlabel(xlabel)
        ax.set_ylabel(axis or "accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        paths.append(out / f"{name}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    for run in runs:
        by_class = class_rows(run)
        if not by_class:
            continue
        fig, axes = plt.subplots(len(by_class), 1, figsize=(7.0, 1.9 * len(by_class) + 0.8), squeeze=False, sharex=True)
        for ax, (cls, rows) in zip(axes[:, 0], sorted(by_class.items()), strict=True):
            rounds = sorted({r["round"] for r in rows})
            bottom = [0.0] * len(rounds)
            for part in PARTS:
                vals = [_mean([r[part] or 0.0 for r in rows if r["round"] == n]) for n in rounds]
                ax.bar(rounds, vals, bottom=bottom, color=COLOURS[part], label=part[:-2])
                bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
            missed = [n for n in rounds if any(not r["made_it"] for r in rows if r["round"] == n)]
            ax.plot(
                missed,
                [bottom[rounds.index(n)] for n in missed],
                "kx",
                markersize=9,
                label="missed" if missed else None,
            )
            ax.set_ylabel(f"{cls}\nsim s")
            ax.grid(axis="y", alpha=0.3)
        axes[0, 0].set_title(
            f"{run['preset']}: mean per device, per round (deadline {human_duration(run['links']['deadline_s'])})"
        )
        axes[0, 0].legend(fontsize=7, ncol=5, loc="upper right")
        axes[-1, 0].set_xlabel("round")
        axes[-1, 0].set_xticks(sorted({r["round"] for rows in by_class.values() for r in rows}))
        fig.tight_layout()
        paths.append(out / f"timeline_{run['preset']}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    classes = sorted({c for run in runs for c in class_rows(run)})
    if classes:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        width = 0.8 / len(runs)
        smallest = float("inf")
        for j, run in enumerate(runs):
            by_class = class_rows(run)
            vals = [_mean([r["uplink_bytes"] for r in by_class.get(c, [])]) for c in classes]
            smallest = min([smallest, *(v for v in vals if v > 0)])
            ax.bar([i + j * width for i in range(len(classes))], vals, width, label=run["preset"])
        if smallest < float("inf"):
            ax.set_ylim(bottom=max(1.0, smallest / 10))  # log bars need a floor well below the smallest
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(classes))], classes, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("uplink bytes per device per round")
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        paths.append(out / "bytes_class.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def report_title(runs: list[dict[str, Any]]) -> str:
    """The report's title, by what it read: simulate's reports, a server's rounds.jsonl, or both."""
    federations = sum(1 for r in runs if r.get("source") == "rounds.jsonl")
    if federations == 0:
        return "Simulation report"
    if federations == len(runs):
        return "Federation report (a server's rounds.jsonl)"
    return (
        f"Report: {len(runs) - federations} simulation{'s' if len(runs) - federations > 1 else ''} and "
        f"{federations} federation{'s' if federations > 1 else ''} (a server's rounds.jsonl)"
    )


def summary(runs: list[dict[str, Any]], target: float | None = None, metric: str = "global") -> str:
    keys = [run_metric(r, metric) for r in runs]
    # the last round's accuracy of the kind each run shows (the last round scores the test set, if any does)
    finals = [r["rounds"][-1].get(k) if r["rounds"] else None for r, k in zip(runs, keys, strict=True)]
    best = max((a for a in finals if a is not None), default=0.0)
    target = 0.9 * best if target is None else target
    fallback = ", or local_acc for a run that never scored the test set" if metric == "global" else ""
    lines = [
        f"# {report_title(runs)}",
        "",
        f"Target accuracy for time-to-target: {100 * target:.1f} % (accuracy = {metric}_acc{fallback}).",
        "",
        f"Accuracy: {accuracy_legend(keys)}.",
        "",
        "| preset | rounds | accuracy | final acc % | time | mean round | uplink | missed deadlines | time to target |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run, key, final in zip(runs, keys, finals, strict=True):
        times = sim_times(run)
        links = run.get("links") or {}
        missed = sum(1 for d in links.get("devices", []) if not d["made_it"])
        lines.append(
            f"| {run['preset']} | {len(run['rounds'])} | {accuracy_label(key)} | "
            f"{'-' if final is None else f'{100 * final:.1f}'} | "
            f"{human_duration(times[-1]) if times else '-'} | "
            f"{human_duration(times[-1] / len(times)) if times else '-'} | "
            f"{human_bytes(run['totals']['uplink_bytes'])} | {missed if links else '-'} | "
            f"{reached(run, target, metric)} |"
        )
    for run in runs:
        dp = run.get("privacy")
        if dp:  # differential privacy: what the run spent, and why it stopped early where it did
            lines += ["", f"**{run['preset']}:** {privacy.describe(dp)}."]
            if dp.get("stopped"):
                lines.append(f"Stopped before its last round: {dp['stopped']}.")
    for run in runs:
        stalled = learning.verdict(run["rounds"])  # protofl/learning.py: the rule the server's log applies
        if stalled:
            lines += ["", f"**Warning ({run['preset']}):** the federation is {stalled}; {learning.ADVICE}."]
    for run in runs:
        by_class = class_rows(run)
        if not by_class:
            continue
        links = run["links"]
        lines += [
            "",
            f"## {run['preset']}: per device class (mean per device per round, simulated seconds)",
            "",
            f"Time scale {links['time_scale']:g}, deadline {human_duration(links['deadline_s'])}, adaptive "
            f"uploads {'on' if links['adaptive'] else 'off'}.",
            "",
            "| class | devices | downlink | compute | upload | done | upload bytes | encodings | budget | "
            "missed | overrun |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for cls, rows in sorted(by_class.items()):

            def m(key: str, rows: list[dict[str, Any]] = rows) -> str:
                vals = [r[key] for r in rows if r.get(key) is not None]
                return f"{_mean(vals):.1f}" if vals else "-"

            enc = Counter(f"{r['dt']}" + (f" K={r['k']}" if r.get("k") else "") for r in rows if r["dt"])
            budgets = [r["budget_bytes"] for r in rows if r.get("budget_bytes") is not None]
            lines.append(
                f"| {cls} | {len({r['client'] for r in rows})} | {m('downlink_s')} | {m('compute_s')} | "
                f"{m('upload_s')} | {m('done_s')} | {human_bytes(_mean([r['uplink_bytes'] for r in rows]))} | "
                f"{', '.join(f'{k} x{v}' for k, v in enc.most_common(3)) or '-'} | "
                f"{human_bytes(_mean(budgets)) if budgets else 'off'} | "
                f"{sum(1 for r in rows if not r['made_it'])}/{len(rows)} | {m('overrun_s')} |"
            )
    for run in runs:
        late = long_overruns(run)
        if late:
            scale = run["links"]["time_scale"]
            lines += [
                "",
                f"**Warning ({run['preset']}):** this machine could not keep up with time scale {scale:g}: "
                f"{len(late)} upload(s) left later than the emulation asked by more than their whole round, "
                f"so those rounds' times are this machine's, not the devices'. Run again with a lower "
                f"--time-scale.",
                "",
                *(f"- {line}" for line in late[:10]),
            ]
            if len(late) > 10:
                lines.append(f"- ... and {len(late) - 10} more")
    lines += [
        "",
        "Time is simulated for a simulation over shaped links (`--profiles`) and the wall clock since "
        "round 1 opened for a server's rounds.jsonl; without either, time to target is the round that reached "
        "it.",
        "",
        "Simulated time composes measured link times (through the shaping proxies, times the time scale) "
        "with emulated compute (CPU time / the device's compute factor); `overrun` is how much later, in "
        "simulated seconds, this machine released an upload than the emulation asked for.",
    ]
    return "\n".join(lines) + "\n"


def write_report(
    runs: dict[str, Any] | list[dict[str, Any]], out: Path, target: float | None = None, metric: str = "global"
) -> list[Path]:
    """The PNGs and summary.md of `runs` in `out`; returns the files written."""
    runs = [runs] if isinstance(runs, dict) else runs
    if target is not None and not 0 < target <= 1:
        raise ConfigError(f"--target is an accuracy in (0, 1], got {target}")
    if metric not in METRICS:
        raise ConfigError(f"--metric must be one of {', '.join(METRICS)}, got '{metric}'")
    out.mkdir(parents=True, exist_ok=True)
    paths = _plots(runs, out, metric)
    md = out / "summary.md"
    md.write_text(summary(runs, target, metric))
    return [*paths, md]

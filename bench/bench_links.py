"""A mixed fleet over emulated links: measured round time beside the analytical link-limited bound.

    python -m bench.bench_links                          # writes bench/results/LINKS.md (+ runs and PNGs)
    python -m bench.bench_links --rounds 2 --presets tinyproto --out /tmp/LINKS.md   # a quick look

The fleet (default `rpi4+lte:4,jetson-orin-nano+wifi:2,rpi3+nb-iot:4`) runs each preset (fedavg,
fedproto, tinyproto, protofl; same seed, data and model) through Mosquitto and one shaping proxy
per device (`simulate --profiles`). Per device and round the report gives the measured downlink,
emulated compute and measured upload in simulated seconds (broker_server.simulation.timeline).

The analytical bound of a device's round is

    round message bytes / downlink rate + upload bytes / uplink rate + RTT + compute_s

(the RTT is the two one-way delays, the round message's and the upload's; compute_s is the same
emulated compute the measurement uses, so the comparison is the links'). Round 1 is left out of the
comparison (joins, the config and the public set cross the links then).

Who takes part (issue 47): `--modes sync,select,async --seeds 0,1,2` runs each preset synchronously (today),
synchronously with the selection that leaves out the devices whose link and compute cannot finish a round by a
short deadline (`select_fit`), and with buffered asynchronous rounds (`buffer_k`), and writes the section "Who
takes part" of LINKS.md (the rest of it is left as it is):

    nice python -m bench.bench_links --modes sync,select,async --seeds 0,1,2 --presets tinyproto,protofl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FLEET = "rpi4+lte:4,jetson-orin-nano+wifi:2,rpi3+nb-iot:4"
PRESETS = ("fedavg", "fedproto", "tinyproto", "protofl")


def bound_rows(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Per device and round (>= 2): measured parts and the analytical bound, in simulated seconds."""
    links = run["links"]
    classes = {c["class"]: c for c in links["classes"]}
    clients = len(links["clients"])
    down = {r["round"]: r["downlink_bytes"] / clients for r in run["rounds"]}  # the round message, per device
    out = []
    for d in links["devices"]:
        if d["round"] < 2 or d["done_s"] is None:
            continue
        c = classes[d["class"]]
        down_s = down[d["round"]] * 8 / 1000 / c["downlink_kbps"]
        up_s = d["uplink_bytes"] * 8 / 1000 / c["uplink_kbps"]
        out.append(
            {
                **d,
                "bound_down_s": down_s,
                "bound_up_s": up_s,
                "bound_s": down_s + up_s + c["rtt_ms"] / 1000 + d["compute_s"],
            }
        )
    return out


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def links_md(
    runs: list[dict[str, Any]], args: argparse.Namespace, load: tuple[str, str], wall: float, when: str
) -> str:
    from broker_server.commands.report_cli import accuracy, time_to_target
    from protofl.humanize import human_bytes

    target = args.target
    lines = [
        "# A mixed fleet over emulated links",
        "",
        f"`python -m bench.bench_links --rounds {args.rounds} --time-scale {args.time_scale:g} "
        f"--proto-time-scale {args.proto_time_scale:g} --target {args.target:g} --metric {args.metric} "
        f"--train-limit {args.train_limit} --test-limit {args.test_limit} --deadline {args.deadline:g}` "
        f"(run {when}; {platform.machine()}, {os.cpu_count()} cores "
        f"shared with other jobs, load average {load[0]} at the start and {load[1]} at the end; {wall / 60:.0f} "
        "min of wall time).",
        "",
        f"Fleet `{args.fleet}`, Fashion-MNIST (alpha {args.alpha}), arch {args.arch}, seed {args.seed}, "
        f"round deadline {args.deadline:g} s (simulated), adaptive uploads "
        f"{'on' if args.adaptive else 'off'}, time scale {args.time_scale:g} for fedavg and "
        f"{args.proto_time_scale:g} for the prototype presets. All times are simulated "
        "seconds: link times measured through the shaping proxies (x time scale), compute emulated as the "
        "device's CPU time / its profile's compute factor (see edge_agent/core/emulation.py).",
        "",
        f"## Per preset (accuracy = {args.metric}_acc; target {100 * target:.0f} %)",
        "",
        "Round / compute: the fleet's round (rounds >= 2) over the emulated compute of its slowest device "
        "in that round (1.0 = communication costs nothing).",
        "",
        "| preset | rounds | final acc % | mean round (s) | round / compute | simulated time (s) | "
        "time to target (s) | uplink | re-sent after reconnects | missed deadlines |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ttt: dict[str, float | None] = {}
    for run in runs:
        lr = run["links"]["rounds"]
        final = accuracy(run["rounds"][-1], args.metric)
        ttt[run["preset"]] = time_to_target(run, target, args.metric)
        slowest = {
            r: max(d["compute_s"] for d in run["links"]["devices"] if d["round"] == r and d["compute_s"])
            for r in {d["round"] for d in run["links"]["devices"]}
        }
        ratio = mean([x["round_s"] / slowest[x["round"]] for x in lr[1:] if x["round"] in slowest])
        t = ttt[run["preset"]]
        missed = sum(1 for d in run["links"]["devices"] if not d["made_it"])
        mean_round = mean([r["round_s"] for r in lr[1:]] or [lr[0]["round_s"]])
        shown = "-" if final is None else f"{100 * final:.1f}"  # a last round without that accuracy
        lines.append(
            f"| {run['preset']} | {len(lr)} | {shown} | {mean_round:.1f} | "
            f"{ratio:.2f} | {lr[-1]['sim_time_s']:.1f} | {'not reached' if t is None else f'{t:.1f}'} | "
            f"{human_bytes(run['totals']['uplink_bytes'])} | "
            f"{human_bytes(sum(d.get('resent_bytes', 0) for d in run['links']['devices']))} | {missed} |"
        )
    base = ttt.get("fedavg")
    ratios = [
        f"{p} {'-' if ttt.get(p) is None or not base else f'{base / ttt[p]:.2f}x'}"  # type: ignore[operator]
        for p in ("tinyproto", "protofl")
        if p in ttt
    ]
    lines += [
        "",
        f"Time to {100 * target:.0f} %, fedavg / preset (> 1: the preset gets there sooner): "
        + (", ".join(ratios) if base else "fedavg did not reach the target")
        + ".",
        "",
        "## Measured round time beside the analytical bound (rounds >= 2, mean per device)",
        "",
        "Bound = round message / downlink rate + upload / uplink rate + RTT + compute. Within 20 % is the issue's bar.",
        "",
        "| preset | class | downlink meas / bound | compute | upload meas / bound | upload bytes | encoding | "
        "round meas (s) | bound (s) | meas / bound |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    worst = 0.0
    for run in runs:
        by_class: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in bound_rows(run):
            by_class[r["class"]].append(r)
        for cls, rows in sorted(by_class.items()):
            meas, bnd = mean([r["done_s"] for r in rows]), mean([r["bound_s"] for r in rows])
            worst = max(worst, abs(meas / bnd - 1))
            encs = sorted({r["dt"] + (f" K={r['k']}" if r["k"] else "") for r in rows if r["dt"]})
            lines.append(
                f"| {run['preset']} | {cls} | {mean([r['downlink_s'] for r in rows]):.1f} / "
                f"{mean([r['bound_down_s'] for r in rows]):.1f} | "
                f"{mean([r['compute_s'] for r in rows]):.1f} | "
                f"{mean([r['upload_s'] for r in rows]):.2f} / {mean([r['bound_up_s'] for r in rows]):.2f} | "
                f"{human_bytes(mean([r['uplink_bytes'] for r in rows]))} | {', '.join(encs)} | {meas:.1f} | "
                f"{bnd:.1f} | {meas / bnd:.2f} |"
            )
    lines += [
        "",
        f"Largest deviation from the bound: {100 * worst:.0f} % ({'within' if worst <= 0.2 else 'NOT within'} 20 %).",
        "",
    ]
    for run in runs:
        rows = [r for r in bound_rows(run) if r["link"] == "nb-iot"]
        if not rows:
            continue
        done = mean([r["done_s"] for r in rows])
        comm = mean([r["downlink_s"] + r["upload_s"] for r in rows])
        up = mean([r["upload_s"] for r in rows])
        comp = mean([r["compute_s"] for r in rows])
        lines.append(
            f"- {run['preset']} over nb-iot: round {done:.1f} s = compute {comp:.1f} s + downlink "
            f"{done - comp - up:.1f} s + upload {up:.1f} s; communication {100 * comm / done:.0f} % of it, "
            f"round / compute = {done / comp:.2f}."
        )
    return "\n".join(lines) + "\n"


# What each mode adds to the run's config (protofl/participation.py), each a rule, not a figure fitted to this fleet:
# select: select_fit's straggler rule at its default (a device estimated slower than 2 x a typical member is left
# out, broker_server/core/selection.py, from its profiles and the sample count its join reports), with the reference
# machine's compute of a round for the median member's data (~1 s: rpi4's measured ~4.2 s x its factor 0.25) and
# sync's deadline. async: a new version every half of the fleet's uploads (K = members / 2),
# twice the versions of sync's rounds (the same uploads).
MODES: dict[str, dict[str, Any]] = {
    "sync": {},
    "select": {"select_fit": True, "select_compute_s": 1.0},
    "async": {"buffer_k": 5, "staleness_bound": 4},
    # a sensitivity row: a smaller buffer (a version from the two Jetsons' and one more upload)
    "async3": {"buffer_k": 3, "staleness_bound": 4},
}
SECTION = "## Who takes part: synchronous, with selection, asynchronous (issue 47)"


def participation_md(
    runs: dict[tuple[str, str, int], dict[str, Any]], args: argparse.Namespace, load: tuple[str, str], wall: float
) -> str:
    """The section: per preset and mode, mean over seeds of time and bytes to the target, final accuracy."""
    from broker_server.commands.report_cli import accuracy, long_overruns, time_to_target
    from protofl.humanize import human_bytes

    def bytes_to(run: dict[str, Any], t: float | None) -> int | None:
        if t is None:
            return None
        times = [r["sim_time_s"] for r in run["links"]["rounds"]]
        n = next(i for i, x in enumerate(times) if x >= t - 1e-9) + 1
        return sum(r["uplink_bytes"] + r["downlink_bytes"] for r in run["rounds"][:n])

    def ratio(x: float) -> str:
        return f"{x:.2f}" if x >= 0.1 else f"{x:.4f}"

    seeds = sorted({k[2] for k in runs})
    # the time scale each preset's runs ran at (from their run JSONs: one invocation per scale)
    scales = {
        p: sorted({r["links"]["time_scale"] for k, r in runs.items() if k[0] == p}) for p in args.presets.split(",")
    }
    commands = " and ".join(
        f"`nice python -m bench.bench_links --modes {args.modes} --seeds {args.seeds} --presets {p} "
        f"--rounds {args.rounds} --proto-time-scale {sc:g} --target {args.target:g}"
        f"{f' --sample-cost {args.sample_cost:g}' if args.sample_cost else ''}`"
        for p, ss in scales.items()
        for sc in ss
    )
    lines = [
        SECTION,
        "",
        f"{commands} "
        f"({platform.machine()}, {os.cpu_count()} cores shared with other jobs, load average {load[0]} to {load[1]} "
        f"while it ran; {wall / 60:.0f} min of wall time). Fleet `{args.fleet}`, Fashion-MNIST (alpha "
        f"{args.alpha}, train limit {args.train_limit}), arch {args.arch}, seeds {', '.join(map(str, seeds))}; "
        f"accuracy = {args.metric}_acc (each reporting device on its own split, sample-weighted), target "
        f"{100 * args.target:.0f} %. Simulated seconds on the composed clock (broker_server/simulation/timeline.py: "
        + (
            f"link times from the profiles, compute {args.sample_cost:g} s per sample / compute factor"
            if args.sample_cost
            else "link times measured, compute emulated"
        )
        + ", for every round however it closed; uploads released in order on the virtual clock, "
        "edge_agent/core/emulation.py). Modes: sync = today (deadline "
        f"{args.deadline:g} s); select = {MODES['select']} (the straggler rule leaves out each device estimated "
        "slower than 2 x a typical member from its profiles and sample count, told when to come back); async = "
        f"{MODES['async']} with {2 * args.rounds} versions (sync and select: {args.rounds} rounds; async3: buffer_k "
        f"3, a sensitivity row where it ran). Bytes = up + down "
        "of the rounds up to the one that reached the target. Final acc % is over the devices that reported in the "
        "last round (select and async: those chosen or folded, so a left-out device's own accuracy is not in it). "
        "Uploads leave in the order of their emulated release times whatever this machine's load (thread agents: "
        "edge_agent/core/emulation.py ReleaseOrder), so which uploads a round or version folds is the devices' order; "
        "late releases: uploads this machine released later than the emulation asked by more than their whole "
        "round (report_cli.long_overruns), whose times the composed clock replaces.",
        "",
        "| preset | mode | seeds at target | time to target (s) | bytes to target | final acc % | simulated time (s) |"
        " devices a round | late releases |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for preset in args.presets.split(","):
        base_t, base_acc = None, None
        base_ts: dict[int, float | None] = {}
        base_accs: dict[int, float | None] = {}
        for mode in args.modes.split(","):
            ran = [s for s in seeds if (preset, mode, s) in runs]
            rs = [runs[(preset, mode, s)] for s in ran]
            if not rs:
                continue
            ts = [time_to_target(r, args.target, args.metric) for r in rs]
            bs = [bytes_to(r, t) for r, t in zip(rs, ts, strict=True)]
            # the last round that measured it (an asynchronous run's last version can fold only stale uploads,
            # whose devices sent their metrics with the version they trained from)
            accs = [
                next((a for x in reversed(r["rounds"]) if (a := accuracy(x, args.metric)) is not None), None)
                for r in rs
            ]
            hit = [t for t in ts if t is not None]
            t_mean = mean(hit) if len(hit) == len(rs) else None
            acc_mean = mean([a for a in accs if a is not None])
            devices = mean([r2["clients"] for r in rs for r2 in r["rounds"]])
            lines.append(
                f"| {preset} | {mode} | {len(hit)}/{len(rs)} | "
                f"{'-' if not hit else f'{mean(hit):.1f}'} | "
                f"{'-' if not hit else human_bytes(mean([b for b in bs if b is not None]))} | "
                f"{100 * acc_mean:.1f} | {mean([r['links']['rounds'][-1]['sim_time_s'] for r in rs]):.1f} | "
                f"{devices:.1f} | {sum(len(long_overruns(r)) for r in rs)} |"
            )
            if mode == "sync":
                base_t, base_acc = t_mean, acc_mean
                base_ts, base_accs = dict(zip(ran, ts, strict=True)), dict(zip(ran, accs, strict=True))
            elif base_t and t_mean is not None and base_acc is not None:
                paired = []
                for sd, t, a in zip(ran, ts, accs, strict=True):
                    bt, ba = base_ts.get(sd), base_accs.get(sd)
                    if t is not None and a is not None and bt and ba is not None:
                        paired.append(f"seed {sd} {ratio(t / bt)}x {100 * (a - ba):+.1f}")
                verdicts.append(
                    f"- {preset}, {mode}: time to target {ratio(t_mean / base_t)} x sync's (goal <= 0.33), final "
                    f"accuracy {100 * (acc_mean - base_acc):+.1f} points (goal >= -1): "
                    f"{'met' if t_mean / base_t <= 1 / 3 and acc_mean - base_acc >= -0.01 else 'not met'}. "
                    f"Paired with sync's run of the same seed (time ratio, accuracy points): {'; '.join(paired)}."
                )
            else:
                verdicts.append(f"- {preset}, {mode}: not every seed reached the target (or sync did not).")
    lines += ["", *verdicts, ""]
    return "\n".join(lines) + "\n"


def participation_main(args: argparse.Namespace) -> None:
    import torch

    from broker_server.simulation import SimulationSpec, run_simulation
    from protofl.profiles import parse_fleet

    torch.set_num_threads(1)
    runs_dir = args.runs_dir or args.out.parent / "links" / "participation"
    runs_dir.mkdir(parents=True, exist_ok=True)
    clients = sum(c.count for c in parse_fleet(args.fleet))
    load0 = open("/proc/loadavg").read().split()[0]
    t0 = time.time()
    runs: dict[tuple[str, str, int], dict[str, Any]] = {}
    ran = False
    for preset in args.presets.split(","):
        for seed in (int(x) for x in args.seeds.split(",")):
            for mode in args.modes.split(","):
                path = runs_dir / f"{preset}-{mode}-{seed}.json"
                if path.exists() and not args.again:
                    runs[(preset, mode, seed)] = json.loads(path.read_text())
                    continue
                overrides = {"round_timeout": args.deadline, **MODES[mode]}
                spec = SimulationSpec(
                    preset=preset, dataset="fashion-mnist", clients=clients, alpha=args.alpha,
                    rounds=2 * args.rounds if mode.startswith("async") else args.rounds, seed=seed, archs=(args.arch,),
                    transport="mqtt", agents="thread", train_limit=args.train_limit, test_limit=args.test_limit,
                    profiles=args.fleet, adaptive=args.adaptive, time_scale=args.proto_time_scale,
                    overrides=overrides, timeout=3600, sample_cost_s=args.sample_cost,
                )  # fmt: skip
                started = time.time()
                run = run_simulation(spec)
                path.write_text(json.dumps(run, indent=1))
                runs[(preset, mode, seed)] = run
                ran = True
                print(f"{preset} {mode} seed {seed}: {time.time() - started:.0f} s", flush=True)
    load1 = open("/proc/loadavg").read().split()[0]
    meta_path = runs_dir / "meta.json"  # the loads and wall time of every invocation that ran something
    meta: dict[str, Any] = json.loads(meta_path.read_text()) if meta_path.exists() else {"load": [], "wall_s": 0.0}
    if ran:
        meta = {"load": [*meta["load"], load0, load1], "wall_s": meta["wall_s"] + time.time() - t0}
        meta_path.write_text(json.dumps(meta))
    loads = sorted(meta["load"], key=float) or [load0, load1]
    meta["load"] = [loads[0], loads[-1]]
    section = participation_md(runs, args, tuple(meta["load"]), meta["wall_s"])
    text = args.out.read_text() if args.out.exists() else ""
    head = text.split(SECTION)[0].rstrip("\n")
    args.out.write_text((head + "\n\n" if head else "") + section)
    print(section)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fleet", default=FLEET)
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--time-scale", type=float, default=20.0, help="fedavg's (its NB-IoT round is ~48 min)")
    ap.add_argument(
        "--proto-time-scale",
        type=float,
        default=5.0,
        help="the prototype presets': their rounds are short, and each real millisecond of "
        "scheduling noise costs time-scale simulated ones",
    )
    ap.add_argument("--deadline", type=float, default=3600.0, help="simulated seconds")
    ap.add_argument("--target", type=float, default=0.6, help="target accuracy for time-to-target")
    ap.add_argument(
        "--metric",
        choices=("local", "global"),
        default="local",
        help="local_acc (each client on its own split: comparable across FedAvg and the personalised "
        "prototype presets) or global_acc",
    )
    ap.add_argument("--train-limit", type=int, default=6000)
    ap.add_argument("--test-limit", type=int, default=1000)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--arch", default="cnn")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-adaptive", dest="adaptive", action="store_false")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "LINKS.md")
    ap.add_argument("--runs-dir", type=Path, default=None, help="run JSONs and PNGs (default: next to --out)")
    ap.add_argument("--from-runs", action="store_true", help="rewrite --out and the plots from the run JSONs")
    ap.add_argument("--modes", default="", help="sync,select,async: who takes part (issue 47); see the docstring")
    ap.add_argument("--seeds", default="0,1,2", help="with --modes")
    ap.add_argument("--again", action="store_true", help="with --modes: run again what has a run JSON already")
    ap.add_argument(
        "--sample-cost",
        type=float,
        default=0.0,
        help="with --modes: compute and links timed from the profiles (simulate --sample-cost; 0: measured)",
    )
    args = ap.parse_args(argv)
    if args.modes:
        participation_main(args)
        return

    import torch

    from broker_server.commands.report_cli import write_report
    from broker_server.simulation import SimulationSpec, run_simulation
    from protofl.profiles import parse_fleet

    runs_dir = args.runs_dir or args.out.parent / "links"
    runs_dir.mkdir(parents=True, exist_ok=True)
    if args.from_runs:
        runs = [json.loads((runs_dir / f"{p}.json").read_text()) for p in args.presets.split(",")]
        meta = json.loads((runs_dir / "meta.json").read_text())
        write_report(runs, runs_dir, target=args.target, metric=args.metric)
        when = meta.get("when", "date not recorded")
        load0, load1 = meta["load"]
        args.out.write_text(links_md(runs, args, (load0, load1), meta["wall_s"], when))
        print(f"wrote {args.out} and {runs_dir}/ from the runs there")
        return
    torch.set_num_threads(1)
    clients = sum(c.count for c in parse_fleet(args.fleet))
    load0 = open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"
    t0 = time.time()
    runs = []
    for preset in args.presets.split(","):
        spec = SimulationSpec(
            preset=preset,
            dataset="fashion-mnist",
            clients=clients,
            alpha=args.alpha,
            rounds=args.rounds,
            seed=args.seed,
            archs=(args.arch,),
            transport="mqtt",
            agents="thread",
            train_limit=args.train_limit,
            test_limit=args.test_limit,
            profiles=args.fleet,
            adaptive=args.adaptive,
            time_scale=args.time_scale if preset == "fedavg" else args.proto_time_scale,
            overrides={"round_timeout": args.deadline},
            timeout=3600,
        )
        started = time.time()
        run = run_simulation(spec)
        (runs_dir / f"{preset}.json").write_text(json.dumps(run, indent=1))
        print(
            f"{preset}: {run['links']['rounds'][-1]['sim_time_s']:.0f} simulated s in {time.time() - started:.0f} s",
            flush=True,
        )
        runs.append(run)
    load1 = open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0))
    (runs_dir / "meta.json").write_text(json.dumps({"load": [load0, load1], "wall_s": time.time() - t0, "when": when}))
    write_report(runs, runs_dir, target=args.target, metric=args.metric)
    args.out.write_text(links_md(runs, args, (load0, load1), time.time() - t0, when))
    print(f"wrote {args.out} and {runs_dir}/")


if __name__ == "__main__":
    main()

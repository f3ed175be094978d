"""The product's global predictor against the routes' FedAvg (issue 41's moonshot, through the commands a user types).

`bench/predictor_routes.py` chose the route (ridge on a public-pretrained backbone) with its own training loops;
this runs the product: `protofl-server simulate` with the default preset (protofl: its ridge predictor) on the
same federations as the routes' device run (Fashion-MNIST, --train-limit 6000, setting A: 10 clients alpha 0.5;
B: 20 clients alpha 0.1; the partitions of `simulate` and the routes are the same for the same seed:
tests/bench/test_predictor_routes.py), and scores the predictor on the official 10,000 test images. It then pairs
each seed with the routes' FedAvg (converged: 50 rounds, its stopping rule fired at rounds 9-37) and public-only
control of the same seed (bench/results/predictor/device-h100/, an H100), and writes the rows.

The predictor does not change after the round in which every device sent its statistics (round 1: they go once,
on a backbone that never changes), so one round is enough to score it: `--rounds 1`. Its uplink is that of the
protofl preset's run over the routes' R = 50 rounds: round 1's measured bytes plus 49 rounds of the protofl
preset's later rounds (measured in round 2 of a 2-round run: `--bytes-rounds 2` runs those), against FedAvg's 50.

    python -m bench.predictor_product --out bench/results/predictor/product [--seeds 0,1,2,3,4] [--settings A,B]
    python -m bench.predictor_product --summary bench/results/predictor/product
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.paired import paired

SETTINGS = {"A": ("10", "0.5", "A-cnn"), "B": ("20", "0.1", "B-cnn")}
ROUTES = Path("bench/results/predictor/device-h100")
R = 50  # the routes' rounds


def run(out: Path, setting: str, seed: int, rounds: int, threads: int) -> dict[str, Any]:
    clients, alpha, _ = SETTINGS[setting]
    path = out / f"{setting}-s{seed}-r{rounds}.json"
    if path.exists():
        return dict(json.loads(path.read_text()))
    out.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable, "-m", "broker_server.cli", "simulate", "--dataset", "fashion-mnist", "--clients", clients,
        "--alpha", alpha, "--seed", str(seed), "--rounds", str(rounds), "--train-limit", "6000",
        "--test-limit", "10000", "--json", str(path),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    t0 = time.time()
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    rec = dict(json.loads(path.read_text()))
    rec["bench"] = {"argv": argv[2:], "wall_s": time.time() - t0, "threads": threads}
    path.write_text(json.dumps(rec))
    return rec


def route(setting: str, name: str, seed: int) -> dict[str, Any] | None:
    p = ROUTES / SETTINGS[setting][2] / f"{name}-s{seed}.json"
    return json.loads(p.read_text()) if p.exists() else None


def summary(out: Path) -> str:
    lines = [
        "| setting | seeds | product predictor % | FedAvg (routes, 50 rounds) % | public-only (routes) % | "
        "predictor - FedAvg | predictor - public-only | uplink vs FedAvg |",
        "|---|---|--:|--:|--:|---|---|--:|",
    ]
    for setting in SETTINGS:
        rows: list[tuple[int, float, float, float, int, int | None, int]] = []
        for p in sorted(out.glob(f"{setting}-s*-r1.json")):
            rec = json.loads(p.read_text())
            seed = int(rec["config"]["seed"])
            fa, pb = route(setting, "fedavg", seed), route(setting, "public", seed)
            if fa is None or pb is None:
                continue
            acc = 100 * rec["rounds"][-1]["predictor_acc"]
            up1 = rec["totals"]["uplink_bytes"]
            # a later round's uplink: this seed's 2-round run, else the setting's first seed's
            twos = [out / f"{setting}-s{seed}-r2.json", *sorted(out.glob(f"{setting}-s*-r2.json"))]
            two = next((t for t in twos if t.exists()), None)
            later = json.loads(two.read_text())["rounds"][1]["uplink_bytes"] if two is not None else None
            rows.append((seed, acc, float(fa["acc"]), float(pb["acc"]), int(up1), later, int(fa["uplink_total"])))
        if not rows:
            continue
        seeds = [r[0] for r in rows]
        acc = {r[0]: r[1] for r in rows}
        fed = {r[0]: r[2] for r in rows}
        pub = {r[0]: r[3] for r in rows}
        d_fed, d_pub = paired(acc, fed), paired(acc, pub)
        ratios = [(r[4] + (R - 1) * (r[5] or 0)) / r[6] for r in rows if r[5] is not None]
        ratio = f"{max(ratios):.5f} (max over seeds)" if ratios else "-"
        n = len(rows)
        lines.append(
            f"| {setting} | {','.join(map(str, seeds))} | {sum(acc.values()) / n:.2f} | {sum(fed.values()) / n:.2f} | "
            f"{sum(pub.values()) / n:.2f} | {d_fed.text()} | {d_pub.text()} | {ratio} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench/results/predictor/product"))
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--settings", default="A,B")
    p.add_argument("--bytes-rounds", type=int, default=2, help="also run this many rounds to measure later rounds")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--summary", type=Path, help="print the rows of a finished --out and exit")
    a = p.parse_args(argv)
    if a.summary:
        print(summary(a.summary))
        return 0
    for setting in a.settings.split(","):
        for seed in map(int, a.seeds.split(",")):
            rec = run(a.out, setting, seed, 1, a.threads)
            print(setting, seed, "predictor", rec["rounds"][-1]["predictor_acc"], flush=True)
            if a.bytes_rounds > 1 and seed == int(a.seeds.split(",")[0]):
                run(a.out, setting, seed, a.bytes_rounds, a.threads)
    print(summary(a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

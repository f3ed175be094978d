"""Small device sets: the step floor (`min_local_steps`) that makes them learn (issue 56, item 4).

Fashion-MNIST, `--train-limit 1200` (200 carved for the public set, the rest over 4 devices at alpha 0.5: about
190 training images a device, 3 SGD steps an epoch at batch 64), 8 rounds, through the command a user types:

    protofl-server simulate --preset P --dataset fashion-mnist --clients 4 --alpha 0.5 --train-limit 1200
        --test-limit 2000 --rounds 8 --test-every 1 --seed S --set min_local_steps=F --json ...

for every preset P and floor F asked. Prints a table (round 1 and last round: local accuracy, the deployable
model's accuracy on the first 2,000 test images: the predictor where the preset has one, FedAvg's global model,
else the clients' mean global accuracy) and writes OUT/<preset>-f<F>-s<S>.json.

    python -m bench.small_sets --out bench/results/small [--presets fedavg,protofl] [--floors 0,10,20,40] [--seeds 0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any


def deployable(row: dict[str, Any]) -> float | None:
    """The accuracy of what the federation deploys: its predictor, else the clients' global accuracy."""
    for key in ("predictor_acc", "global_acc"):
        if row.get(key) is not None:
            return float(row[key])
    return None


def one(out: Path, preset: str, floor: int, seed: int, rounds: int, limit: int) -> dict[str, Any]:
    path = out / f"{preset}-f{floor}-s{seed}.json"
    if not path.exists():
        argv = [
            *("protofl-server", "simulate", "--preset", preset, "--dataset", "fashion-mnist", "--clients", "4"),
            *("--alpha", "0.5", "--train-limit", str(limit), "--test-limit", "2000", "--rounds", str(rounds)),
            *("--test-every", "1", "--seed", str(seed), "--set", f"min_local_steps={floor}", "--json", str(path), "-q"),
        ]
        start = time.perf_counter()
        subprocess.run(argv, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        print(f"{path.name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    run = json.loads(path.read_text())
    first, last = run["rounds"][0], run["rounds"][-1]
    return {
        "preset": preset,
        "floor": floor,
        "seed": seed,
        "local_1": first["local_acc"],
        "local_last": last["local_acc"],
        "deploy_1": deployable(first),
        "deploy_last": deployable(last),
        "wall_s": run["totals"].get("wall_s"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--presets", default="fedavg,protofl")
    ap.add_argument("--floors", default="0,10,20,40")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--train-limit", type=int, default=1200)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cases = [
        (p, int(f), int(s))
        for p in args.presets.split(",")
        for f in args.floors.split(",")
        for s in args.seeds.split(",")
    ]
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda c: one(args.out, c[0], c[1], c[2], args.rounds, args.train_limit), cases))

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.1f}"

    print("| preset | floor | seed | local r1 | local last | deployable r1 | deployable last | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['preset']} | {r['floor']} | {r['seed']} | {pct(r['local_1'])} | {pct(r['local_last'])} | "
            f"{pct(r['deploy_1'])} | {pct(r['deploy_last'])} | {r['wall_s']:.0f} |"
        )


if __name__ == "__main__":
    main()

"""Setting A at RefProtoFL's own sizing, on a GPU: ResNet18, the whole 60,000-image training set,
10 clients, 50 rounds, the whole test set.

    python -m bench.gpu_sizing --out bench/results/gpu --data-dir DIR            # the five rows, seed 0
    python -m bench.gpu_sizing --methods fedproto,tinyproto --alpha 100 --seeds 0,1 --parallel 2

Each (method, alpha, seed) is one process (`--one`), several at once on the one GPU (`--parallel`, default
all of a seed's methods: at 28x28 a ResNet18 step does not fill an H100/H200, so runs side by side cost
little each). Seeds run one after another. A run appends one JSON line per round to
`<out>/<run>.rounds.jsonl` as the round's metrics come in, so a run cut by the machine's time limit still
counts up to its last round; a finished run also writes `<out>/<run>.json` (the simulate report). The
papers' rows fold uploads as sent (`--clip off`, as in TABLE.md's goal rows); so does the protofl preset
here, to compare like with like. `python -m bench.gpu_sizing --summary DIR` prints the table of what
a directory holds (last round reached, local accuracy, global/ensemble at the last test round, bytes).
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

from bench.table_report import pct

METHODS = ("fedavg", "fedproto", "refprotofl", "tinyproto", "protofl")
ROUNDS = 50
TRAIN_LIMIT = 60000  # Fashion-MNIST's whole training set
TEST_EVERY = 10  # global / ensemble accuracy on the 10,000 test images every 10 rounds (and the last)


TESTED = ("global_acc", "global_proto_acc", "ensemble_acc", "predictor_acc")  # scored on the test set


def run_name(method: str, alpha: float, seed: int) -> str:
    return f"a{alpha:g}-{method}-s{seed}"


def run_one(
    method: str, alpha: float, seed: int, rounds: int, out: Path, data_dir: str | None, device: str, train_limit: int
) -> None:
    """One federation in this process; per-round lines as they come."""
    from broker_server.simulation import SimulationSpec, run_simulation

    name = run_name(method, alpha, seed)
    lines = out / f"{name}.rounds.jsonl"
    lines.write_text("")
    started = time.monotonic()

    def on_round(row: dict[str, Any]) -> None:
        with lines.open("a") as f:
            f.write(json.dumps({**row, "wall_s": round(time.monotonic() - started, 1)}) + "\n")

    spec = SimulationSpec(
        preset=method,
        dataset="fashion-mnist",
        data_dir=data_dir,
        clients=10,
        alpha=alpha,
        rounds=rounds,
        seed=seed,
        archs=("resnet18",),
        train_limit=train_limit,
        test_limit=10000,
        eval_every=1,
        test_every=min(TEST_EVERY, rounds),
        device=device,
        clip=False,
    )
    report = run_simulation(spec, on_round=on_round)
    report["bench"] = {
        "wall_s": round(time.monotonic() - started, 1),
        "method": method,
        "alpha": alpha,
        "seed": seed,
        "rounds": rounds,
        "train_limit": train_limit,
    }
    (out / f"{name}.json").write_text(json.dumps(report, indent=2))


def summary(out: Path, at: int | None = None) -> str:
    """One line per run: how far it got (rounds, wall seconds) and its figures at round `at` (default: the
    local figures at the last round it reached, the test-set figures at its last scored round), uplink to
    that round. Runs cut before `at` show their last round."""
    rows = [
        "| run | rounds reached | wall s | round | local head | local proto | local own proto | global | "
        "global proto | ensemble | global predictor | uplink MB |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]

    for lines in sorted(out.glob("*.rounds.jsonl")):
        name = lines.name.removesuffix(".rounds.jsonl")
        recs = [json.loads(x) for x in lines.read_text().splitlines() if x.strip()]
        if not recs:
            rows.append(f"| {name} | 0 |" + " - |" * 10)
            continue
        upto = [r for r in recs if at is None or r["round"] <= at]
        here = upto[-1]
        tested = [r for r in upto if any(r.get(k) is not None for k in TESTED)]
        t = tested[-1] if tested else {}
        up = sum(r.get("uplink_bytes", 0) or 0 for r in upto) / 1e6
        scored = f"{here['round']}" + (f" (test set: {t['round']})" if t and t["round"] != here["round"] else "")
        rows.append(
            f"| {name} | {recs[-1]['round']} | {recs[-1].get('wall_s')} | {scored} | "
            f"{pct(here.get('local_acc'))} | {pct(here.get('local_proto_acc'))} | "
            f"{pct(here.get('local_own_proto_acc'))} | {pct(t.get('global_acc'))} | "
            f"{pct(t.get('global_proto_acc'))} | {pct(t.get('ensemble_acc'))} | "
            f"{pct(t.get('predictor_acc'))} | {up:.1f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--train-limit", type=int, default=TRAIN_LIMIT)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", type=Path, default=Path("bench/results/gpu"))
    ap.add_argument("--parallel", type=int, default=0, help="runs at once (default: all of a seed's methods)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--summary", type=Path, default=None, help="print the table of a results directory, and exit")
    ap.add_argument("--at", type=int, default=None, help="--summary: the figures at this round")
    a = ap.parse_args(argv)
    if a.summary is not None:
        print(summary(a.summary, a.at))
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in a.seeds.split(",")]
    if a.one is not None:
        run_one(a.one, a.alpha, seeds[0], a.rounds, a.out, a.data_dir, a.device, a.train_limit)
        return 0
    methods = a.methods.split(",")
    unknown = set(methods) - set(METHODS)
    if unknown:
        ap.error(f"unknown method(s) {sorted(unknown)}; choose from {','.join(METHODS)}")
    parallel = a.parallel or len(methods)
    failed = 0
    for seed in seeds:
        pending = list(methods)
        running: list[tuple[str, subprocess.Popen[bytes]]] = []
        while pending or running:
            while pending and len(running) < parallel:
                m = pending.pop(0)
                log = (a.out / f"{run_name(m, a.alpha, seed)}.log").open("w")
                cmd = [
                    sys.executable,
                    "-m",
                    "bench.gpu_sizing",
                    "--one",
                    m,
                    "--alpha",
                    str(a.alpha),
                    "--seeds",
                    str(seed),
                    "--rounds",
                    str(a.rounds),
                    "--train-limit",
                    str(a.train_limit),
                    "--device",
                    a.device,
                    "--out",
                    str(a.out),
                ] + (["--data-dir", a.data_dir] if a.data_dir else [])
                running.append((m, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ)))
                print(f"started {run_name(m, a.alpha, seed)}", flush=True)
            for m, p in list(running):
                if p.poll() is not None:
                    running.remove((m, p))
                    failed += p.returncode != 0
                    print(f"{run_name(m, a.alpha, seed)} exit {p.returncode}", flush=True)
            time.sleep(1)
    print(summary(a.out))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""What evaluation costs a simulation, before and after issue 12, in one run.

    python -m bench.bench_eval                     # FedProto, 10 clients, 10 rounds, 10 % of the data
    python -m bench.bench_eval --before-rev f72231b --out bench/results/EVAL.md

Four `protofl-server simulate` calls on the same federation (same seed, same training), run one after
the other so that they share the machine's conditions:
1. *before*: the code at `--before-rev` (a temporary git worktree), every client scoring 2,000 test
   images every round, as the benchmark did: two forward passes per split (head, then nearest prototype);
2. *after, same protocol*: this tree with the same flags: one forward pass per split serves both;
3. *after, benchmark protocol*: local split every round, the whole 10,000-image test set once, at the
   final round (`--test-every 10`), what `bench.paper_table --suite full` runs;
4. *evaluation at the end only* (2,000 test images): the floor, close to training alone.
Wall time is the CLI's own (`totals.wall_s`, data loading excluded); the final accuracies must agree
between 1 and 2 (the same computation), which the bench checks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BASE = [
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
    "10",
    "--seed",
    "0",
    "--train-limit",
    "6000",
    "-q",
]
CASES = (
    # (name, code: "before" | "after", extra flags)
    ("before: every round, 2,000 test images, two passes", "before", ["--eval-every", "1", "--test-limit", "2000"]),
    ("after: every round, 2,000 test images, one pass", "after", ["--eval-every", "1", "--test-limit", "2000"]),
    ("after: local every round, 10,000 test images at the end", "after", ["--eval-every", "1", "--test-every", "10"]),
    ("evaluation at the end only, 2,000 test images", "after", ["--eval-every", "10", "--test-limit", "2000"]),
)


def simulate(pythonpath: Path, flags: list[str], data_dir: str | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="protofl-bench-eval-") as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, "-m", "broker_server.cli", *BASE, *flags, "--json", str(out)]
        if data_dir:
            cmd += ["--data-dir", data_dir]
        env = {**os.environ, "PYTHONPATH": str(pythonpath)}
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=pythonpath, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"simulate failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
        rep = json.loads(out.read_text())
        rep["process_s"] = time.perf_counter() - started
        return rep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.bench_eval",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--before-rev", default="f72231b", help="the revision before the evaluation changes")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "EVAL.md")
    ns = ap.parse_args(argv)

    worktree = Path(tempfile.mkdtemp(prefix="protofl-before-"))
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(worktree), ns.before_rev], cwd=ROOT, check=True, capture_output=True
    )
    rows = []
    try:
        for name, code, flags in CASES:
            rep = simulate(worktree if code == "before" else ROOT, flags, ns.data_dir)
            last = rep["rounds"][-1]
            rows.append((name, flags, rep["totals"]["wall_s"], last))
            print(
                f"{name}: {rep['totals']['wall_s']:.1f} s; final local {last['local_acc']:.4f} global "
                f"{last['global_acc']:.4f}",
                flush=True,
            )
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, capture_output=True)
        shutil.rmtree(worktree, ignore_errors=True)
    same = all(abs(rows[0][3][k] - rows[1][3][k]) < 1e-9 for k in ("local_acc", "global_acc", "ensemble_acc"))
    floor = rows[-1][2]
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    lines = [
        "# Evaluation cost of a simulation (issue 12)",
        "",
        f"`python -m bench.bench_eval --before-rev {ns.before_rev}`; machine: {os.cpu_count()} CPUs, load "
        f"average after the run {load} (other jobs shared the CPU: compare rows of this run only).",
        f"Federation: `protofl-server {' '.join(BASE)}` plus the flags below.",
        "",
        "| case | flags | wall s | x end-only | final local | final global |",
        "|---|---|--:|--:|--:|--:|",
    ]
    for name, flags, wall, last in rows:
        lines.append(
            f"| {name} | `{' '.join(flags)}` | {wall:.1f} | {wall / floor:.2f} | "
            f"{100 * last['local_acc']:.2f} | {100 * last['global_acc']:.2f} |"
        )
    lines += [
        "",
        f"Before and after on the same protocol give {'the same' if same else 'DIFFERENT'} final accuracies "
        "(the same computation, one forward pass fewer per split).",
    ]
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {ns.out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

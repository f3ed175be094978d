"""The simulator's default run, before and after issue 28's speed work, side by side in one run.

    python -m bench.bench_simspeed --base /work/wt/base-d63255d    # writes bench/results/SIMSPEED.md
    python -m bench.bench_simspeed --base DIR --new DIR --pairs 2 --threads 1

The work is the issue's: FedProto, 10 clients, Dirichlet alpha 0.5, 10 rounds, 10 % of Fashion-MNIST
(`--train-limit 6000`), 2,000 test images per client (`--test-limit 2000`, as the issue measured), every
other option at its default. Each tree (`--base`: a checkout of the previous revision, e.g. a git worktree
of d63255d; `--new`: this one, or a snapshot of it) runs that same command as a subprocess of the public
CLI with PYTHONPATH at the tree, in alternating order (base, new, then new, base, ...), with the same torch
threads (`--threads`, else torch's default). Per run: wall, user and system CPU seconds (the child's own
rusage), the machine's load average before and after, and the final round's accuracies, which must agree
between the trees (the final round scores the full sets in both): the bench fails if they do not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLAGS = [
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
    "--test-limit",
    "2000",
    "-q",
]
FINAL = ("local_acc", "local_proto_acc", "global_acc", "global_proto_acc", "ensemble_acc")


@dataclass
class Run:
    tree: str  # "base" or "new"
    wall: float
    user: float
    sys: float
    load_before: float
    load_after: float
    final: dict[str, float | None]
    rounds_scored: int  # rounds with a global accuracy (the test set scored)


def simulate(tree: str, path: Path, threads: int | None, data_dir: str | None, flags: list[str]) -> Run:
    """One `protofl-server simulate` of the work in `path`'s code; its wall and CPU from the child's rusage."""
    env = {**os.environ, "PYTHONPATH": str(path)}
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    with tempfile.TemporaryDirectory(prefix="protofl-simspeed-") as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, "-m", "broker_server.cli", *flags, "--json", str(out)]
        if data_dir:
            cmd += ["--data-dir", data_dir]
        load_before = os.getloadavg()[0]
        started = time.perf_counter()
        with open(Path(tmp) / "stderr", "w+") as err:  # a file, not a pipe: nothing blocks the child
            proc = subprocess.Popen(cmd, cwd=path, env=env, stdout=subprocess.DEVNULL, stderr=err)
            _, status, usage = os.wait4(proc.pid, 0)  # the child's own CPU time
            wall = time.perf_counter() - started
            proc.returncode = os.waitstatus_to_exitcode(status)
            if proc.returncode != 0:
                err.seek(0)
                raise SystemExit(f"{tree}: simulate failed ({' '.join(cmd)}):\n{err.read()[-3000:]}")
        rep = json.loads(out.read_text())
    last = rep["rounds"][-1]
    return Run(
        tree,
        wall,
        usage.ru_utime,
        usage.ru_stime,
        load_before,
        os.getloadavg()[0],
        {k: last.get(k) for k in FINAL},
        sum(r["global_acc"] is not None for r in rep["rounds"]),
    )


def git_rev(path: Path) -> str:
    out = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    ).stdout.strip()
    return (out.stdout.strip() or "unknown") + (" (with uncommitted changes)" if dirty else "")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}"


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def render(runs: list[Run], args: argparse.Namespace, revs: dict[str, str]) -> str:
    by = {t: [r for r in runs if r.tree == t] for t in ("base", "new")}
    speed = _mean([r.wall for r in by["base"]]) / _mean([r.wall for r in by["new"]])
    threads = args.threads if args.threads is not None else "torch's default"
    lines = [
        "# The simulator's default run, before and after (issue 28)",
        "",
        f"- command: `python -m bench.bench_simspeed {' '.join(args.argv)}`",
        f"- work: `protofl-server {' '.join(args.flags)}` "
        + (
            "(--smoke: the issue's command, then 3 clients, 2 rounds, 1,000 training and 200 test images: "
            "the bench's own check, not the issue's work)"
            if args.smoke
            else "(--fifth: the issue's command on a fifth of its data, 1,200 training and 400 test images, "
            "10 clients, "
            "10 rounds, default options: the same balance of training and scoring)"
            if args.fifth
            else "(FedProto, 10 clients, alpha 0.5, 10 rounds, 10 % of Fashion-MNIST, 2,000 test images per client; "
            "every other option at its default)"
        ),
        f"- base: `{args.base}` at {revs['base']}; new: `{args.new}` at {revs['new']}",
        f"- machine: {platform.node()}, {os.cpu_count()} CPUs, shared with other jobs (load average in each row); "
        f"torch threads: {threads}; runs interleaved, {args.pairs} pair(s), `nice` as launched",
        f"- written: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        "",
        "| # | tree | wall s | user s | sys s | load before/after | rounds scoring the test set | "
        + " | ".join(f"final {k}" for k in FINAL)
        + " |",
        "|--:|---|--:|--:|--:|---|--:|" + "--:|" * len(FINAL),
    ]
    for i, r in enumerate(runs, 1):
        accs = " | ".join(_pct(r.final[k]) for k in FINAL)
        lines.append(
            f"| {i} | {r.tree} | {r.wall:.1f} | {r.user:.1f} | {r.sys:.1f} | "
            f"{r.load_before:.1f} / {r.load_after:.1f} | {r.rounds_scored} | {accs} |"
        )
    lines += [
        "",
        f"**Speed-up of the default run: {speed:.2f}x** (mean wall, base / new). "
        f"Mean user+sys CPU: base {_mean([r.user + r.sys for r in by['base']]):.1f} s, "
        f"new {_mean([r.user + r.sys for r in by['new']]):.1f} s; system CPU: base "
        f"{_mean([r.sys for r in by['base']]):.1f} s, new {_mean([r.sys for r in by['new']]):.1f} s.",
        "Final accuracies: identical in every run (checked by the bench).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m bench.bench_simspeed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="a checkout of the previous revision (git worktree)")
    ap.add_argument("--new", type=Path, default=ROOT, help="the tree to measure (default: this one)")
    ap.add_argument("--pairs", type=int, default=1, help="base/new pairs, alternating which goes first")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of every run (default: torch's)")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--smoke", action="store_true", help="a 2-round, 3-client version (checks the bench itself)")
    ap.add_argument(
        "--fifth",
        action="store_true",
        help="the issue's work on a fifth of its data (1,200 training, "
        "400 test images; 10 clients, 10 rounds): the same balance of training and scoring, 5x quicker",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "SIMSPEED.md")
    args = ap.parse_args(argv)
    args.argv = argv
    args.flags = (
        [*FLAGS, "--clients", "3", "--rounds", "2", "--train-limit", "1000", "--test-limit", "200"]
        if args.smoke
        else [*FLAGS, "--train-limit", "1200", "--test-limit", "400"]
        if args.fifth
        else FLAGS
    )
    trees = {"base": args.base.resolve(), "new": args.new.resolve()}
    runs: list[Run] = []
    for i in range(args.pairs):
        for tree in ("base", "new") if i % 2 == 0 else ("new", "base"):
            runs.append(simulate(tree, trees[tree], args.threads, args.data_dir, args.flags))
            r = runs[-1]
            print(
                f"{tree}: wall {r.wall:.1f} s, user {r.user:.1f} s, sys {r.sys:.1f} s, load "
                f"{r.load_before:.1f}->{r.load_after:.1f}, final {r.final}",
                flush=True,
            )
    finals = {json.dumps(r.final, sort_keys=True) for r in runs}
    if len(finals) != 1:
        raise SystemExit(f"the final accuracies differ between runs: {sorted(finals)}")
    text = render(runs, args, {k: git_rev(v) for k, v in trees.items()})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

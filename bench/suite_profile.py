"""Where the test suite's time goes: each test's wall time, its own CPU time and that of the processes it waited for.

    python -m bench.suite_profile [--out DIR] [--top N] [-- PYTEST ARGS...]

runs the README's pytest command (`-n 3 --dist loadfile` unless PYTEST ARGS are given) with this module as a pytest
plugin: every xdist worker appends one line a test to DIR/tests.<worker>.tsv (node id, wall s, the worker's own CPU s,
the CPU s of the children it reaped), then the files and tests that cost most are printed and written to
DIR/summary.md. A test's own CPU is its in-process work (simulations, training, exports run in the worker); its
children's is the servers, devices and commands it started and waited for (a process the test leaves to a fixture or
kills without reaping is counted where it is reaped, or not at all), those forked by the tests' launcher
(tests/launcher.py) included. Wall times grow with the load the other worker
puts on the machine; CPU times much less: compare CPU between trees, on one machine.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

ENV = "PROTOFL_SUITE_PROFILE_DIR"


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    cpu = r.ru_utime + r.ru_stime
    launcher = sys.modules.get("tests.launcher")  # the tests' preloaded launcher reaps what it starts: its count
    if who == resource.RUSAGE_CHILDREN and launcher is not None:
        cpu += float(launcher.launched_cpu_s())
    return cpu


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, None]:
    out = os.environ.get(ENV)
    if not out:
        yield
        return
    t0, s0, c0 = time.monotonic(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    yield
    t1, s1, c1 = time.monotonic(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with (Path(out) / f"tests.{worker}.tsv").open("a") as fh:
        fh.write(f"{item.nodeid}\t{t1 - t0:.2f}\t{s1 - s0:.2f}\t{c1 - c0:.2f}\n")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Each worker's count of commands the tests' launcher sent the ordinary way, by reason."""
    out = os.environ.get(ENV)
    launcher = sys.modules.get("tests.launcher")
    if not out or launcher is None:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with (Path(out) / f"refused.{worker}.tsv").open("w") as fh:
        for why, count in sorted(launcher.refused().items()):
            fh.write(f"{count}\t{why}\n")


def summarise(out: Path, top: int) -> str:
    """The most expensive files and tests, from the workers' lines."""
    tests: list[tuple[str, float, float, float]] = []
    for path in sorted(out.glob("tests.*.tsv")):
        for line in path.read_text().splitlines():
            cells = line.split("\t")
            tests.append((cells[0], float(cells[1]), float(cells[2]), float(cells[3])))
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for node, t_wall, t_own, t_children in tests:
        f = files[node.split("::")[0]]
        f[0], f[1], f[2] = f[0] + t_wall, f[1] + t_own, f[2] + t_children
    total = [sum(t[1] for t in tests), sum(t[2] for t in tests), sum(t[3] for t in tests)]
    lines = [
        f"{len(tests)} tests: {total[0]:.0f} s of worker wall time, {total[1]:.0f} s of the workers' own CPU, "
        f"{total[2]:.0f} s of their reaped children's CPU",
        "",
        "| file | wall s | own CPU s | children CPU s |",
        "|---|--:|--:|--:|",
    ]
    for name, (wall, own, children) in sorted(files.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))[:top]:
        lines.append(f"| {name} | {wall:.1f} | {own:.1f} | {children:.1f} |")
    lines += ["", "| test | wall s | own CPU s | children CPU s |", "|---|--:|--:|--:|"]
    for node, t_wall, t_own, t_children in sorted(tests, key=lambda t: -(t[2] + t[3]))[:top]:
        lines.append(f"| {node} | {t_wall:.1f} | {t_own:.1f} | {t_children:.1f} |")
    refused: dict[str, int] = defaultdict(int)
    for path in sorted(out.glob("refused.*.tsv")):
        for line in path.read_text().splitlines():
            count, _, why = line.partition("\t")
            refused[why] += int(count)
    if refused:
        lines += ["", "Commands the tests' launcher (tests/launcher.py) started the ordinary way, by reason:", ""]
        lines += [f"- {count} x {why}" for why, count in sorted(refused.items(), key=lambda kv: -kv[1])[:top]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("suite-profile"), help="where the lines and summary go")
    parser.add_argument("--top", type=int, default=30, help="how many files and tests the summary lists")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments (default: the README's)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for old in [*args.out.glob("tests.*.tsv"), *args.out.glob("refused.*.tsv")]:
        old.unlink()
    pytest_args = args.pytest_args or ["-q", "-n", "3", "--dist", "loadfile"]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "bench.suite_profile", *pytest_args],
        env={**os.environ, ENV: str(args.out.resolve())},
        check=False,
    )
    summary = f"pytest exit {done.returncode}, {time.monotonic() - started:.0f} s of wall time\n\n"
    summary += summarise(args.out, args.top)
    (args.out / "summary.md").write_text(summary)
    print(summary)
    return done.returncode


if __name__ == "__main__":
    raise SystemExit(main())

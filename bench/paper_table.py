"""The papers' experiments on Fashion-MNIST, side by side, one command.

    python -m bench.paper_table --suite quick            # a few minutes: the runs the goals need, 2 rounds
    python -m bench.paper_table --suite full             # hours; resumable: rerun the same command
    python -m bench.paper_table --suite full --only A    # one setting (D also runs the A/B baselines it shows)
    python -m bench.paper_table --suite full --table-only  # rewrite TABLE.md from the cached runs
    python -m bench.paper_table --suite full --rows 'B/fedproto,B/tinyproto' --seeds 3,4  # chosen runs only

Every run is a subprocess call of the public CLI (`protofl-server simulate ... --json`), so what users
run is what is measured. Each finished run is cached as
`<results>/<setting>/<run>.json` (the CLI's report plus a `bench` block with the exact command, git
revision and finish time); the CLI writes to a temporary name that is renamed only when the run
succeeded, so an interrupted run leaves no half file and a finished run is never redone (a cached run
whose command or resolved config differs from the current one is stale and is redone: a changed preset
default or config default makes the same command mean another run). After every run the table is
rewritten: TABLE.md (per setting, one row per method), one PNG per section (accuracy vs cumulative
uplink bytes) and the Goals section. Runs, sizing and paper figures are in `bench.table_runs`; the
rendering in `bench.table_report`.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypedDict

from bench import table_report
from bench.table_runs import (
    FEDERATIONS,
    SETTINGS,
    SIZING,
    Run,
    as_spelled_today,
    needed_for,
    run_args,
    spellings,
    suite_runs,
    test_samples,
    twin_run,
)
from broker_server.simulation import SimulationSpec, resolve_config

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def cli_prefix() -> list[str]:
    """The installed `protofl-server` (next to this interpreter first), else the module it runs."""
    here = Path(sys.executable).parent / "protofl-server"
    if here.is_file() and os.access(here, os.X_OK):
        return [str(here)]
    found = shutil.which("protofl-server")
    if found:
        return [found]
    return [sys.executable, "-m", "broker_server.cli"]


class DatasetShape(TypedDict):
    """resolve_config's dataset arguments."""

    num_classes: int
    in_shape: tuple[int, ...]


# What Fashion-MNIST decides in the config (the simulation reads it off the data).
DATASET_SHAPE: DatasetShape = {"num_classes": 10, "in_shape": (1, 28, 28)}


def expected_config(run: Run, suite: str) -> dict[str, Any]:
    """The config `protofl-server simulate` resolves for this run now, as the report's JSON holds it."""
    fed = FEDERATIONS[run.fed]
    size = SIZING[suite][run.fed]
    clients = size.clients if size.clients is not None else fed.clients
    spec = SimulationSpec(
        preset=run.preset,
        clients=clients,
        rounds=size.rounds,
        seed=run.seed,
        archs=tuple(fed.archs),
        overrides=dict(run.sets),
    )
    return json.loads(json.dumps(resolve_config(spec, **DATASET_SHAPE).to_dict()))


def config_matches(rep: dict[str, Any], run: Run, suite: str) -> bool:
    """The cached run's config is the one the run resolves to now, compared value by value (a report holds
    the scoped config, or the flat one of reports made before it). A config field added since the run was
    made matches when it holds its default (the run behaved as the default says); any other difference,
    or a field that is gone, makes the cached run stale."""
    cached = config_values(rep.get("config"))
    return cached is not None and cached == config_values(expected_config(run, suite))


def config_values(config: Any) -> dict[str, Any] | None:
    """A report's config as flat values (every field and installed option, defaults filled in); None when
    today's code cannot read it (a field that is gone)."""
    from protofl.config import FederationConfig
    from protofl.errors import ConfigError

    if not isinstance(config, dict):
        return None
    try:
        return json.loads(json.dumps(FederationConfig.from_dict(config).values()))
    except (ConfigError, TypeError):
        return None


def sim_env() -> dict[str, str]:
    """The simulations' environment: torch's OpenMP threads sleep when idle instead of spinning.

    With `--jobs 2` on 2 cores, two simulations' spinning threads took each other's CPU: a small run took 8.3 s
    of user time against 3.9 s with OMP_WAIT_POLICY=PASSIVE beside the same two simulations, and gave the same
    report bit for bit (the policy says how an idle thread waits, not how work is split or summed). A value the
    user set wins."""
    return {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def never_clipped(config: dict[str, Any]) -> bool:
    """A run with this resolved config clips nothing, so `--clip on` and `--clip off` make the same run.

    Its only uploads are full-width unit prototypes (nothing federated, no CPS masks, no ERPA anchors): every
    row has norm 1, so from round 2 on the radius is 10 x median norm = 10 (protofl/algorithms/robust.py),
    round 1's is 1e4, and two unit vectors lie at most 2 apart. An unclipped row within the radius is folded
    as sent with clipping on or off (tests/broker_server/test_clip_switch.py), so the runs are equal."""
    values = config_values(config) or {}
    return (
        values.get("federate") == "none"
        and values.get("prototypes") == "unit"
        and not values.get("cps")
        and not values.get("erpa")
    )


def git_info() -> dict[str, Any]:
    def git(*a: str) -> str | None:
        try:
            out = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    rev = git("rev-parse", "--short", "HEAD")
    # The results themselves change while the suite runs; they do not make the code that ran dirty.
    outside_results = ("--", ".", ":(exclude)bench/results")
    tracked = git("status", "--porcelain", "--untracked-files=no", *outside_results)
    untracked = git("status", "--porcelain", *outside_results)
    n_tracked = len(tracked.splitlines()) if tracked else 0
    n_all = len(untracked.splitlines()) if untracked else 0
    return {
        "rev": rev or "unknown",
        "dirty": bool(n_all),
        "modified_tracked": n_tracked,
        "untracked": n_all - n_tracked,
    }


class Runner:
    def __init__(
        self,
        suite: str,
        run_root: Path,
        data_dir: str | None,
        jobs: int,
        verbose: bool = True,
        backend_args: list[str] | None = None,
    ) -> None:
        self.suite = suite
        # Where the runs' devices run (`--backend ray ...`): added to each command, not part of the run (its
        # report is the same), so cached runs stay valid.
        self.backend_args = list(backend_args or [])
        self.run_root = run_root
        self.data_dir = data_dir
        self.jobs = max(1, jobs)
        self.verbose = verbose
        self.prefix = cli_prefix()
        self.git = git_info()
        self.children: set[subprocess.Popen] = set()
        self.lock = threading.Lock()
        self.stopping = False

    def path(self, run: Run) -> Path:
        return self.run_root / run.setting / f"{run.name}.json"

    def cached(self, run: Run) -> dict[str, Any] | None:
        """The cached report if it is finished and made by the current command and config, else None.

        An unclipped run that has not run itself is its clipped twin's run (same seed) where that one clipped
        nothing by construction (`never_clipped`); the report then says so under "same_as"."""
        rep = self.own_cached(run)
        if rep is not None or run.row.clip or (twin := twin_run(run)) is None:
            return rep
        rep = self.own_cached(twin)
        if rep is None or not never_clipped(rep.get("config") or {}) or not config_matches(rep, run, self.suite):
            return None
        return {**rep, "same_as": twin.key}

    def own_cached(self, run: Run) -> dict[str, Any] | None:
        """The report in the run's own cache file, if it is finished and made by the current command and config."""
        p = self.path(run)
        if not p.is_file():
            return None
        try:
            rep = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        if as_spelled_today(rep.get("bench", {}).get("args") or []) not in spellings(run, self.suite, self.data_dir):
            return None  # another command (a row's runs made as spelled then still need today's config, below)
        samples = test_samples(run, self.suite)
        if rep.get("simulation", {}).get("test_samples", samples) != samples:
            return None  # it scored another part of the test set than the table's columns mean
        if not config_matches(rep, run, self.suite):
            return None
        return rep

    def log(self, msg: str) -> None:
        if self.verbose:
            print(msg, flush=True)

    def execute(self, run: Run, index: int, total: int) -> bool:
        """Run one simulation through the CLI; cache its report atomically. True when it succeeded."""
        final = self.path(run)
        final.parent.mkdir(parents=True, exist_ok=True)
        stale = final.is_file()
        tmp = final.with_name(f".{final.stem}.{os.getpid()}.partial.json")
        args = run_args(run, self.suite, self.data_dir)
        cmd = self.prefix + args + self.backend_args + ["--json", str(tmp)]
        shown = "protofl-server " + shlex.join(args)
        why = " (stale cache: command or config changed)" if stale else ""
        self.log(f"[{index}/{total}] {run.key}{why}\n    {shown}")
        started = time.time()
        git = git_info()  # the revision this run's CLI loads (the tree may change during a long suite)
        with self.lock:
            if self.stopping:
                return False
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
                env=sim_env(),
            )
            self.children.add(proc)
        try:
            out, err = proc.communicate()
        except BaseException:  # interrupted (Ctrl-C, SIGTERM): stop the simulation, leave no file behind
            self._kill(proc)
            tmp.unlink(missing_ok=True)
            raise
        finally:
            with self.lock:
                self.children.discard(proc)
        wall = time.time() - started
        fail_log = final.with_suffix(".failed.txt")
        if proc.returncode != 0 or not tmp.is_file():
            tmp.unlink(missing_ok=True)
            if self.stopping:
                return False
            fail_log.write_text(
                f"$ {shown}\nexit {proc.returncode} after {wall:.0f} s\n--- stderr ---\n{err[-4000:]}"
                f"\n--- stdout ---\n{out[-2000:]}"
            )
            self.log(f"    FAILED (exit {proc.returncode}, {wall:.0f} s); see {fail_log}")
            return False
        rep = json.loads(tmp.read_text())
        rep["bench"] = {
            "suite": self.suite,
            "setting": run.setting,
            "run": run.name,
            "label": run.label,
            "args": args,
            "command": shown,
            "cli_wall_s": round(wall, 1),
            **({"backend_args": self.backend_args} if self.backend_args else {}),
            "finished_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
            "git_rev": git["rev"],
            "git_dirty": git["dirty"],
        }
        tmp2 = final.with_name(f".{final.stem}.{os.getpid()}.final.json")
        tmp2.write_text(json.dumps(rep, indent=1))
        os.replace(tmp2, final)
        tmp.unlink(missing_ok=True)
        fail_log.unlink(missing_ok=True)
        last = rep["rounds"][-1] if rep["rounds"] else {}
        self.log(
            f"    done in {wall:.0f} s: local {table_report.pct(last.get('local_acc'))}, global "
            f"{table_report.pct(last.get('global_acc'))}, ensemble {table_report.pct(last.get('ensemble_acc'))}, "
            f"uplink {rep['totals']['uplink_bytes'] / 1e6:.3f} MB"
        )
        return True

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        """Stop one simulation (its own process group, started by us) and reap it."""
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, PermissionError):
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            children = list(self.children)
        for p in children:
            self._kill(p)


def clean_partials(root: Path) -> None:
    """Remove temporary files that an interrupted earlier invocation left behind."""
    if root.is_dir():
        for p in root.glob("*/.*.partial.json"):
            p.unlink(missing_ok=True)
        for p in root.glob("*/.*.final.json"):
            p.unlink(missing_ok=True)


def backend_args(ns: argparse.Namespace, ap: argparse.ArgumentParser) -> list[str]:
    """The simulate options that put a run's devices on Ray (empty for the local backend)."""
    if ns.backend == "local":
        if ns.ray_address or ns.device_resources:
            ap.error("--ray-address and --device-resources need --backend ray")
        return []
    return (
        ["--backend", "ray"]
        + (["--ray-address", ns.ray_address] if ns.ray_address else [])
        + (["--device-resources", ns.device_resources] if ns.device_resources else [])
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.paper_table",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--suite", choices=("full", "quick"), default="quick")
    ap.add_argument("--only", default=None, help="comma list of settings to run (A,B,C,D,L); the table shows all")
    ap.add_argument(
        "--results",
        type=Path,
        default=None,
        help="results directory (default bench/results/<suite>; TABLE.md: bench/results/TABLE.md "
        "for full, <results>/TABLE.md otherwise)",
    )
    ap.add_argument(
        "--rows",
        default=None,
        help="comma list of row keys or shell patterns (B/fedproto, 'L/cps-*'): run only these rows",
    )
    ap.add_argument("--seeds", default=None, help="comma list of seeds: run only these seeds of the chosen rows")
    ap.add_argument("--jobs", type=int, default=1, help="simulations run at once (default 1: the CPU is shared)")
    ap.add_argument("--data-dir", default=None, help="where the Fashion-MNIST IDX files are (CLI default otherwise)")
    ap.add_argument(
        "--backend",
        choices=("local", "ray"),
        default="local",
        help="ray: every run's devices on Ray workers (simulate --backend ray; the report is the same)",
    )
    ap.add_argument("--ray-address", default=None, help="ray: the cluster to join (auto, host:port, ray://...)")
    ap.add_argument("--device-resources", default=None, help="ray: each worker's share, cpu=N[,gpu=N]")
    ap.add_argument("--table-only", action="store_true", help="run nothing; rewrite the table from the cache")
    ap.add_argument("--dry-run", action="store_true", help="print the commands that would run, and exit")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # test only: 1 round, tiny subsets
    ns = ap.parse_args(argv)

    sizing_key = "tiny" if ns.tiny else ns.suite
    if ns.results is not None:
        run_root = ns.results
        table_path = ns.results / "TABLE.md"
    else:
        run_root = RESULTS / sizing_key
        table_path = RESULTS / "TABLE.md" if sizing_key == "full" else run_root / "TABLE.md"
    runs_all = suite_runs(ns.suite)
    if ns.only:
        only = {s.strip().upper() for s in ns.only.split(",") if s.strip()}
        bad = only - set(SETTINGS)
        if bad:
            ap.error(f"--only: unknown setting(s) {sorted(bad)}; known: {', '.join(SETTINGS)}")
        runs = needed_for(only, runs_all)
    else:
        runs = runs_all
    if ns.rows:
        patterns = [p.strip() for p in ns.rows.split(",") if p.strip()]
        unknown = [p for p in patterns if not any(fnmatch.fnmatchcase(r.row.key, p) for r in runs_all)]
        if unknown:
            ap.error(f"--rows: no row matches {unknown}; rows are named like B/fedproto (see --dry-run)")
        runs = [r for r in runs if any(fnmatch.fnmatchcase(r.row.key, p) for p in patterns)]
    if ns.seeds:
        try:
            seeds = {int(x) for x in ns.seeds.split(",") if x.strip()}
        except ValueError:
            ap.error(f"--seeds: expected a comma list of integers, got {ns.seeds!r}")
        runs = [r for r in runs if r.seed in seeds]
    given = list(sys.argv[1:] if argv is None else argv)
    # The table names the command that produces the runs (a --table-only rewrite shows that command).
    argv_shown = "python -m bench.paper_table " + shlex.join([a for a in given if a not in ("--table-only",)])
    if ns.table_only:
        argv_shown += " (this file rewritten from the cache with --table-only)"

    runner = Runner(sizing_key, run_root, ns.data_dir, ns.jobs, backend_args=backend_args(ns, ap))
    ctx = table_report.Context(
        suite=ns.suite,
        sizing_key=sizing_key,
        run_root=run_root,
        table_path=table_path,
        command=argv_shown,
        git=runner.git,
        runs=runs_all,
        cached=runner.cached,
    )
    if ns.dry_run:
        for r in runs:
            rep = runner.cached(r)
            state = "to run" if rep is None else "= twin" if rep.get("same_as") else "cached"
            args = run_args(r, sizing_key, ns.data_dir) + runner.backend_args
            print(f"{r.key:32s} {state:7s} protofl-server {shlex.join(args)}")
        return 0
    if ns.table_only:
        table_report.write(ctx)
        print(f"table written to {table_path}")
        return 0

    run_root.mkdir(parents=True, exist_ok=True)
    clean_partials(run_root)
    todo = [r for r in runs if runner.cached(r) is None]
    print(
        f"{ns.suite} suite ({sizing_key} sizing): {len(runs)} runs, {len(runs) - len(todo)} cached, "
        f"{len(todo)} to run; results in {run_root}",
        flush=True,
    )

    def on_signal(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    started = time.time()
    failed = 0
    table_lock = threading.Lock()

    def one(item: tuple[int, Run]) -> bool:
        i, r = item
        ok = runner.execute(r, i, len(todo))
        if not runner.stopping:
            with table_lock:
                table_report.write(ctx, quiet=True)
        return ok

    pool = ThreadPoolExecutor(max_workers=ns.jobs) if ns.jobs > 1 else None
    try:
        if pool is None:
            results = [one((i, r)) for i, r in enumerate(todo, 1)]
        else:
            results = list(pool.map(one, enumerate(todo, 1)))
            pool.shutdown()
        failed = sum(not ok for ok in results)
    except KeyboardInterrupt:
        runner.stop()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        print("interrupted: finished runs are cached; rerun the same command to resume", flush=True)
        table_report.write(ctx, quiet=True)
        return 130
    table_report.write(ctx)
    print(
        f"{len(todo) - failed} run(s) finished, {failed} failed, in {time.time() - started:.0f} s; table: {table_path}",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

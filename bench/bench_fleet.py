"""A fleet of lightweight devices against the default secured `protofl-server start`: does every round close at
quorum with nothing lost, how fast, at what memory (issue 27).

    nice -n 10 python -m bench.bench_fleet --devices 1000 --rounds 3    # one run; JSON in bench/results/fleet/
    nice -n 10 python -m bench.bench_fleet --devices 50000 --sites 3    # devices beyond --core-max at bridged sites
    nice -n 10 python -m bench.bench_fleet --devices 10000 --rate       # the broker's own rate (C subscriber)
    python -m bench.bench_fleet --report                                # bench/results/FLEET.md from the JSONs

The server is `protofl-server start --preset tinyproto --state-dir DIR` (journal on, generated passwords and
ACL, its spawned Mosquitto), with `--devices` credentials for the core's devices and --min-clients the whole
fleet; `--shards N` is passed through where `start` has it. With sites, `protofl-server broker-config --bridge`
writes each site broker (its own devices' credentials, a bridge to the core) and `mosquitto -c` runs it: one
process's 20,000 descriptors cannot hold 50,000 connections. The devices are bench/fleet_devices.py processes
(asyncio, ~10,000 devices each), each device with its own credentials, will and presence, joining and
uploading each round as `protofl-edge join` does (2,221-byte tinyproto uploads).

Per run: round close at quorum (close - open, as rounds.jsonl records it), uploads/s (devices / that time),
peak RSS of the server, the core broker and the site brokers, losses (uploads the devices sent vs folded by
the server, its drop counters, the brokers' "dropped" log lines), the machine's load. `--rate`: the same
secured Mosquitto, the devices each publish one upload at once, and `mosquitto_sub` (Debian
mosquitto-clients, a C subscriber, as the server's user) receives them: uploads/s = N / (last - go).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "fleet"
FED = "fleet"
PRESET = "tinyproto"


def raise_open_files() -> int:
    """Soft open-file limit up to the hard one (children inherit it: the server, its broker, the sites)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def rss_mb(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


class Sampler:
    """Peak RSS per role and the load average, sampled every half second."""

    def __init__(self) -> None:
        self.pids: dict[str, list[int]] = {}
        self.peak: dict[str, float] = {}
        self.load: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def watch(self, role: str, pid: int) -> None:
        self.pids.setdefault(role, []).append(pid)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for role, pids in list(self.pids.items()):
                self.peak[role] = max(self.peak.get(role, 0.0), sum(rss_mb(p) for p in pids))
            self.load.append(float(Path("/proc/loadavg").read_text().split()[0]))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)


def cli(
    *args: str, log: Path | None = None, tree: Path = REPO, python: str = sys.executable
) -> subprocess.Popen[bytes]:
    """`python -m ARGS` of `tree` (run from it: `-m` puts the working directory first on the path)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = log.open("ab") if log is not None else subprocess.DEVNULL
    return subprocess.Popen(
        [python, "-m", *args], stdout=out, stderr=subprocess.STDOUT, env=env, stdin=subprocess.PIPE, cwd=tree
    )


def wait_for(pred: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def split(devices: int, sites: int | None, core_max: int) -> list[int]:
    """Devices on the core, then on each site: the core holds up to core_max, sites share the rest evenly."""
    if sites is None:
        sites = 0 if devices <= core_max else math.ceil((devices - core_max) / core_max)
    if sites == 0:
        return [devices]
    core = min(core_max, devices // (sites + 1)) if devices > core_max else devices // (sites + 1)
    rest = devices - core
    return [core] + [rest // sites + (1 if i < rest % sites else 0) for i in range(sites)]


def spawn_generators(work: Path, devices: list[list[Any]], per_process: int) -> list[subprocess.Popen[str]]:
    procs = []
    for i in range(0, len(devices), per_process):
        spec = work / f"generator-{i // per_process}.json"
        spec.write_text(json.dumps({"fed": FED, "preset": PRESET, "seed": i, "devices": devices[i : i + per_process]}))
        env = dict(os.environ, PYTHONPATH=str(REPO))
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "bench.fleet_devices", str(spec)],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def read_event(proc: subprocess.Popen[str], event: str, timeout: float) -> dict[str, Any]:
    assert proc.stdout is not None
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"generator {proc.pid} exited (rc {proc.poll()}) before '{event}'")
        got = json.loads(line)
        if got["event"] == event:
            return got
    raise TimeoutError(f"generator {proc.pid}: no '{event}' within {timeout:.0f} s")


def cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return 0


def wait_server(server: subprocess.Popen[bytes], progress: list[Path], stall: float, timeout: float) -> bool:
    """Wait for the server to exit; True if for `stall` s nothing it writes changed and it used no CPU (a busy
    server may log nothing for minutes while a join burst drains), or `timeout` passed."""

    def mark() -> tuple[float, ...]:
        busy = cpu_ticks(server.pid) // 100  # a second of CPU since the last look counts as progress
        return (*(p.stat().st_mtime if p.exists() else 0.0 for p in progress), busy)

    end, last, since = time.monotonic() + timeout, mark(), time.monotonic()
    while server.poll() is None:
        now = time.monotonic()
        if (m := mark()) != last:
            last, since = m, now
        if now - since > stall or now > end:
            return True
        time.sleep(1)
    return False


def final_counts(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """A generator's last report (zeros, with the reason, if it died without one)."""
    try:
        return read_event(proc, "done", 120)
    except (RuntimeError, TimeoutError) as exc:
        return {"uploads": {}, "resent": 0, "disconnected": 0, "joins": 0, "errors": {str(exc): 1}}


def dropped_lines(*logs: Path) -> int:
    n = 0
    for log in logs:
        if log.exists():
            n += sum(1 for line in log.read_text(errors="replace").splitlines() if "dropped" in line.lower())
    return n


def federate(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from broker_server.ops.broker import free_port

    shares = split(args.devices, args.sites, args.core_max)
    state = work / "state"
    core_port = free_port()
    sampler = Sampler()
    sites: list[tuple[str, int, Path]] = []
    for i, n in enumerate(shares[1:]):
        site, port, out = f"site-{i + 1}", free_port(), work / f"site-{i + 1}"
        made = subprocess.run(
            [
                sys.executable,
                "-m",
                "broker_server.cli",
                "broker-config",
                "--bridge",
                site,
                "--fed",
                FED,
                "--core",
                f"mqtt://127.0.0.1:{core_port}",
                "--core-dir",
                str(state / "security"),
                "--out",
                str(out),
                "--devices",
                str(n),
                "--listen",
                f"127.0.0.1:{port}",
                "--tls",
                "off",
            ],
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
        )
        if made.returncode != 0:
            raise RuntimeError(made.stdout + made.stderr)
        sites.append((site, port, out))
    server_log = work / "server.log"
    start = [
        "broker_server.cli",
        "start",
        "--preset",
        PRESET,
        "--fed",
        FED,
        "--port",
        str(core_port),
        "--devices",
        str(shares[0]),
        "--min-clients",
        str(args.devices),
        "--rounds",
        str(args.rounds),
        "--round-timeout",
        str(args.round_timeout),
        "--state-dir",
        str(state),
    ]
    if args.shards:
        start += ["--shards", str(args.shards)]
    t_start = time.perf_counter()
    server = cli(*start, log=server_log, tree=args.server_tree, python=args.server_python)
    sampler.watch("server", server.pid)
    site_procs: list[subprocess.Popen[bytes]] = []
    generators: list[subprocess.Popen[str]] = []
    try:
        wait_for(
            lambda: "waiting for" in server_log.read_text(errors="replace") or server.poll() is not None,
            600,
            "the server to start",
        )
        if server.poll() is not None:
            raise RuntimeError(server_log.read_text()[-3000:])
        server_ready_s = time.perf_counter() - t_start
        broker_pid = int((state / "broker" / "mosquitto.pid").read_text())
        sampler.watch("core broker", broker_pid)
        for pid in children(server.pid):  # shard processes, if any: the server's share of memory
            if comm(pid) != "mosquitto":
                sampler.watch("server", pid)
        mosquitto = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        for _, _, out in sites:
            with (out / "mosquitto.log").open("ab") as log:
                p = subprocess.Popen(
                    [mosquitto, "-c", str(out / "mosquitto.conf")], stdout=log, stderr=subprocess.STDOUT
                )
            site_procs.append(p)
            sampler.watch("site brokers", p.pid)
        for _, _, out in sites:
            wait_for(lambda out=out: "Connecting bridge" in (out / "mosquitto.log").read_text(), 30, "a site broker")
        sampler.start()
        creds = json.loads((state / "security" / "credentials.json").read_text())["devices"]
        where: dict[str, tuple[str, int]] = {f"device-{i}": ("127.0.0.1", core_port) for i in range(1, shares[0] + 1)}
        for (site, port, _), n in zip(sites, shares[1:], strict=True):
            where.update({f"{site}-device-{i}": ("127.0.0.1", port) for i in range(1, n + 1)})
        devices = [[cid, creds[cid], host, port] for cid, (host, port) in where.items()]
        t0 = time.perf_counter()
        generators = spawn_generators(work, devices, args.per_process)
        for g in generators:
            sampler.watch("generators", g.pid)
        connected = [read_event(g, "connected", 900) for g in generators]
        connect_s = time.perf_counter() - t0
        stalled = wait_server(server, [server_log, state / "rounds.jsonl"], args.stall, args.timeout)
        wall = time.perf_counter() - t0
        if stalled:
            server.terminate()  # a clean stop: its log says where it was
            server.wait(60)
            for g in generators:
                g.terminate()
        done = [final_counts(g) for g in generators]
    finally:
        sampler.stop()
        procs: list[subprocess.Popen[Any]] = [*generators, server, *site_procs]  # text and bytes pipes
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
    jsonl = state / "rounds.jsonl"
    rounds = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()] if jsonl.exists() else []
    log_text = server_log.read_text(errors="replace")
    sent = sum(sum(d["uploads"].values()) for d in done)
    folded = sum(len(r["clients"]) for r in rounds)
    return {
        "kind": "federate",
        "devices": args.devices,
        "shares": shares,
        "sites": len(sites),
        "shards": args.shards or 1,
        "rounds": [
            {
                "round": r["round"],
                "clients": len(r["clients"]),
                "closed_by": r["closed_by"],
                "close_s": round(r["ended"] - r["started"], 3),
                "uploads_per_s": round(len(r["clients"]) / max(r["ended"] - r["started"], 1e-9), 1),
                "uplink_bytes": r["uplink_bytes"],
            }
            for r in rounds
        ],
        "finished": "finished:" in log_text or f"round {args.rounds}/{args.rounds}" in log_text,
        "stalled_s": args.stall if stalled else None,
        "joins_seen_by_server": sum(1 for line in log_text.splitlines() if " joined (" in line),
        "joins_sent": sum(d["joins"] for d in done),
        "server_tail": [line for line in log_text.splitlines() if "finished" in line or "dropped" in line][-3:],
        "uploads_sent": sent,
        "uploads_folded": folded,
        "resent": sum(d["resent"] for d in done),
        "asked_again": {
            "joins": sum(d.get("asked_join", 0) for d in done),
            "uploads": sum(d.get("asked_uploads", 0) for d in done),
        },
        "connected": sum(c["connected"] for c in connected),
        "connect_failed": sum(c["connect_failed"] for c in connected),
        "disconnected": sum(d["disconnected"] for d in done),
        "generator_errors": merge([d["errors"] for d in done]),
        "broker_dropped_lines": dropped_lines(
            state / "broker" / "mosquitto.log", *(out / "mosquitto.log" for _, _, out in sites)
        ),
        "server_ready_s": round(server_ready_s, 1),
        "connect_s": round(connect_s, 1),
        "wall_s": round(wall, 1),
        "rss_mb": {k: round(v, 1) for k, v in sampler.peak.items()},
        "generator_processes": len(generators),
        "load_avg": {
            "max": max(sampler.load, default=0.0),
            "mean": round(sum(sampler.load) / max(len(sampler.load), 1), 2),
        },
    }


def merge(dicts: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def broker_rate(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The secured Mosquitto `start` spawns (generated passwords and ACL): C publishers (mosquitto_pub, one per
    --publishers, each a device sending messages of the upload's size) to one C subscriber (mosquitto_sub as
    the server's user, QoS 1 both ways). Uploads/s = N / (last received - first sent)."""
    import numpy as np

    from bench.fleet_devices import upload_body
    from broker_server.ops.broker import MosquittoBroker
    from broker_server.ops.security import prepare
    from protofl.presets import make_config
    from protofl.wire.codec import WIRE_VERSION, Envelope, pack_envelope

    ids = [f"device-{i}" for i in range(1, args.publishers + 1)]
    auth = prepare(work / "security", FED, ids)
    broker = MosquittoBroker(
        port=0,
        workdir=work / "broker",
        allow_anonymous=False,
        max_queued_messages=max(10000, args.devices),
        extra_config=auth.mosquitto_lines()[1:],
    ).start()
    body = upload_body(make_config(PRESET), np.random.default_rng(0))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        server = auth.secrets.server
        sub = subprocess.Popen(
            [
                "mosquitto_sub",
                "-h",
                "127.0.0.1",
                "-p",
                str(broker.port),
                "-u",
                server.username,
                "-P",
                server.password,
                "-t",
                f"protofl/{FED}/up/+",
                "-q",
                "1",
                "-C",
                str(args.devices),
            ],
            stdout=subprocess.DEVNULL,
        )
        procs.append(sub)
        wait_for(
            lambda: f"as {server.username}" in broker.log_path.read_text(errors="replace"),
            30,
            "mosquitto_sub to connect",
        )
        time.sleep(0.5)  # its SUBSCRIBE follows its CONNECT; the broker logs only the latter
        per = args.devices // len(ids)
        # The real upload's size; its bytes are not line-safe, and a broker does not look at them. `-l` sends one
        # message per stdin line with up to -M in flight (`--repeat` waits for each one: a slow publisher).
        size = len(pack_envelope(Envelope(WIRE_VERSION, "protos", FED, 1, "train", ids[0], "bench", body)))
        line = b"x" * size + b"\n"
        files = []
        for i, cid in enumerate(ids):
            n = per + (args.devices - per * len(ids) if i == 0 else 0)
            files.append(work / f"{cid}.txt")
            files[-1].write_bytes(line * n)
        t0 = time.perf_counter()
        for cid, lines in zip(ids, files, strict=True):
            with lines.open("rb") as stdin:
                procs.append(
                    subprocess.Popen(
                        [
                            "mosquitto_pub",
                            "-h",
                            "127.0.0.1",
                            "-p",
                            str(broker.port),
                            "-u",
                            cid,
                            "-P",
                            auth.secrets.devices[cid],
                            "-t",
                            f"protofl/{FED}/up/{cid}",
                            "-q",
                            "1",
                            "-l",
                            "-M",
                            "1000",
                        ],
                        stdin=stdin,
                    )
                )
        sub.wait(600)
        secs = time.perf_counter() - t0
        broker_rss = rss_mb(broker.proc.pid if broker.proc else None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        broker.cleanup()
    return {
        "kind": "rate",
        "devices": args.devices,
        "publishers": len(ids),
        "upload_bytes": size,
        "seconds": round(secs, 3),
        "uploads_per_s": round(args.devices / secs, 1),
        "broker_rss_mb": round(broker_rss, 1),
    }


def server_setup(tree: Path = REPO, python: str = sys.executable) -> dict[str, Any]:
    """The server's reader path, log level (start without -v: its aggregator logs at WARNING) and versions."""
    from bench.bench_aggregator import server_setup as setup

    info = setup(tree, PRESET, "fast", python)  # as installed: msgspec's reader where the `fast` extra is importable
    info["log_level"] = "warning"
    return info


def setup_cell(r: dict[str, Any]) -> str:
    info = r.get("machine", {}).get("setup")
    if not info:
        return "not recorded"
    from bench.bench_aggregator import setup_label

    return setup_label(info)


def machine(tree: Path = REPO, python: str = sys.executable) -> dict[str, Any]:
    return {
        "setup": server_setup(tree, python),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_before": Path("/proc/loadavg").read_text().split()[:3],
        "commit": git_head(),
        "mem_total_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }


def git_head() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return ""


def row(r: dict[str, Any]) -> str:
    if r["kind"] == "rate":
        return (
            f"| broker only (mosquitto_pub to mosquitto_sub) | {r['devices']:,} | - | - | "
            f"{r['uploads_per_s']:,.0f} | - | {r['broker_rss_mb']:.0f} MB | - | - | {r['commit']} | "
            f"{setup_cell(r)} |"
        )
    rounds = r["rounds"]
    closes = [x["close_s"] for x in rounds]
    rates = [x["uploads_per_s"] for x in rounds]
    where = f"core {r['shares'][0]:,}" + (f" + {r['sites']} sites x ~{r['shares'][1]:,}" if r["sites"] else "")
    if not rounds:
        return (
            f"| {where}, {r['shards']} shard(s) | "
            f"{r['devices']:,} | never (stalled: {r['joins_seen_by_server']:,} of {r['joins_sent']:,} joins "
            f"reached the server) | - | - | {r['rss_mb'].get('server', 0):.0f} MB | "
            f"{r['rss_mb'].get('core broker', 0):.0f} MB | {r['broker_dropped_lines']} broker drop lines | "
            f"{r['load_avg']['mean']:.1f} | {r['commit']} | {setup_cell(r)} |"
        )
    quorum = (
        all(x["closed_by"] == "quorum" and x["clients"] == r["devices"] for x in rounds)
        and len(rounds) == r["rounds_asked"]
    )
    lost = r["uploads_sent"] - r["uploads_folded"]
    losses = (
        "none"
        if lost == 0 and r["broker_dropped_lines"] == 0 and r["connect_failed"] == 0
        else f"{lost} uploads not folded, {r['broker_dropped_lines']} broker drop lines, "
        f"{r['connect_failed']} never connected"
    )
    rss = r["rss_mb"]
    alone = f"{r['broker_rate']['uploads_per_s']:,.0f}" if r.get("broker_rate") else "-"
    brokers = f"{rss.get('core broker', 0):.0f} MB"
    if r["sites"]:
        brokers += f" + sites {rss.get('site brokers', 0):.0f} MB"
    return (
        f"| {where}, {r['shards']} shard(s) | {r['devices']:,} | "
        f"{min(closes):.2f}-{max(closes):.2f} s{'' if quorum else ' (NOT all at quorum)'} | "
        f"{min(rates):,.0f}-{max(rates):,.0f} | {alone} | {rss.get('server', 0):.0f} MB | {brokers} | {losses} | "
        f"{r['load_avg']['mean']:.1f} (max {r['load_avg']['max']:.1f}) | {r['commit']} | {setup_cell(r)} |"
    )


def write_report(out: Path) -> None:
    runs = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))]
    runs.sort(key=lambda r: (r["kind"] != "federate", r["devices"], r.get("sites", 0), r.get("shards", 1)))
    lines = [
        "# A fleet of devices against one server (bench/bench_fleet.py)",
        "",
        "Generated by `python -m bench.bench_fleet --report` from bench/results/fleet/*.json; each run's command is",
        "listed below the table. Server: `protofl-server start --preset tinyproto --state-dir` (journal with",
        "group commit, generated passwords and ACL, its spawned Mosquitto 2.0.11, loopback, no TLS); devices:",
        "bench/fleet_devices.py (asyncio, ~10,000 per process), each with its own credentials, will and presence,",
        "joining and sending one 2,221-byte tinyproto upload per round. Round close = close - open of each round",
        "as rounds.jsonl records it; uploads/s = devices / that. RSS: peak, sampled every 0.5 s (server: its",
        "process and any shard processes). Load: the 1-minute load average during the run (2 cores, shared with",
        "other sessions' tests and benchmarks, so figures are noisy).",
        "",
        "| setup | devices | round close at quorum | uploads/s | broker alone | server RSS | broker RSS | losses "
        "| load | commit | reader, log level, versions |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(row(r) for r in runs),
        "",
    ]
    notes = RESULTS / "notes.md"  # what the runs showed, in words (kept by hand beside the JSONs)
    if notes.exists():
        lines += [notes.read_text().strip(), ""]
    lines += [
        "## Runs",
        "",
    ]
    for r in runs:
        lines.append(
            f"- `{r['command']}` ({r['date']}): "
            + (
                f"{r['uploads_per_s']:,.0f} uploads/s, {r['seconds']} s"
                if r["kind"] == "rate"
                else f"rounds {[(x['round'], x['clients'], x['closed_by'], x['close_s']) for x in r['rounds']]}, "
                f"sent {r['uploads_sent']:,} folded {r['uploads_folded']:,} re-sent {r['resent']} (asked again by the "
                f"server: {r.get('asked_again', {})}), connected "
                f"{r['connected']:,} in {r['connect_s']} s ({r['generator_processes']} generator processes), "
                f"server ready in {r['server_ready_s']} s, wall {r['wall_s']} s, RSS {r['rss_mb']}, "
                f"generator errors {r['generator_errors'] or 'none'}"
            )
        )
    out.write_text("\n".join(lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--sites",
        type=int,
        default=None,
        help="bridged site brokers (default: as many as the devices beyond --core-max need)",
    )
    p.add_argument("--core-max", type=int, default=15000, help="devices on the core broker at most")
    p.add_argument("--per-process", type=int, default=10000, help="devices per generator process")
    p.add_argument("--shards", type=int, default=0, help="start --shards N (where start has it)")
    p.add_argument("--round-timeout", type=float, default=900.0)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--stall", type=float, default=180.0, help="stop a run whose server wrote nothing for this long")
    p.add_argument(
        "--rate",
        action="store_true",
        help="the broker's own rate to a C subscriber instead: --devices "
        "uploads from --publishers mosquitto_pub processes",
    )
    p.add_argument("--publishers", type=int, default=2)
    p.add_argument("--with-rate", action="store_true", help="also measure the broker's own rate right after the run")
    p.add_argument("--label", default=None, help="result file name (default from the setup)")
    p.add_argument(
        "--server-tree",
        type=Path,
        default=REPO,
        help="the tree whose `start` serves the fleet (another revision's worktree: its server measured with this "
        "tree's devices, brokers and clock; the row's setup names its revision)",
    )
    p.add_argument(
        "--server-python",
        default=sys.executable,
        help="the interpreter of --server-tree (a venv with that tree installed: its own technique entry points)",
    )
    p.add_argument("--report", action="store_true", help="write bench/results/FLEET.md from the saved runs")
    args = p.parse_args()
    args.server_tree = args.server_tree.resolve()
    if args.report:
        write_report(REPO / "bench" / "results" / "FLEET.md")
        return
    raise_open_files()
    before = machine(args.server_tree, args.server_python)
    # The work directory (tens of thousands of credentials files) goes only after the result is saved: removing it
    # takes minutes on a loaded disk.
    tmp = tempfile.mkdtemp(prefix=".bench-fleet-", dir=REPO)
    try:
        result = broker_rate(args, Path(tmp)) if args.rate else federate(args, Path(tmp))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    save(args, result, before)
    shutil.rmtree(tmp, ignore_errors=True)
    if not args.rate and args.with_rate:  # the broker's own rate right after, on the same machine and load
        with tempfile.TemporaryDirectory(prefix=".bench-fleet-", dir=REPO) as tmp:
            same = argparse.Namespace(**{**vars(args), "devices": min(args.devices, 20000)})
            result["broker_rate"] = broker_rate(same, Path(tmp))
        save(args, result, before)


def save(args: argparse.Namespace, result: dict[str, Any], before: dict[str, Any]) -> None:
    result.update(
        command="python -m bench.bench_fleet " + " ".join(sys.argv[1:]),
        machine=before,
        load_after=Path("/proc/loadavg").read_text().split()[:3],
        commit=before["commit"],
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        rounds_asked=args.rounds,
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    label = args.label or "-".join(
        [
            ("rate" if args.rate else "fleet"),
            str(args.devices),
            *([f"sites{result['sites']}"] if result.get("sites") else []),
            *([f"shards{args.shards}"] if args.shards else []),
        ]
    )
    (RESULTS / f"{label}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(row(result))


if __name__ == "__main__":
    main()

"""A lite device's memory and time beside a torch device's, on a real federation (issue 57): writes
bench/results/LITE.md.

A real server (`protofl-server start`, its own Mosquitto, the default preset: its ridge predictor, the backbone trained
on Fashion-MNIST's public set in the server's torch child process, which also ships the backbone's ONNX graph) and
two real devices as separate processes on the same own data (the first --images Fashion-MNIST training images, 25 %
held out): one lite `protofl-edge join` in a process whose imports of torch fail (as where only
`pip install 'protofl-edge[lite]'` is installed), one torch `join`. This script samples each device's
/proc/PID/status every 50 ms (VmHWM: the kernel's peak of the resident set, so no spike is missed).

With --lite-venv DIR (a fresh `python -m venv DIR && DIR/bin/pip install -c constraints.txt '.[lite]'`): the lite
device runs from that venv's interpreter instead (its own installed packages, no torch at all), and the venv's size
(du) and whether torch is in it are reported. With --arm64 the lite device runs under qemu-aarch64 in the arm64
system of bench/arm64_system.sh (`sudo bash bench/arm64_system.sh lite` builds it), its /opt/protofl/lite venv.

    python -m bench.bench_lite [--images 2400] [--lite-venv /tmp/litevenv] [--arm64] [--out bench/results/LITE.md]
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
from pathlib import Path
from typing import Any

from bench.bench_footprint import cpu_name, free_port, own_data, status_kb

REPO = Path(__file__).resolve().parents[1]
BLOCK = """
import importlib, importlib.abc, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "torchvision", "onnxscript"):
            raise ImportError(f"{name} is blocked: a lite device has no torch", name=name)
sys.meta_path.insert(0, Blocker())
from edge_agent.cli import app
app(sys.argv[1:], prog_name="protofl-edge")
"""
ARM64_ROOT = Path(os.environ.get("PROTOFL_ARM64_ROOT", "/var/cache/protofl/arm64"))


def device_argv(lite: bool, args: argparse.Namespace, join: list[str]) -> list[str]:
    if not lite:
        return [sys.executable, "-m", "edge_agent.cli", *join]
    if args.arm64:
        return ["bash", str(REPO / "bench" / "arm64_system.sh"), "run", "/opt/protofl/lite/bin/protofl-edge", *join]
    python = str(Path(args.lite_venv) / "bin" / "python") if args.lite_venv else sys.executable
    return [python, "-c", BLOCK, *join]


def qemu_pid(parent: int) -> int | None:
    """Under --arm64 the device is a qemu-aarch64 process below the script: its pid (the one whose memory counts)."""
    out = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout.splitlines()[1:]
    rows = [(int(r.split(None, 2)[0]), int(r.split(None, 2)[1]), r.split(None, 2)[2]) for r in out if r.strip()]
    todo, seen = [parent], set()
    while todo:
        p = todo.pop()
        for pid, ppid, cmd in rows:
            if ppid == p and pid not in seen:
                seen.add(pid)
                if "protofl-edge" in cmd and "arm64_system" not in cmd:
                    return pid
                todo.append(pid)
    return None


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    port, fed = free_port(), "lite-bench"
    server = subprocess.Popen(
        [sys.executable, "-m", "broker_server.cli", "start", "--min-clients", "2", "--rounds", str(args.rounds),
         "--insecure", "--port", str(port), "--fed", fed, "--public-data", "fashion-mnist",
         "--state-dir", str(work / "server"), "--round-timeout", "3600"],
        env=env, stdout=open(work / "server.log", "wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    procs: dict[str, subprocess.Popen[bytes]] = {}
    t0 = time.time()
    for kind in ("lite", "torch"):
        join = ["join", "--broker", f"mqtt://127.0.0.1:{port}", "--fed", fed, "--client-id", f"dev-{kind}",
                "--data", f"npz:{args.npz}", "--threads", "1", "--connect-timeout", "1800"]  # fmt: skip
        dev_env = env if kind == "torch" or not args.lite_venv else {**env, "PYTHONPATH": ""}
        if kind == "lite" and args.lite_venv:  # the venv's own protofl-edge, not this tree's on the path
            join_argv = [str(Path(args.lite_venv) / "bin" / "protofl-edge"), *join]
        else:
            join_argv = device_argv(kind == "lite", args, join)
        procs[kind] = subprocess.Popen(
            join_argv, env=dev_env, stdout=open(work / f"{kind}.log", "wb"), stderr=subprocess.STDOUT
        )
    peak = {k: 0 for k in procs}
    ended: dict[str, float] = {}
    try:
        while any(p.poll() is None for p in procs.values()):
            for kind, p in procs.items():
                if p.poll() is not None:
                    ended.setdefault(kind, time.time() - t0)
                    continue
                pid = qemu_pid(p.pid) if kind == "lite" and args.arm64 else p.pid
                st = status_kb(pid) if pid is not None else {}
                peak[kind] = max(peak[kind], st.get("VmHWM", 0))
            if time.time() - t0 > args.timeout:
                raise TimeoutError(f"the devices did not finish within {args.timeout} s")
            time.sleep(0.05)
    finally:
        for p in (*procs.values(), server):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    for kind in procs:
        ended.setdefault(kind, time.time() - t0)
    logs = {k: (work / f"{k}.log").read_text(errors="replace") for k in procs}
    codes = {k: p.returncode for k, p in procs.items()}
    return {"peak_mb": {k: v / 1024 for k, v in peak.items()}, "codes": codes, "wall_s": ended,
            "logs": {k: v[-1500:] for k, v in logs.items()},
            "server_log": (work / "server.log").read_text(errors="replace")[-1500:]}  # fmt: skip


def venv_size(venv: str) -> dict[str, Any]:
    du = subprocess.run(["du", "-sb", venv], capture_output=True, text=True).stdout.split()[0]
    freeze = subprocess.run([str(Path(venv) / "bin" / "pip"), "freeze"], capture_output=True, text=True).stdout
    return {"bytes": int(du), "torch": any(ln.lower().startswith("torch") for ln in freeze.splitlines()),
            "packages": [ln for ln in freeze.splitlines() if not ln.startswith("protofl-edge")]}  # fmt: skip


def report(res: dict[str, Any], args: argparse.Namespace, cmd: str) -> str:
    load = os.getloadavg()
    where = "qemu-aarch64 (the arm64 system of bench/arm64_system.sh)" if args.arm64 else platform.machine()
    lines = [
        "# LITE: a lite device (no torch) beside a torch device (issue 57)",
        "",
        f"Measured by `{cmd}` on {cpu_name()} (2 cores, shared with other sessions: loaded, load average "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end), Python {platform.python_version()}; the lite "
        f"device on {where}. One real `protofl-server start` (its Mosquitto; the default preset `protofl`, its ridge "
        f"predictor; `--public-data fashion-mnist`: the cnn backbone trained on the public set in its torch child "
        f"process, which ships its ONNX graph too), {args.rounds} round(s), and two real `protofl-edge join "
        f"--data npz:own.npz --threads 1` processes on the same own data (the first {args.images} Fashion-MNIST "
        f"training images of Debian's package, 25 % held out): a lite one (torch unimportable"
        + (f"; from the fresh venv {args.lite_venv}" if args.lite_venv else "; this tree, torch blocked")
        + ") and a torch one. Peak resident memory: /proc/PID/status VmHWM sampled every 50 ms (the kernel's "
        "peak), MB = MiB. Wall: from the devices' start to their exit (the server's backbone training and the "
        "torch device's round included).",
        "",
        "| device | peak RSS (MB) | wall (s) | exit |",
        "|---|---:|---:|---:|",
    ]
    for kind in ("lite", "torch"):
        lines.append(f"| {kind} | **{res['peak_mb'][kind]:.0f}** | {res['wall_s'][kind]:.0f} | {res['codes'][kind]} |")
    if "venv" in res:
        v = res["venv"]
        lines += [
            "",
            f"The lite install: a fresh venv (`python3 -m venv {args.lite_venv} && pip install -c constraints.txt "
            f"'.[lite]'`, x86-64 wheels): {v['bytes'] / 1e6:.0f} MB on disk (du, pip itself included), torch "
            f"{'INSTALLED' if v['torch'] else 'not installed'}: {', '.join(v['packages'])}.",
        ]
    for kind in ("lite", "torch"):
        if res["codes"][kind] != 0:
            lines += ["", f"{kind} device's last lines:", "", "```", res["logs"][kind], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2400)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--lite-venv", default=None, help="Run the lite device from this venv (pip install '.[lite]').")
    ap.add_argument("--arm64", action="store_true", help="The lite device under qemu-aarch64 (arm64_system.sh).")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "LITE.md"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cmd = "python -m bench.bench_lite " + " ".join(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="protofl-lite-") as tmp:
        work = Path(tmp)
        args.npz = own_data(work, args.images)
        res = run(args, work)
    if args.lite_venv:
        res["venv"] = venv_size(args.lite_venv)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    text = report(res, args, cmd.strip())
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()

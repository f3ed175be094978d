"""The device agent's memory, measured on a real `join` (issue 44): writes bench/results/FOOTPRINT.md.

Per built-in architecture and preset: a real server (`protofl-server start`, its own local Mosquitto) and one
real device (`protofl-edge join -v`, Fashion-MNIST's own training images cut to --train-limit, its own test split),
as separate processes. The device logs its resident set at the end of each phase (edge_agent/core/memory.py: imports,
connect, data, model, then per round training, uploads, evaluation) and this script samples its /proc/PID/status
every 50 ms as well (VmHWM, the kernel's peak, and VmPeak, the address space). The breakdown is the growth of the
peak across the phases; the optimiser's and gradients' share is computed (one float32 per trained parameter each:
momentum buffer and gradient), not measured apart.

Also the installed size of each extra: the files pip installed for every distribution the extra pulls in (its
dependency closure, from this interpreter's site-packages: importlib.metadata's RECORD), base install included.

    python -m bench.bench_footprint [--archs cnn,mlp,resnet8,mobilenetv2,resnet18] [--presets protofl,fedavg,fedproto]
        [--images 2400] [--rounds 1] [--threads 1] [--out bench/results/FOOTPRINT.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
MARK = re.compile(r"memory after (\w+): resident ([\d.]+) MB, peak ([\d.]+) MB")
PHASES = ("imports", "connect", "data", "model", "training", "uploads", "evaluation")
EXTRAS = ("device", "onnx", "torchvision", "fast", "amqtt", "plotting", "ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def status_kb(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmHWM", "VmRSS", "VmPeak", "VmSize", "RssAnon", "RssFile"):
                    out[k] = int(v.split()[0])
    except OSError:
        pass
    return out


def trained_params(arch: str) -> tuple[int, int]:
    """(parameters of the device's model, bytes of one float32 per parameter) for the cnn-sized default config."""
    from edge_agent.training.models import build_model

    model = build_model(arch, (1, 28, 28), 10)
    n = sum(p.numel() for p in model.parameters())
    return n, 4 * n


def own_data(where: Path, n: int) -> Path:
    """A device's own data: the first `n` Fashion-MNIST training images as an npz without a test split (the
    device holds 25 % out for its own accuracy, as `join` does with a user's data)."""
    import numpy as np

    from protofl.data import load_dataset

    train, _ = load_dataset("fashion-mnist")
    path = where / "own.npz"
    np.savez(path, x=train.x[:n], y=train.y[:n])
    return path


def one_run(arch: str, preset: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    port = free_port()
    fed = f"fp-{arch}-{preset}"
    where = work / fed
    where.mkdir(parents=True, exist_ok=True)
    server = subprocess.Popen(
        [sys.executable, "-m", "broker_server.cli", "start", "--preset", preset, "--set", f"archs={arch}",
         "--min-clients", "1", "--rounds", str(args.rounds), "--insecure", "--port", str(port), "--fed", fed,
         "--public-data", "fashion-mnist", "--state-dir", str(where / "server"), "--round-timeout", "3600"],
        env=env, stdout=open(where / "server.log", "wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    t0 = time.time()
    join = subprocess.Popen(
        [sys.executable, "-m", "edge_agent.cli", "join", "-v", "--broker", f"mqtt://127.0.0.1:{port}", "--fed", fed,
         "--client-id", "dev0", "--data", f"npz:{args.npz}",
         "--threads", str(args.threads), "--connect-timeout", "1200"],
        env=env, stdout=open(where / "join.log", "wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    hwm = vmpeak = rss_max = 0
    last: dict[str, int] = {}
    try:
        while join.poll() is None:
            st = status_kb(join.pid)
            if st:
                last = st
                hwm, vmpeak = max(hwm, st.get("VmHWM", 0)), max(vmpeak, st.get("VmPeak", 0))
                rss_max = max(rss_max, st.get("VmRSS", 0))
            if time.time() - t0 > args.timeout:
                join.kill()
                raise TimeoutError(f"{fed}: join did not finish within {args.timeout} s")
            time.sleep(0.05)
    finally:
        for p in (join, server):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    log = (where / "join.log").read_text(errors="replace")
    if join.returncode != 0:
        slog = (where / "server.log").read_text(errors="replace")
        return {"arch": arch, "preset": preset, "error": f"join exited with {join.returncode}", "log": log[-1500:],
                "server_log": slog[-1500:]}  # fmt: skip
    marks: dict[str, tuple[float, float]] = {}
    for m in MARK.finditer(log):
        marks.setdefault(m.group(1), (float(m.group(2)), float(m.group(3))))  # the first round's
    peak_marks = max((p for _, p in marks.values()), default=0.0)
    n, pbytes = trained_params(arch)
    return {
        "arch": arch,
        "preset": preset,
        "marks": marks,
        "peak_mb": max(hwm / 1024, peak_marks),
        "sampled_rss_max_mb": rss_max / 1024,
        "vmpeak_mb": vmpeak / 1024,
        "last": last,
        "params": n,
        "grad_plus_momentum_mb": 2 * pbytes / 2**20,
        "wall_s": time.time() - t0,
    }


FLOOR = """
import sys
from edge_agent.core.memory import pin_allocator
if "--pin" in sys.argv:
    pin_allocator()
import torch
def hwm():
    return max(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) / 1024
torch.set_num_threads(1)
t = hwm()
from edge_agent.training.models import build_model
from edge_agent.training.trainer import SGD
m = build_model(sys.argv[1], (1, 28, 28), 10)
b = hwm()
opt = SGD(list(m.parameters()), lr=0.01, momentum=0.9)
x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
for _ in range(10):
    loss = torch.nn.functional.cross_entropy(m.head(m.features(x)), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
print(t, b, hwm())
"""


def floor(arch: str, pin: bool = True) -> tuple[float, float, float]:
    """(peak after `import torch`, after building the model, after 10 SGD steps at batch 64): torch alone, one
    thread, no agent, no data, no MQTT: what any torch device process training `arch` holds at least."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    argv = [sys.executable, "-c", FLOOR, arch, *(["--pin"] if pin else [])]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    a, b, c = (float(v) for v in out.stdout.split())
    return a, b, c


def extra_sizes() -> dict[str, tuple[float, list[str]]]:
    """extra -> (MB installed by its distributions' closure, the distributions), base install included."""

    def closure(reqs: list[str]) -> set[str]:
        seen: set[str] = set()
        todo = list(reqs)
        while todo:
            r = Requirement(todo.pop())
            if r.marker is not None and not r.marker.evaluate({"extra": ""}):
                continue
            name = r.name.lower().replace("_", "-")
            if name in seen:
                continue
            try:
                dist = metadata.distribution(r.name)
            except metadata.PackageNotFoundError:
                continue
            seen.add(name)
            for dep in dist.requires or []:
                if "extra ==" not in dep:
                    todo.append(dep)
        return seen

    def size(name: str) -> int:
        dist = metadata.distribution(name)
        total = 0
        for f in dist.files or []:
            try:
                total += Path(str(dist.locate_file(f))).stat().st_size
            except OSError:
                pass
        return total

    me = metadata.distribution("protofl-edge")
    base = [r for r in me.requires or [] if "extra ==" not in r]
    out: dict[str, tuple[float, list[str]]] = {}
    base_set = closure(base)
    out["(base)"] = (sum(size(d) for d in base_set) / 1e6, sorted(base_set))
    for extra in EXTRAS:
        reqs = [r.split(";")[0] for r in me.requires or [] if f'extra == "{extra}"' in r]
        dists = closure(reqs) - base_set
        out[extra] = (sum(size(d) for d in dists) / 1e6, sorted(dists))
    return out


def report(runs: list[dict[str, Any]], sizes: dict[str, tuple[float, list[str]]], args: argparse.Namespace) -> str:
    cpu = cpu_name()
    load = os.getloadavg()
    import torch

    lines = [
        "# FOOTPRINT: the device agent's memory (issue 44)",
        "",
        f"Measured by `python -m bench.bench_footprint --archs {','.join(args.archs)} --presets "
        f"{','.join(args.presets)} --images {args.images} --rounds {args.rounds} --threads {args.threads}` "
        f"on {cpu} ({os.cpu_count()} cores, shared: load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the "
        f"end), Python {platform.python_version()}, torch {torch.__version__}, x86-64. Each row: a real "
        "`protofl-server start` (its local Mosquitto) and one real `protofl-edge join -v --data npz:own.npz "
        f"--threads {args.threads}` (its own data: the first {args.images} images of Fashion-MNIST's training split "
        "from Debian's package, 25 % held out for its accuracy), "
        f"{args.rounds} round(s). "
        "Resident memory in MB (MiB) as the kernel counts it (/proc/PID/status: VmHWM is the peak, kept by the "
        "kernel, so no spike is missed); the phases are the device's own marks (edge_agent/core/memory.py), the growth "
        "of its peak from one to the next.",
        "",
        "| arch | preset | params | import (+torch) | connect (MQTT) | data | model | training | uploads "
        "| evaluation | **peak** | grad+momentum (computed) | address space (VmPeak) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        if "error" in r:
            lines.append(f"| {r['arch']} | {r['preset']} | | {r['error']} (see below) |" + " |" * 9)
            continue
        marks = r["marks"]
        cells, prev = [], 0.0
        for ph in PHASES:
            if ph in marks:
                peak = marks[ph][1]
                cells.append(f"{peak:.0f}" if ph == "imports" else f"+{peak - prev:.0f}")
                prev = peak
            else:
                cells.append("-")
        lines.append(
            f"| {r['arch']} | {r['preset']} | {r['params']:,} | " + " | ".join(cells) + f" | **{r['peak_mb']:.0f}** | "
            f"{r['grad_plus_momentum_mb']:.1f} | {r['vmpeak_mb']:.0f} |"
        )
    lines += [
        "",
        "The floor: a bare process (`import torch`, build the model, 10 SGD steps at batch 64 on random inputs, one "
        "thread; no agent, no data, no MQTT), peak resident MB after each. `import torch` alone is the first column: "
        "no device process training with torch holds less.",
        "",
        "| arch | import torch | + model | + 10 training steps | the same, glibc's mmap threshold left dynamic |",
        "|---|---:|---:|---:|---:|",
    ]
    for arch in dict.fromkeys(r["arch"] for r in runs if "error" not in r):
        a, b, c = floor(arch)
        lines.append(f"| {arch} | {a:.0f} | {b:.0f} | {c:.0f} | {floor(arch, pin=False)[2]:.0f} |")
    lines += [
        "",
        "Installed size of each extra on this machine (x86-64 wheels, the files pip installed for the distributions "
        "the extra adds to the base install, from site-packages' RECORD files; the base install is numpy, msgpack, "
        "paho-mqtt, typer, rich, cryptography, prometheus-client and what they pull in). The aarch64 sizes are in "
        "ARM64.md.",
        "",
        "| extra | MB installed | distributions |",
        "|---|---:|---|",
    ]
    for extra, (mb, dists) in sizes.items():
        lines.append(f"| {extra} | {mb:.1f} | {', '.join(dists) or '(not installed here)'} |")
    return "\n".join(lines) + "\n"


PACKAGE_DATA = REPO / "edge_agent" / "footprint.json"


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def package_data(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """What `protofl-edge models` reads (edge_agent/ops/footprint.json): each run's peak, and where it was taken."""
    import torch

    load = os.getloadavg()
    peaks: dict[str, dict[str, float]] = {}
    for r in runs:
        if "error" not in r:
            peaks.setdefault(r["arch"], {})[r["preset"]] = round(r["peak_mb"], 1)
    return {
        "what": "peak resident MB (VmHWM) of one `protofl-edge join` training the model, per arch and preset",
        "command": f"python -m bench.bench_footprint --archs {','.join(args.archs)} --presets {','.join(args.presets)} "
        f"--images {args.images} --rounds {args.rounds} --threads {args.threads}",
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, {platform.machine()}, load average {load[0]:.1f} at the end",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "torch": torch.__version__,
        "threads": args.threads,
        "images": args.images,
        "peak_mb": peaks,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default="cnn,mlp,resnet8,mobilenetv2,resnet18")
    ap.add_argument("--presets", default="protofl,fedavg,fedproto")
    ap.add_argument("--images", type=int, default=2400, help="The device's own images (25 %% held out).")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "FOOTPRINT.md"))
    ap.add_argument("--json", default=None, help="Write the raw runs here, after each run.")
    ap.add_argument(
        "--package-data",
        default=None,
        help=f"Also write the peaks `protofl-edge models` shows here (shipped: {PACKAGE_DATA.relative_to(REPO)}).",
    )
    ap.add_argument("--report-only", action="store_true", help="Write the report from --json's runs, run nothing.")
    args = ap.parse_args(argv)
    args.archs, args.presets = args.archs.split(","), args.presets.split(",")
    runs: list[dict[str, Any]] = []
    if args.report_only:
        runs = json.loads(Path(args.json).read_text())
    else:
        with tempfile.TemporaryDirectory(prefix="protofl-footprint-") as tmp:
            args.npz = own_data(Path(tmp), args.images)
            for arch in args.archs:
                for preset in args.presets:
                    r = one_run(arch, preset, args, Path(tmp))
                    print(f"{arch:12s} {preset:9s} {r.get('peak_mb', r.get('error'))}  {r.get('marks')}", flush=True)
                    runs.append(r)
                    if args.json:
                        Path(args.json).write_text(json.dumps(runs, indent=1))
    text = report(runs, extra_sizes(), args)
    failed = [r for r in runs if "error" in r]
    if failed:
        text += "\nFailed runs (the device's and the server's last lines):\n\n" + "\n".join(
            f"- {r['arch']} {r['preset']}: {r['error']}\n\n```\n{r['log'][-600:]}\n{r['server_log'][-600:]}\n```"
            for r in failed
        )
    Path(args.out).write_text(text)
    if args.package_data:
        Path(args.package_data).write_text(json.dumps(package_data(runs, args), indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()

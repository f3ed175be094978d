"""The device agent on arm64 under qemu (issue 44): writes bench/results/ARM64.md.

Needs the arm64 system of bench/arm64_system.sh (root: binfmt_misc and chroot). A real server runs on the host
(`protofl-server start`, its local Mosquitto); the device is `protofl-edge join` as installed inside the arm64
system (`pip install 'protofl-edge[device]'`, PyPI's aarch64 wheels), run there through qemu-aarch64, and joins
it over the host's loopback. Then, in the second arm64 venv that has only the `onnx` extra (no torch),
`protofl-edge predict` labels Fashion-MNIST test images with the device's model exported on the host.

Measured: install size (from the build's sizes.txt), time from `join`'s start to its first upload, the device's
peak resident set (its own marks, edge_agent/core/memory.py: read inside the guest, /proc/self/status is the qemu
process's, so qemu's translator is counted in), predict's peak (/usr/bin/time inside the guest is absent: the
host's VmHWM of the qemu process), and predict's accuracy.

    sudo python -m bench.bench_arm64 [--train-limit 300] [--test-limit 200] [--rounds 1] [--threads 2] [--skip-predict]

--skip-predict runs the federation alone (predict's rows then say so).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "arm64_system.sh"
ROOT = Path(os.environ.get("PROTOFL_ARM64_ROOT", "/var/cache/protofl/arm64"))
MARK = re.compile(r"memory after (\w+): resident ([\d.]+) MB, peak ([\d.]+) MB")


def ready() -> str | None:
    """None where the arm64 system can run here, else why not."""
    if os.geteuid() != 0:
        return "needs root (chroot)"
    if not (ROOT / ".protofl-ready").exists():
        return f"no arm64 system at {ROOT}: build it with `sudo bash bench/arm64_system.sh` (cached once built)"
    entry = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
    if not entry.exists():
        return "qemu-aarch64 is not registered with binfmt_misc: `sudo bash bench/arm64_system.sh` registers it"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def in_arm64(*cmd: str, env: str = "", timeout: float = 3600, log: Path | None = None) -> subprocess.Popen[bytes]:
    """`cmd` inside the arm64 system (niced: emulation is slow and this machine is shared)."""
    e = dict(os.environ, PROTOFL_ARM64_ENV=env)
    out = open(log, "wb") if log is not None else subprocess.PIPE  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        ["nice", "-n", "10", "bash", str(SCRIPT), "run", *cmd], env=e, stdout=out, stderr=subprocess.STDOUT
    )


def host_server(work: Path, port: int, rounds: int, fed: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-m", "broker_server.cli", "start", "--preset", "fedproto", "--min-clients", "1",
         "--rounds", str(rounds), "--insecure", "--port", str(port), "--fed", fed, "--round-timeout", "7200",
         "--state-dir", str(work / "server")],
        env=env, stdout=open(work / "server.log", "wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip


def tree_hwm_mb(pid: int) -> float:
    """The largest VmHWM among `pid` and its descendants (the qemu-aarch64 process running the guest's python)."""
    best = 0.0
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                best = int(line.split()[1]) / 1024
    except OSError:
        pass
    kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return max([best, *(tree_hwm_mb(int(k)) for k in kids)])


def guest_maxrss_mb(code: str) -> float:
    """The peak resident set of the device venv's python running `code` under qemu (getrusage passes through
    qemu-user to the host: the qemu process's, translator included)."""
    probe = f"{code}\nimport resource\nprint('maxrss', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    out, _ = in_arm64("python", "-c", probe).communicate(timeout=1800)
    m = re.search(rb"maxrss (\d+)", out)
    if m is None:
        raise RuntimeError(f"python under qemu did not run {code!r}:\n{out[-2000:].decode(errors='replace')}")
    return int(m.group(1)) / 1024


def run_join(work: Path, args: argparse.Namespace, installed: bool) -> dict[str, Any]:
    """A federation of one arm64 device; `installed`: the package as pip installed it (else this tree's source)."""
    port, fed = free_port(), f"arm64-{os.getpid()}"
    server = host_server(work, port, args.rounds, fed)
    env = "" if installed else f"PYTHONPATH={work / 'src'}"
    cmd = ["protofl-edge", "join"] if installed else ["python", "-m", "edge_agent.cli", "join"]
    t0 = time.time()
    join = in_arm64(
        *cmd, "-v", "--broker", f"mqtt://127.0.0.1:{port}", "--fed", fed, "--client-id", "pi",
        "--data", "fashion-mnist", "--partition", "0/1", "--train-limit", str(args.train_limit),
        "--test-limit", str(args.test_limit), "--threads", str(args.threads), "--connect-timeout", "600",
        "--state-dir", str(work / "pi"),
        env=env, log=work / "join.log",
    )  # fmt: skip
    first_upload = None
    hwm = 0.0
    try:
        while join.poll() is None:
            if first_upload is None and "uploaded" in (work / "join.log").read_text(errors="replace"):
                first_upload = time.time() - t0
            hwm = max(hwm, tree_hwm_mb(join.pid))
            if time.time() - t0 > args.timeout:
                raise TimeoutError(f"the arm64 join did not finish within {args.timeout} s")
            time.sleep(0.5)
    finally:
        for p in (join, server):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
    log = (work / "join.log").read_text(errors="replace")
    slog = (work / "server.log").read_text(errors="replace")
    if join.returncode != 0:
        raise RuntimeError(f"the arm64 join exited with {join.returncode}:\n{log[-3000:]}\nserver:\n{slog[-1500:]}")
    marks = {m.group(1): float(m.group(3)) for m in MARK.finditer(log)}
    if first_upload is None and "uploaded" in log:
        first_upload = time.time() - t0
    return {
        "wall_s": time.time() - t0,
        "first_upload_s": first_upload,
        "peak_mb": max(marks.values(), default=0.0),
        "marks": marks,
        "qemu_hwm_mb": hwm,
        "log": log,
        "server_log": slog,
        "machine": re.findall(r"aarch64", log),
    }


def run_predict(work: Path) -> dict[str, Any]:
    """Export the device's model on the host, label 500 test images inside the arm64 onnx-only venv."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    arts = next((work / "pi").glob("**/devices/pi"))
    subprocess.run(
        [sys.executable, "-m", "export.cli", "onnx", "--from", str(arts), "--out", str(work / "pi.onnx")],
        env=env, check=True, capture_output=True,
    )  # fmt: skip
    os.chmod(work, 0o755)
    t0 = time.time()
    p = in_arm64(
        "/opt/protofl/onnx/bin/protofl-edge", "predict", "--model", str(work / "pi.onnx"), "--data", "fashion-mnist",
        "--limit", "500", "--show", "0", "--threads", "2", log=work / "predict.log",
    )  # fmt: skip
    hwm = 0.0
    while p.poll() is None:
        hwm = max(hwm, tree_hwm_mb(p.pid))
        time.sleep(0.2)
    out = (work / "predict.log").read_text(errors="replace")
    if p.returncode != 0:
        raise RuntimeError(f"predict in the arm64 onnx venv exited with {p.returncode}:\n{out[-2000:]}")
    return {"wall_s": time.time() - t0, "qemu_hwm_mb": hwm, "out": out}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train-limit", type=int, default=300)
    ap.add_argument("--test-limit", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--skip-predict", action="store_true", help="run the join alone, not predict in the onnx venv")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "ARM64.md"))
    args = ap.parse_args(argv)
    why = ready()
    if why is not None:
        raise SystemExit(f"bench_arm64: {why}")
    work = Path("/tmp") / f"protofl-arm64-{os.getpid()}"
    work.mkdir(mode=0o755)
    try:
        j = run_join(work, args, installed=True)
        print(f"join: {j['wall_s']:.0f} s, first upload {j['first_upload_s']} s, peak {j['peak_mb']} MB", flush=True)
        pr = None if args.skip_predict else run_predict(work)
        floor = {"python alone": guest_maxrss_mb("pass"), "import torch": guest_maxrss_mb("import torch")}
        if pr is not None:
            print(pr["out"][-800:], flush=True)
        sizes = dict(line.split() for line in (ROOT / "opt/protofl/sizes.txt").read_text().splitlines() if line.strip())
        freeze = (ROOT / "opt/protofl/device.freeze").read_text()
        torch_v = next((ln for ln in freeze.splitlines() if ln.startswith("torch==")), "torch ?")
        cuda = [ln.split("==")[0] for ln in freeze.splitlines() if ln.startswith(("nvidia-", "cuda-", "triton"))]
        install = f"{sizes['install_s']} s" + (
            " (the onnx venv only: this build resumed after the device venv)" if "resumed" in sizes else ""
        )
        wheel = (
            f"PyPI's aarch64 {torch_v} wheel is NOT a CPU build: it pulled {len(cuda)} CUDA packages "
            f"({', '.join(cuda[:4])}, ...), never used on a Pi. On a Pi install the CPU build first: "
            "`pip install torch --index-url https://download.pytorch.org/whl/cpu` (for the script: "
            "PROTOFL_ARM64_TORCH='torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu'; this host could "
            "not reach download.pytorch.org, so that route is untested here)."
            if cuda
            else f"the {torch_v} wheel installed is a CPU build (no CUDA packages)."
        )
        flags = f"--train-limit {args.train_limit} --test-limit {args.test_limit}\n--rounds {args.rounds}"
        flags += f" --threads {args.threads}"
        flags += f" --timeout {args.timeout:.0f}" + (" --skip-predict" if args.skip_predict else "")
        if pr is None:
            predict_rows = "| `predict` (onnxruntime, no torch) | not run (--skip-predict) |\n"
        else:
            acc = re.search(r"accuracy[^\n]*", str(pr["out"]))
            predict_rows = (
                f"| `predict` (onnxruntime, no torch) on 500 test images: peak resident (qemu process) | "
                f"{pr['qemu_hwm_mb']:.0f} MB |\n| `predict` result | {acc.group(0) if acc else 'see the log'} |\n"
            )
        load = os.getloadavg()
        text = f"""# ARM64: the device agent on the processor of a Raspberry Pi, under qemu (issue 44)

Measured by `sudo nice python -m bench.bench_arm64 {
            flags
        }` after `sudo bash bench/arm64_system.sh` (Debian bookworm arm64 from
deb.debian.org by mmdebstrap, run through qemu-user-static {
            subprocess.run(["/usr/bin/qemu-aarch64-static", "--version"], capture_output=True, text=True).stdout.split(
                chr(10)
            )[0]
        } registered with binfmt_misc's F flag) on an x86-64 host with
{os.cpu_count()} cores shared with other work (load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end).
Inside: `pip install {torch_v}` then `pip install '/opt/protofl/src[device]'` (this tree) took the aarch64 wheels
from PyPI; a second venv has only `[onnx]`.
{textwrap.fill(wheel, 116)}

The guest does not see the host's /sys: oneDNN (xbyak) reads the CPU's MIDR_EL1 from
/sys/devices/system/cpu/cpu*/regs/identification/midr_el1, which qemu-user cannot provide, and with the host's /sys
bind-mounted `import torch` died ("Can't open MIDR_EL1 sysfs entry", then SIGSEGV, qemu 7.2, also with
QEMU_CPU=cortex-a72). bench/arm64_system.sh writes a fake CPU description instead: a Raspberry Pi 4's 4 Cortex-A72
cores (MIDR 0x410fd083, possible/present/online 0-3).

The federation: `protofl-server start --preset fedproto --min-clients 1 --rounds {args.rounds}` on the host; in the
arm64 system `protofl-edge join -v --data fashion-mnist --partition 0/1 --train-limit {args.train_limit}
--test-limit {args.test_limit} --threads {args.threads} --state-dir ...` (the cnn, Fashion-MNIST from Debian's
package inside the arm64 system) joined it over loopback and finished it (exit 0).

| what | figure |
|---|---|
| installed: device venv (torch, numpy, the agent, ...) | {int(sizes["device"]) / 1e6:.0f} MB (torch alone {
            int(sizes["torch"]) / 1e6:.0f} MB) |
| installed: onnx-only venv (predict) | {int(sizes["onnx"]) / 1e6:.0f} MB |
| the Debian arm64 base system (for scale) | {int(sizes["base_system"]) / 1e6:.0f} MB |
| pip install of both venvs under emulation | {install} |
| `join` start to its first upload (emulated: meaningless for a Pi) | {j["first_upload_s"]:.0f} s |
| `join` start to the federation's end | {j["wall_s"]:.0f} s |
| `join` peak resident set, its own reading (qemu's translator included) | {j["peak_mb"]:.0f} MB |
| `join` peak resident set, the host's VmHWM of the qemu process (sampled every 0.5 s) | {j["qemu_hwm_mb"]:.0f} MB |
| floors: the device venv's python under qemu, peak resident | {
            ", ".join(f"{k} {v:.0f} MB" for k, v in floor.items())
        } |
| `join` per phase (peak after each, MB) | {", ".join(f"{k} {v:.0f}" for k, v in j["marks"].items())} |
{predict_rows}
What emulation tells about a real Pi: that the wheels exist for aarch64 and install with pip alone (no compiler:
no grpcio-style build), that the agent imports, trains, uploads and finishes a federation on the aarch64 build of
torch and numpy (the same arithmetic on an ARM CPU's code paths: NEON kernels instead of AVX ones), and the memory
it holds (resident pages are the guest program's plus qemu's translation cache and its own code: an upper bound
for the same program on a Pi). What it does not tell: time. qemu translates every instruction in software, and
this host was shared, so the times above say nothing about a Pi's speed; calibrate a profile's compute_factor on a
real Pi (profiles/rpi3.toml says how). Nor the size of a Pi's install, nor its memory exactly: there torch comes
from the CPU index, while the CUDA build here loads libtorch_cuda.so (a library libtorch.so needs) on import (the
floors above: what python and qemu hold alone, what `import torch` adds) - compare with the x86 CPU build's figures
in FOOTPRINT.md.

Notes from issue 44's first build (not re-measured by this benchmark): mmdebstrap of the base system took 2,566 s on
this host, almost all of it the packages' maintainer scripts under emulation (py_compile, update-ca-certificates);
pip verifies TLS inside with the host's CA bundle (this host inspects TLS).
"""
        Path(args.out).write_text(text)
        print(text)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""What crash safety costs: aggregator uploads/s with fsync-before-ack vs without, in one run.

    python -m bench.bench_durability                       # 2000 uploads, 3 repeats, prints a table
    python -m bench.bench_durability --out bench/results/DURABILITY.md

The publisher of bench_mqtt (a separate process) plays N devices: N joins, then, once the round is open,
N prototype uploads (pre-encoded, QoS 1) as fast as it can. The aggregator service folds each one; its
rate is N / (round close - round open), as the aggregator records it. Three modes, interleaved, repeated:

- `memory`: no --state-dir, the broker's acks are paho's automatic ones (the state before issue 15);
- `journal, no fsync`: journal append + manual ack, but no fsync (not crash safe: the comparison the
  issue asks for, "without");
- `fsync each upload`: append + fsync, apply, acknowledge, one upload at a time;
- `fsync each batch`: what `start --state-dir` does (group commit): the uploads the service pumps in one
  go are appended and applied, one fsync makes them durable, then they are acknowledged; a checkpoint
  (and so any round message) also waits for that fsync.

The state dir lives on the disk given by --dir (default: a temporary directory under the repository, so
on the machine's real disk, not a tmpfs where fsync is free). Reports the median over repeats.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.bench_mqtt import service_round

REPO = Path(__file__).resolve().parents[1]
MODES = ("memory", "journal, no fsync", "fsync each upload", "fsync each batch")


def one_run(url: str, n: int, classes: int, dim: int, mode: str, state: Path | None) -> float:
    from broker_server.settings import Durability

    durability = Durability(state, fsync=mode != "journal, no fsync", group_commit=mode != "fsync each upload")
    rec = service_round(url, n, classes, dim, client_id=f"bench-agg-{time.monotonic_ns()}", durability=durability)
    return n / (rec.ended - rec.started)


def fsync_latency(directory: Path, n: int = 200) -> float:
    """Median seconds of one 256-byte append + fsync on this disk (what the journal pays per upload)."""
    path = directory / "fsync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    times = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            os.write(fd, b"x" * 256)
            os.fsync(fd)
            times.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        path.unlink()
    return statistics.median(times)


def run(n: int, classes: int, dim: int, repeats: int, directory: Path) -> dict[str, Any]:
    from broker_server.ops.broker import MosquittoBroker

    directory.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-durability-", dir=directory))
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        with MosquittoBroker(persistence=False) as broker:
            for r in range(repeats):
                for mode in MODES:
                    state = None if mode == "memory" else work / f"{r}-{mode.replace(' ', '').replace(',', '')}"
                    rates[mode].append(one_run(broker.url, n, classes, dim, mode, state))
                    print(f"repeat {r + 1}/{repeats} {mode:>18}: {rates[mode][-1]:8.0f} uploads/s", flush=True)
        fsync_s = fsync_latency(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {m: statistics.median(v) for m, v in rates.items()}
    return {
        "uploads": n,
        "classes": classes,
        "dim": dim,
        "repeats": repeats,
        "rates": rates,
        "median": med,
        "fsync_ms": 1000 * fsync_s,
        "cpus": os.cpu_count(),
        "machine": platform.platform(),
        "load": os.getloadavg(),
    }


def markdown(res: dict[str, Any], command: str) -> str:
    med, mem = res["median"], res["median"]["memory"]
    rows = "\n".join(
        f"| {m} | {med[m]:.0f} | {', '.join(f'{x:.0f}' for x in res['rates'][m])} | {med[m] / mem:.2f} |" for m in MODES
    )
    return f"""# Durability: what fsync-before-ack costs

Command: `{command}` ({time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, {res["cpus"]} CPUs, {res["machine"]};
load average at the end {res["load"][0]:.1f}, {res["load"][1]:.1f}, {res["load"][2]:.1f}).

{res["uploads"]} prototype uploads ({res["classes"]} classes x {res["dim"]} values, QoS 1) from one publisher
process through Mosquitto into the aggregator service; uploads/s = uploads / (round close - round open),
median of {res["repeats"]} interleaved repeats. One append + fsync of 256 bytes on this disk: median
{res["fsync_ms"]:.2f} ms.

| mode | uploads/s (median) | each repeat | vs memory |
|---|---|---|---|
{rows}

`memory`: no --state-dir (nothing survives a crash). `journal, no fsync`: journal + manual ack without
fsync (not crash safe; shows what the fsync alone costs). `fsync each upload`: append + fsync per upload
before its PUBACK. `fsync each batch`: what `protofl-server start --state-dir` does (group commit): one
fsync for the uploads pumped together, before any of their PUBACKs. In both fsync modes every upload is
on disk before the broker gets its PUBACK.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=REPO / ".bench-durability")
    ap.add_argument("--out", type=Path, help="write the result table (markdown) here")
    args = ap.parse_args()
    res = run(args.n, args.classes, args.dim, args.repeats, args.dir)
    command = (
        "python -m bench.bench_durability"
        + (f" --n {args.n}" if args.n != 2000 else "")
        + (f" --out {args.out}" if args.out else "")
    )
    text = markdown(res, command)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    shutil.rmtree(args.dir, ignore_errors=True) if args.dir == REPO / ".bench-durability" else None


if __name__ == "__main__":
    main()

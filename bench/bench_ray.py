"""In-process vs Ray for 20 devices on this machine, side by side in one run.

    nice -n 10 python -m bench.bench_ray                          # writes bench/results/RAY.md
    python -m bench.bench_ray --ray-address auto --device cuda    # on a cluster / a GPU machine

One process, one federation (FedProto, 20 clients, alpha 0.5, 5 % of Fashion-MNIST, evaluation as the
CLI's defaults), the two backends interleaved: in-process, Ray, in-process, Ray... The first Ray run
starts the workers (processes that import torch); later runs reuse them, as a session that runs several
simulations does (`bench.paper_table --backend ray` against one `ray start --head` cluster starts a
driver per run, so each of its runs pays the start). Starting Ray itself is timed apart. The reports
must agree (bytes exact, accuracies to 1e-5); the bench says whether they do.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "RAY.md"


def _strip(report: dict[str, Any]) -> dict[str, Any]:
    report = json.loads(json.dumps(report))
    report["totals"].pop("wall_s")
    report.pop("ray", None)
    report.pop("machine", None)
    return report


def _max_diff(a: Any, b: Any) -> float:
    """The largest difference between two reports' numbers (inf where their shapes or strings differ)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return float("inf")
        return max([_max_diff(a[k], b[k]) for k in a] or [0.0])
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return float("inf")
        return max([_max_diff(x, y) for x, y in zip(a, b, strict=True)] or [0.0])
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return 0.0 if a == b else float("inf")
    if isinstance(a, int) and isinstance(b, int):
        return 0.0 if a == b else float("inf")  # bytes, counts: exact
    return abs(float(a) - float(b))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_ray", description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="rounds of the three interleaved cases")
    ap.add_argument("--preset", default="fedproto")
    ap.add_argument("--dataset", default="fashion-mnist")
    ap.add_argument("--train-limit", type=int, default=3000)
    ap.add_argument("--test-limit", type=int, default=500)
    ap.add_argument("--device", default="cpu", help="torch device of the agents (cuda: one GPU share per worker)")
    ap.add_argument("--device-resources", default=None, help="default cpu=1, or cpu=1,gpu=<1/devices> with cuda")
    ap.add_argument("--ray-address", default=None, help="join this cluster (default: a local Ray instance)")
    ap.add_argument("--out", type=Path, default=OUT)
    ns = ap.parse_args(argv)

    import ray
    import torch

    from broker_server.simulation import SimulationSpec, run_simulation

    res = ns.device_resources or ("cpu=1,gpu=%g" % (1 / ns.devices) if ns.device == "cuda" else "cpu=1")
    base = dict(
        preset=ns.preset,
        dataset=ns.dataset,
        clients=ns.devices,
        alpha=0.5,
        rounds=ns.rounds,
        seed=0,
        train_limit=ns.train_limit,
        test_limit=ns.test_limit,
        device=ns.device,
    )
    load_before = os.getloadavg()
    t = time.perf_counter()
    if ns.ray_address:
        ray.init(address=ns.ray_address, configure_logging=False)
    else:
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, configure_logging=False)
    ray_start = time.perf_counter() - t
    threads = torch.get_num_threads()
    cases = (("in-process", "local", threads), ("in-process, 1 torch thread", "local", 1), ("Ray", "ray", threads))

    def run(backend: str, n_threads: int) -> tuple[float, dict[str, Any]]:
        torch.set_num_threads(n_threads)  # the driver's (in-process: the agents'); a worker sets its own
        spec = SimulationSpec(**base, backend=backend, device_resources=res)
        t = time.perf_counter()
        try:
            report = run_simulation(spec)
        finally:
            torch.set_num_threads(threads)
        return time.perf_counter() - t, report

    rows: list[tuple[str, int, float, dict[str, Any]]] = []
    try:
        cold, first = run("ray", threads)  # starts the workers; the timed Ray runs reuse them
        print(f"Ray, starting its workers: {cold:.1f} s", flush=True)
        for rep in range(ns.repeats):
            for name, backend, n_threads in cases:
                wall, report = run(backend, n_threads)
                rows.append((name, rep, wall, report))
                print(f"{name} run {rep + 1}: {wall:.1f} s", flush=True)
    finally:
        ray.shutdown()
    load_after = os.getloadavg()
    info = first["ray"]
    reference = rows[0][3]
    diff = max(_max_diff(_strip(reference), _strip(r[3])) for r in rows + [("", 0, 0.0, first)])
    lines = [
        f"# In-process vs Ray, {ns.devices} devices, one machine",
        "",
        f"`python -m bench.bench_ray{''.join(' ' + a for a in (sys.argv[1:] if argv is None else argv))}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}).",
        f"{ns.preset}, {ns.devices} devices, alpha 0.5, {ns.rounds} rounds, {ns.dataset} (train limit "
        f"{ns.train_limit}, test limit {ns.test_limit}), default evaluation, `--device {ns.device}`. Machine: "
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} ({threads} threads by default); "
        f"Ray {ray.__version__}: {info['workers']} workers of {info['device_resources']} on {info['nodes']} "
        f"node(s), one torch thread per whole CPU of a share. Load average before {load_before[0]:.1f}, after "
        f"{load_after[0]:.1f}: the machine was shared with other jobs, so compare within a repeat (the runs "
        "are interleaved).",
        "",
        "| repeat | " + " | ".join(f"{name} s" for name, _, _ in cases) + " | Ray / in-process | Ray / in-process "
        "1 thread |",
        "|---|" + "---:|" * (len(cases) + 2),
    ]
    for rep in range(ns.repeats):
        walls = [w for _, r, w, _ in rows if r == rep]
        lines.append(
            f"| {rep + 1} | "
            + " | ".join(f"{w:.1f}" for w in walls)
            + f" | {walls[2] / walls[0]:.2f} | {walls[2] / walls[1]:.2f} |"
        )
    lines += [
        "",
        f"The first Ray run, which starts the workers (processes that import torch), took {cold:.1f} s; the "
        "timed Ray runs reuse them, as one session's later runs do.",
        "",
        f"Starting the local Ray instance: {ray_start:.1f} s (not in the table; `simulate --backend ray` pays it "
        "once per command unless it joins a running cluster with `--ray-address`).",
        "",
        "Reports: "
        + (
            f"identical to the in-process one (bytes exact, accuracies within {diff:.1e})."
            if diff <= 1e-5
            else f"differ from the in-process one (largest difference {diff}): see the runs."
        ),
        "",
        "Reading: in-process torch already uses every core of this machine; Ray adds worker processes and a "
        "round trip per delivered message, and gains where a cluster has more cores or GPUs than one box, with "
        "the same report. Where the load average exceeds the core count (a machine shared with other jobs), "
        "separate worker processes get a larger share of the contended cores than one process does, which "
        "favours Ray here; so does torch's intra-op pool, whose threads wait on each other when another job "
        "holds a core (the 1-thread in-process column shows how much): a ratio below 1 on a loaded machine is "
        "not a speed-up on a quiet one.",
        "",
        "The GPU machine (16 cores, one GPU, `--device cuda` per worker) was not lent to this session: no "
        "figure for it here. Run there: `python -m bench.bench_ray --device cuda`.",
        "",
    ]
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text("\n".join(lines))
    print(f"written {ns.out}")
    return 0 if diff <= 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main())

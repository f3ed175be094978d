"""ONNX benchmark: extraction speed (torch vs onnxruntime fp32 / int8) and the frozen-backbone mode.

    python bench/bench_onnx.py                 # the figures in the issue note (a few minutes, 2 cores)
    python bench/bench_onnx.py --quick         # a smoke run
    python bench/bench_onnx.py --json out.json

Part 1 times prototype-space extraction (features graph: backbone + stem + adapter) of `cnn` and
`resnet8` on real Fashion-MNIST test images at batch 1 and 64, torch vs onnxruntime fp32 vs static
int8, for each thread count given, and the cost of one (re-)export as the OnnxExtractor pays it per round.
Part 2 runs the same federation (Fashion-MNIST, Dirichlet split, same seed) with a trainable and with a
frozen backbone and reports per-round on-device training time and accuracy; a third run repeats the
trainable one with the onnx extractor, to show what it costs and that it changes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import numpy as np  # noqa: E402
import torch  # noqa: E402

from broker_server.shell import Aggregator  # noqa: E402
from broker_server.simulation import SimulationSpec, prepare  # noqa: E402
from edge_agent.agent import ClientData, EdgeAgent  # noqa: E402
from edge_agent.local import LocalDevice  # noqa: E402
from edge_agent.models import build_model  # noqa: E402
from edge_agent.onnx_export import export_onnx  # noqa: E402
from export.bench import bench_model, speedups  # noqa: E402
from export.quantize import quantize_model  # noqa: E402
from protofl.data import load_images  # noqa: E402
from protofl.transport import InProcessBroker  # noqa: E402
from protofl.wire import Metrics  # noqa: E402


def extraction(archs: list[str], threads: list[int], iters: int) -> list[dict[str, Any]]:
    x, _, ds = load_images("fashion-mnist", "test", 256)
    calib, _, _ = load_images("fashion-mnist", "train", 512, seed=1)
    out = []
    for arch in archs:
        model = build_model(arch, (1, 28, 28), 10, seed=0)
        with tempfile.TemporaryDirectory() as tmp:
            fp32 = export_onnx(model, Path(tmp) / "fp32.onnx", mean=ds.mean, std=ds.std)
            legacy = export_onnx(model, Path(tmp) / "legacy.onnx", exporter="torchscript")
            int8 = quantize_model(fp32.path, Path(tmp) / "int8.onnx", "static", calib)
            for n in threads:
                rows = bench_model(model, {"onnx-fp32": fp32.path, "onnx-int8": int8}, x, (1, 64), n, iters)
                gains = speedups(rows)
                for r in rows:
                    d = r.as_dict() | {"arch": arch, "speedup_vs_torch": round(gains.get((r.backend, r.batch), 1.0), 2)}
                    out.append(d)
                    print(
                        f"  {arch:8s} {r.backend:9s} threads {n} batch {r.batch:3d}: {r.latency_ms:8.3f} ms "
                        f"{r.throughput:9.0f} img/s  x{d['speedup_vs_torch']:.2f} vs torch",
                        flush=True,
                    )
        out.append(
            {"arch": arch, "export_s_dynamo": round(fp32.seconds, 2), "export_s_torchscript": round(legacy.seconds, 2)}
        )
        print(f"  {arch:8s} one export: dynamo {fp32.seconds:.2f} s, torchscript {legacy.seconds:.2f} s", flush=True)
    return out


def federation(backbone: str, extractor: str, args: argparse.Namespace) -> dict[str, Any]:
    spec = SimulationSpec(
        preset=args.preset,
        dataset="fashion-mnist",
        clients=args.clients,
        alpha=args.alpha,
        rounds=args.rounds,
        seed=0,
        train_limit=args.train_limit,
        test_limit=args.test_limit,
        archs=(args.arch,),
        overrides={"backbone": backbone},
    )
    fed = prepare(spec)
    cfg, train, test, split = fed.cfg, fed.train, fed.test, fed.split
    metrics: dict[int, dict[str, Metrics]] = defaultdict(dict)
    broker = InProcessBroker()
    ids = [f"dev-{i:02d}" for i in range(spec.clients)]
    agg = Aggregator(
        cfg,
        "bench",
        broker.connect("server"),
        public=fed.public_set(),
        expected_clients=ids,
        on_metrics=lambda c, r, m, n: metrics[r].__setitem__(c, m),
    )
    x_test = test.normalized()
    agents = []
    for i, cid in enumerate(ids):
        part = split.clients[i]
        data = ClientData(
            train.normalized(part.train),
            train.y[part.train],
            train.normalized(part.test),
            train.y[part.test],
            x_test,
            test.y,
            train.mean,
            train.std,
        )
        agents.append(EdgeAgent(cid, "bench", data, arch=args.arch, extractor=extractor))
    agg.start()
    for a in agents:
        LocalDevice(a, broker.connect(a.client_id)).start()
    start = time.perf_counter()
    while not agg.finished:
        if broker.pump(1) == 0:
            raise RuntimeError(f"federation stalled in round {agg.round}")
    broker.pump()
    wall = time.perf_counter() - start
    rows = []
    for r in sorted(metrics):
        ms = list(metrics[r].values())
        n_local = sum(m.n_local for m in ms)
        rows.append(
            {
                "round": r,
                "local_acc": round(sum(m.correct_local for m in ms) / n_local, 4) if n_local else None,
                "global_acc": round(float(np.mean([m.correct_test / m.n_test for m in ms if m.n_test])), 4),
                "train_s_per_device": round(statistics.mean(m.train_s for m in ms), 3),
            }
        )
    cache_s = [a._frozen.seconds for a in agents if a._frozen.h is not None]
    exports = [getattr(a._extractor, "exports", 0) for a in agents]
    return {
        "backbone": backbone,
        "extractor": extractor,
        "rounds": rows,
        "wall_s": round(wall, 1),
        "h_cache_s_per_device": round(statistics.mean(cache_s), 2) if cache_s else None,
        "h_cache_backend": agents[0]._frozen.used or None,
        "onnx_exports_per_device": statistics.mean(exports) if extractor == "onnx" else None,
        "clients": spec.clients,
        "samples_per_device": int(np.mean([len(c.train) for c in split.clients])),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke run (fewer iterations, rounds and samples)")
    p.add_argument("--threads", default="1,2", help="thread counts for part 1, comma-separated")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--preset", default="fedproto")
    p.add_argument("--arch", default="cnn", help="architecture of the federation in part 2")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--train-limit", type=int, default=12000)
    p.add_argument("--test-limit", type=int, default=2000)
    p.add_argument("--skip-extraction", action="store_true", help="part 2 only")
    p.add_argument("--skip-federation", action="store_true", help="part 1 only")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.quick:
        args.iters, args.rounds, args.train_limit, args.test_limit = 5, 2, 3000, 500
    torch.set_num_threads(1)  # part 2: one thread per simulated device, as on a small board
    import onnxruntime

    # Other processes on a shared machine slow both backends unevenly: the load average is recorded.
    report: dict[str, Any] = {
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "onnxruntime": onnxruntime.__version__,
            "load_avg_start": list(os.getloadavg()),
        }
    }
    if not args.skip_extraction:
        print(f"Part 1: features extraction, torch vs onnxruntime (median of {args.iters} runs)", flush=True)
        report["extraction"] = extraction(["cnn", "resnet8"], [int(t) for t in args.threads.split(",")], args.iters)
    if not args.skip_federation:
        print(
            f"Part 2: {args.preset}, {args.clients} x {args.arch}, Fashion-MNIST ({args.train_limit} train), "
            f"alpha {args.alpha}, {args.rounds} rounds",
            flush=True,
        )
        runs = []
        for backbone, extractor in (("train", "torch"), ("frozen", "torch"), ("train", "onnx")):
            run = federation(backbone, extractor, args)
            runs.append(run)
            last = run["rounds"][-1]
            per_round = statistics.mean(r["train_s_per_device"] for r in run["rounds"])
            print(
                f"  backbone={backbone:6s} extractor={extractor:5s}: train {per_round:.3f} s/round/device, "
                f"final local acc {last['local_acc']:.4f}, global acc {last['global_acc']:.4f}, "
                f"wall {run['wall_s']} s, h cache {run['h_cache_s_per_device']} s ({run['h_cache_backend']}), "
                f"exports/device {run['onnx_exports_per_device']}",
                flush=True,
            )
            for r in run["rounds"]:
                print(
                    f"      round {r['round']}: local {r['local_acc']:.4f} global {r['global_acc']:.4f} "
                    f"train {r['train_s_per_device']:.3f} s",
                    flush=True,
                )
        report["federation"] = runs
    report["machine"]["load_avg_end"] = list(os.getloadavg())
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
